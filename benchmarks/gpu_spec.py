"""`gpu_check.py`'s spec_demo part: speculative decoding of the committed demo pair
(`models/demo`, `models/demo-draft`: trained together, so the draft is accepted on a GPU as on
the CPU, which a random-weight model cannot show) on CUDA with CUDA graphs, against plain
decoding, side by side in one process.

Every engine is built once. Per repeat and case (batch 1, 8 and 32; greedy and temperature 1,
seeded), the plain engine runs before and after each method (P m1 P m2 P ...), and a method's
speedup divides its tokens/s by the mean of the two plain runs beside it. A second plain engine is
measured like a method: the A/A control, how far two runs of the same thing differ here. Tokens
of every method are compared with plain decoding's: the coupled verifier reproduces plain decoding
for greedy and seeded requests alike, so any difference is a numeric near-tie (bf16) or a bug.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = {  # name -> LLM options beyond the shared ones ("draft": the demo draft's path)
    "plain, second engine": {},
    "draft k=4": dict(draft=True, num_speculative_tokens=4, spec_adaptive=False),
    "draft adaptive": dict(draft=True, num_speculative_tokens=4, spec_adaptive=True),
    "ngram adaptive": dict(speculative_method="ngram", num_speculative_tokens=4, spec_adaptive=True),
}


def part_spec_demo(sizes, report: dict) -> dict:
    import torch

    from prompts import code_prompts  # beside this module, on the path gpu_check.py set

    from pdserve.engine import LLM, SamplingParams

    model, draft = REPO / "models" / "demo", REPO / "models" / "demo-draft"
    batches, temperatures, max_tokens, repeats = ((1, 2), (0.0, 1.0), 8, 1) if sizes.smoke else \
        ((1, 8, 32), (0.0, 1.0), 128, 3)
    capture = "off" if sizes.smoke else "cuda_graphs"
    shared = dict(device=sizes.device, graph_capture=capture, max_num_seqs=max(batches), enable_prefix_caching=False,
                  kv_cache_memory_bytes=256 << 20)
    sync = (lambda: None) if sizes.smoke else torch.cuda.synchronize
    engines, startup = {}, {}
    for name, options in {"plain": {}, **METHODS}.items():
        options = dict(options)
        if options.pop("draft", False):
            options["draft_model"] = str(draft)
        start = time.perf_counter()
        engines[name] = LLM(str(model), **shared, **options)
        startup[name] = time.perf_counter() - start
    prompts = code_prompts(engines["plain"].engine.tokenizer, max(batches))
    print(f"  engines built ({capture}): " + ", ".join(f"{k} {v:.1f} s" for k, v in startup.items()))

    def run(name: str, batch: int, temperature: float) -> tuple[float, list[list[int]], tuple]:
        llm = engines[name]
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=1000 + i)
                  for i in range(batch)]
        spec = llm.engine.speculator
        before = (spec.stats.num_drafts, spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens) if spec else None
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts[:batch], params)
        sync()
        seconds = time.perf_counter() - start
        counts = None
        if spec:
            after = (spec.stats.num_drafts, spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens)
            counts = tuple(a - b for a, b in zip(after, before))
        return batch * max_tokens / seconds, [o.token_ids for o in outs], counts

    cases = [(b, t) for t in temperatures for b in batches]
    for name in engines:  # warm-up: every engine runs every case once
        for b, t in cases:
            run(name, b, t)
    rows = {(name, b, t): dict(speedups=[], rates=[], drafts=0, draft_tokens=0, accepted=0, identical=True)
            for name in METHODS for b, t in cases}
    plain_rates = {(b, t): [] for b, t in cases}
    for rep in range(repeats):
        order = list(METHODS) if rep % 2 == 0 else list(reversed(METHODS))
        for b, t in cases:
            before, want, _ = run("plain", b, t)
            plain_rates[b, t].append(before)
            for name in order:
                rate, got, counts = run(name, b, t)
                after, _, _ = run("plain", b, t)
                plain_rates[b, t].append(after)
                row = rows[name, b, t]
                row["rates"].append(rate)
                row["speedups"].append(rate / ((before + after) / 2))
                row["identical"] &= got == want
                if counts:
                    row["drafts"] += counts[0]
                    row["draft_tokens"] += counts[1]
                    row["accepted"] += counts[2]
                before = after
    table = []
    for (name, b, t), row in rows.items():
        sp = row["speedups"]
        entry = dict(method=name, batch=b, temperature=t, speedup_min=min(sp), speedup_median=statistics.median(sp),
                     speedup_max=max(sp), tokens_per_s_median=statistics.median(row["rates"]),
                     plain_tokens_per_s_median=statistics.median(plain_rates[b, t]), identical=row["identical"],
                     acceptance=row["accepted"] / row["draft_tokens"] if row["draft_tokens"] else None,
                     tokens_per_verification=(row["accepted"] + row["drafts"]) / row["drafts"] if row["drafts"] else None,
                     mean_k=row["draft_tokens"] / row["drafts"] if row["drafts"] else None)
        table.append(entry)
        acc = f"  α {entry['acceptance']:.2f}, k {entry['mean_k']:.1f}" if entry["acceptance"] is not None else ""
        print(f"  {name:22s} b{b:<3d} t{t:g}: x{entry['speedup_min']:.2f} / {entry['speedup_median']:.2f} / "
              f"{entry['speedup_max']:.2f} of plain ({entry['plain_tokens_per_s_median']:.0f} tok/s){acc}"
              f"{'' if entry['identical'] else '  TOKENS DIFFER'}")
    engines.clear()
    if not sizes.smoke:
        torch.cuda.empty_cache()
    return dict(capture=capture, max_tokens=max_tokens, repeats=repeats, startup_seconds=startup, table=table,
                ok=True)
