"""`gpu_check.py`'s model parts: decode tokens/s of a Llama-architecture model with random
weights, with and without CUDA graphs, against transformers' `generate`; and n-gram speculation
on the same model. Run through `gpu_check.py` (`--parts decode,spec`)."""
from __future__ import annotations

import time
from pathlib import Path

# --- decode -------------------------------------------------------------------------------

def _build_model(sizes: Sizes, path: Path) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(sizes.device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes.model)).to(torch.bfloat16)
    with torch.no_grad():  # a little wider than the default init, so the logits have spread
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    if not sizes.smoke:
        torch.cuda.empty_cache()
    return n


def _prompts(sizes: Sizes, n: int) -> list[list[int]]:
    vocab = sizes.model["vocab_size"]
    return [[(7 * i + 13 * j + 3) % (vocab - 3) + 3 for j in range(sizes.prompt_len)] for i in range(n)]


def _decode_rate(llm, prompts, new_tokens: int, sizes: Sizes) -> tuple[float, list[list[int]]]:
    """Decode tokens/s: a run of new_tokens minus a run of one token (the prefill and first token)."""
    import torch

    from pdserve.engine import SamplingParams

    sync = (lambda: None) if sizes.smoke else torch.cuda.synchronize

    def run(n):
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        sync()
        return time.perf_counter() - start, outs

    # warm both shapes: the one-token run's step (a one-token chunk after the cached prompt, with
    # prefix caching) is a kernel specialization of its own, compiled on first use. --smoke (the
    # interpreter compiles nothing, and its figure is not one) runs each shape once.
    repeats = 1 if sizes.smoke else 2
    if not sizes.smoke:
        run(1), run(8)
    one = min(run(1)[0] for _ in range(repeats))
    full, outs = min((run(new_tokens) for _ in range(repeats)), key=lambda r: r[0])
    return len(prompts) * (new_tokens - 1) / (full - one), [o.token_ids for o in outs]


def _hf_rate(path: Path, prompts, new_tokens: int, sizes: Sizes) -> float:
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(sizes.device).eval()
    x = torch.tensor(prompts, device=sizes.device)
    sync = (lambda: None) if sizes.smoke else torch.cuda.synchronize

    def run(n):
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        sync()
        return time.perf_counter() - start

    run(1), run(8)
    one, full = min(run(1) for _ in range(2)), min(run(new_tokens) for _ in range(2))
    del model
    return len(prompts) * (new_tokens - 1) / (full - one)


