"""A 16-bit KV cache (bfloat16, or float16 with --narrow float16) against the float32 one, under
the same float32 model on the CPU (`EngineConfig.kv_cache_dtype`): decode steps and prefill, side
by side.

    python benchmarks/kv_cache_dtype.py [--model models/demo] [--repeats 5] [--threads 1] [--narrow float16]
        [--no-markdown]

Two engines in this process, default options but the cache's dtype (what a user who sets only
`--kv-cache-dtype bfloat16` gets), one torch thread. Each case, in every repeat, runs on both
engines back to back, in alternating order:

- decode at batch B and context L: B requests whose prompts hold L fresh token ids (nothing is
  cached from an earlier run), prefilled, then --steps decode steps of all B timed one by one
  (then the requests are aborted); the case's figure is the median step;
- prefill: one request for one token on a fresh prompt of L tokens, timed whole.

Per case: milliseconds on each cache (min / median / max over repeats) and the speedup, the
float32 time over the 16-bit one within each repeat. Also: the blocks each cache holds in the
default 512 MiB (exact, not timed), and how many of the decode cases' greedy tokens the two
caches gave alike (a 16-bit cache rounds K and V once when written, so they may differ). Writes
JSON and a PNG under benchmarks/results/ and, unless --no-markdown (or with --narrow float16,
whose files are kv_cache_dtype_float16.*), its section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.model_runner import kv_bytes_per_block  # noqa: E402
from report import Spread, fmt_spread, host, machine, publish  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SECTION = "KV cache dtype (`benchmarks/kv_cache_dtype.py`)"
# (kind, batch, context): decode cases read each sequence's K/V every step; prefill writes them
CASES = (("decode", 1, 1024), ("decode", 8, 1024), ("decode", 32, 256), ("decode", 32, 1024), ("prefill", 1, 1024))
QUICK_CASES = (("decode", 1, 48), ("decode", 4, 48), ("prefill", 1, 48))


class Prompts:
    """Fresh token ids for every request: no prefix is ever cached across runs."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size

    def take(self, n: int, length: int) -> list[list[int]]:
        return torch.randint(3, self.vocab_size, (n, length), generator=self.gen).tolist()


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[list[float], list[list[int]]]:
    """Each of `steps` decode steps' seconds once every prompt is prefilled (every request still
    decoding: the first prompts of a batch are done steps before the last, and decode meanwhile),
    then the requests aborted; and the greedy tokens of each up to there."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - len(prompts[0]), ignore_eos=True)
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    seqs = [engine.add_request(req_id, p, params) for req_id, p in zip(ids, prompts)]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    if any(s.is_finished for s in seqs):
        raise RuntimeError("a request finished inside the timed steps: prompts too long for the model")
    tokens = [list(s.output_token_ids) for s in seqs]
    for req_id in ids:
        engine.abort(req_id)
    return times, tokens


def prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - t


def run(model: str, repeats: int, steps: int, cases, threads: int, narrow: str = "bfloat16") -> dict:
    torch.set_num_threads(threads)
    caches = ("float32", narrow)
    llms = {c: LLM(model, kv_cache_dtype=c) for c in caches}
    blocks = {c: llms[c].engine.block_manager.num_blocks for c in caches}
    prompts = Prompts(llms["float32"].engine.model_config.vocab_size)
    seconds: dict[tuple[int, str], list[float]] = {}
    same = total = 0
    for kind, batch, context in cases:  # a warm-up of each decode case, not timed
        for c in caches:
            if kind == "decode":
                decode_steps(llms[c], prompts.take(batch, context), 2)
    with tqdm(total=repeats * len(cases) * len(caches), desc="kv_cache_dtype", unit="run") as bar:
        for r in range(repeats):
            for i, (kind, batch, context) in enumerate(cases):
                batch_prompts = prompts.take(batch, context)
                tokens = {}
                for c in (caches if (r + i) % 2 == 0 else caches[::-1]):
                    if kind == "decode":
                        times, tokens[c] = decode_steps(llms[c], batch_prompts, steps)
                        seconds.setdefault((i, c), []).append(statistics.median(times))
                    else:
                        seconds.setdefault((i, c), []).append(prefill_seconds(llms[c], batch_prompts[0]))
                    bar.update(1)
                if kind == "decode":
                    for a, b in zip(tokens["float32"], tokens[narrow]):  # as far as both went
                        same += sum(x == y for x, y in zip(a, b))
                        total += min(len(a), len(b))
    rows = []
    for i, (kind, batch, context) in enumerate(cases):
        wide, short = seconds[(i, "float32")], seconds[(i, narrow)]
        rows.append(dict(kind=kind, batch=batch, context=context,
                         ms={c: Spread.of(s * 1e3 for s in seconds[(i, c)]).as_dict() for c in caches},
                         speedup=Spread.of(w / n for w, n in zip(wide, short)).as_dict()))
    return dict(model=model, repeats=repeats, steps=steps, threads=threads, narrow=narrow, blocks=blocks,
                kv_bytes_per_token={c: kv_bytes_per_block(llms[c].engine.model_config, 1, llms[c].engine.kv_dtype)
                                    for c in caches},
                same_tokens=same, compared_tokens=total, rows=rows, machine=machine())


def markdown(result: dict, command: str) -> str:
    model = Path(result["model"]).resolve()
    model = model.relative_to(REPO) if model.is_relative_to(REPO) else model
    b, per_token, n = result["blocks"], result["kv_bytes_per_token"], result["narrow"]
    lines = [f"Command: `{command}`. `{model}` (float32 weights) with a float32 and a {n} KV cache, "
             f"otherwise default options, {result['threads']} torch thread(s), on {host(result['machine'])}; "
             f"min / median / max over {result['repeats']} interleaved repeats. A decode case's figure is the "
             f"median of {result['steps']} decode steps of the whole batch once its prompts (fresh token ids) are "
             "prefilled; a prefill case's, one request for one token. Speedup: the float32 time over the "
             f"{n} one, within each repeat.", "",
             f"| case | float32 cache, ms | {n} cache, ms | speedup |", "|---|---|---|---|"]
    for r in result["rows"]:
        name = (f"decode step, batch {r['batch']}, context {r['context']}" if r["kind"] == "decode"
                else f"prefill, {r['context']}-token prompt")
        lines.append(f"| {name} | {fmt_spread(r['ms']['float32'], 2)} | {fmt_spread(r['ms'][n], 2)} | "
                     f"{fmt_spread(r['speedup'], 2, '×')} |")
    stem = "kv_cache_dtype" if n == "bfloat16" else f"kv_cache_dtype_{n}"
    lines += ["", f"K/V bytes per token of the model: {per_token['float32']} float32, {per_token[n]} "
              f"{n}; blocks in the default 512 MiB (sized by the engine, not timed): {b['float32']} and "
              f"{b[n]}. Greedy tokens of the decode cases alike on both caches: {result['same_tokens']} "
              f"of {result['compared_tokens']}.", "",
              f"Files: `benchmarks/results/{stem}.json`, `benchmarks/results/{stem}.png`."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [f"{r['kind']}\nb{r['batch']} L{r['context']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    med = [r["speedup"]["median"] for r in rows]
    ax.bar(range(len(rows)), med, yerr=[[m - r["speedup"]["min"] for m, r in zip(med, rows)],
                                        [r["speedup"]["max"] - m for m, r in zip(med, rows)]], capsize=4)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_ylabel(f"speedup, {result['narrow']} cache over float32")
    ax.set_title(f"{Path(result['model']).name}: KV cache dtype, {result['threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "demo"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per run (their median counts)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="short contexts and batches (a smoke run)")
    parser.add_argument("--narrow", default="bfloat16", choices=["bfloat16", "float16"], help="the 16-bit cache")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.threads < 1:
        parser.error("--repeats, --steps and --threads must be at least 1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(args.model, args.repeats, args.steps, QUICK_CASES if args.quick else CASES, args.threads,
                 args.narrow)
    publish(result, "kv_cache_dtype", argv if argv is not None else sys.argv[1:], args.out, markdown, plot,
            None if args.no_markdown or args.quick or args.narrow != "bfloat16" else SECTION,
            stem=None if args.narrow == "bfloat16" else f"kv_cache_dtype_{args.narrow}")


if __name__ == "__main__":
    main()