def part_decode(sizes: Sizes, report: dict, tmp: Path) -> dict:
    import torch

    from pdserve.engine import LLM

    path = tmp / "llama-random"
    start = time.perf_counter()
    num_params = _build_model(sizes, path)
    print(f"  built a {num_params / 1e9:.3f} B-parameter Llama (bf16, random weights) in {time.perf_counter() - start:.0f} s")
    out: dict = dict(num_params=num_params, weight_bytes=2 * num_params, config=sizes.model)
    captures = ("off",) if sizes.smoke else ("cuda_graphs", "off")
    tokens = {}
    max_batch = max(b for b, _ in sizes.batches)
    for capture in captures:
        start = time.perf_counter()
        options = dict(kernel_backend="triton") if sizes.smoke else {}
        llm = LLM(str(path), dtype="bfloat16", device=sizes.device, graph_capture=capture, max_num_seqs=max_batch,
                  kv_cache_memory_bytes=(64 << 20) if sizes.smoke else (8 << 30), **options)
        row = dict(startup_seconds=time.perf_counter() - start)
        for batch, new in sizes.batches:
            rate, toks = _decode_rate(llm, _prompts(sizes, batch), new, sizes)
            row[f"batch{batch}_tokens_per_s"] = rate
            row[f"batch{batch}_step_ms"] = 1e3 * batch / rate
            tokens[(capture, batch)] = toks
        print(f"  graph_capture={capture:12s} start-up {row['startup_seconds']:5.1f} s   "
              + "   ".join(f"batch {b}: {row[f'batch{b}_tokens_per_s']:8.1f} tok/s ({row[f'batch{b}_step_ms']:.2f} ms/step)"
                           for b, _ in sizes.batches))
        out[capture] = row
        del llm
        if not sizes.smoke:
            torch.cuda.empty_cache()
    if len(captures) == 2:
        out["greedy_identical"] = {f"batch{b}": tokens[("cuda_graphs", b)] == tokens[("off", b)] for b, _ in sizes.batches}
        out["cuda_graph_speedup"] = {f"batch{b}": out["cuda_graphs"][f"batch{b}_tokens_per_s"]
                                     / out["off"][f"batch{b}_tokens_per_s"] for b, _ in sizes.batches}
        print(f"  CUDA graphs: " + ", ".join(f"x{v:.2f} at {k}" for k, v in out["cuda_graph_speedup"].items())
              + f"; greedy identical: {out['greedy_identical']}")
    copy = report.get("env", {}).get("copy_tbps")
    if copy:  # a step reads every weight once: half the copy's bytes per second are reads
        floor_ms = 2 * num_params / (copy / 2 * 1e12) * 1e3
        best = out[captures[0]]["batch1_step_ms"]
        out["batch1_floor_ms"], out["batch1_step_over_floor"] = floor_ms, best / floor_ms
        print(f"  batch-1 step {best:.2f} ms against a floor of {floor_ms:.2f} ms (weights / read bandwidth): "
              f"{best / floor_ms:.2f}x")
    try:
        b1 = sizes.batches[0]
        hf = _hf_rate(path, _prompts(sizes, b1[0]), b1[1], sizes)
        out["transformers_batch1_tokens_per_s"] = hf
        ours = out[captures[0]]["batch1_tokens_per_s"]
        out["batch1_vs_transformers"] = ours / hf
        print(f"  transformers generate, batch 1: {hf:.1f} tok/s; pdserve ({captures[0]}) x{ours / hf:.2f}")
    except Exception as exc:
        out["transformers_error"] = f"{type(exc).__name__}: {exc}"
        print(f"  transformers generate failed: {out['transformers_error']}")
    out["ok"] = all(out.get("greedy_identical", {None: True}).values())
    return out


def part_spec(sizes: Sizes, report: dict, tmp: Path) -> dict:
    import torch

    from pdserve.engine import LLM, SamplingParams

    path = tmp / "llama-random"
    if not path.exists():
        _build_model(sizes, path)
    batch, new = sizes.batches[0]
    prompts = _prompts(sizes, batch)
    out = {}
    toks = {}
    for name, options in (("plain", {}), ("ngram_k4", dict(speculative_method="ngram", num_speculative_tokens=4))):
        extra = dict(kernel_backend="triton") if sizes.smoke else {}
        llm = LLM(str(path), dtype="bfloat16", device=sizes.device, max_num_seqs=4,
                  kv_cache_memory_bytes=(64 << 20) if sizes.smoke else (4 << 30), **options, **extra)
        rate, toks[name] = _decode_rate(llm, prompts, new, sizes)
        out[name] = dict(tokens_per_s=rate)
        if llm.engine.speculator is not None:
            st = llm.engine.speculator.stats
            out[name].update(drafts=st.num_drafts, draft_tokens=st.num_draft_tokens,
                             accepted_tokens=st.num_accepted_tokens)
        print(f"  {name:10s} batch {batch}: {rate:8.1f} tok/s")
        del llm
        if not sizes.smoke:
            torch.cuda.empty_cache()
    out["speedup"] = out["ngram_k4"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    same = sum(a == b for a, b in zip(toks["plain"][0], toks["ngram_k4"][0]))
    out["tokens_agreeing"] = same / max(1, len(toks["plain"][0]))
    out["identical"] = toks["plain"] == toks["ngram_k4"]
    print(f"  n-gram k=4 x{out['speedup']:.2f} of plain; tokens identical: {out['identical']} "
          f"({100 * out['tokens_agreeing']:.0f}% agree; bf16 verification can flip near-ties of a random model)")
    out["ok"] = True
    return out
