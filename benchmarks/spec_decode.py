"""Speculative decoding on the demo pair, measured side by side in one run (this machine is
shared and noisy: compare the ratios, not the absolute rates).

    python benchmarks/spec_decode.py [--quick]

Every configuration (plain decoding; draft-model proposer at fixed k = 4, fixed k = 2 and
adaptive depth up to 4; n-gram proposer at fixed k = 4 and adaptive) generates --max-tokens
tokens per prompt (ignore_eos, so every run emits the same number) for batches of 1, 8 and 32
prompts, greedy and at temperature 1. The prompts are 64–128-token cuts of this repository's
own engine/ and kernels/ sources, which the demo models never saw.

Per configuration: tokens/s (median of --runs repeats, the repeats interleaved across
configurations), the speedup against plain decoding at the same batch and temperature, the
acceptance rate α, the mean accepted length (tokens per verification step), the draft/target
step-cost ratio c (one draft forward against one target forward at the same batch size, timed
around `ModelRunner.execute`), the ideal speedup (1 − α^(k+1)) / ((1 − α)(1 + k·c)) with k the
mean depth used, and the measured speedup as a share of it. Greedy outputs with and without
speculation are compared token for token. JSON and a PNG under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Tiny models on a shared 2-core machine: one intra-op thread avoids OpenMP spin-waiting when
# the cores are oversubscribed (two threads were 10x slower per step here under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]

from pdserve.engine import LLM, SamplingParams

RESULTS = REPO / "benchmarks" / "results"
PROMPT_SOURCES = ("engine", "kernels")


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    options: dict = field(default_factory=dict)  # LLM options beyond the shared ones

    @property
    def is_plain(self) -> bool:
        return not self.options


METHODS = (
    Method("plain"),
    Method("draft k=4", dict(draft="draft", num_speculative_tokens=4, spec_adaptive=False)),
    Method("draft k=2", dict(draft="draft", num_speculative_tokens=2, spec_adaptive=False)),
    Method("draft adaptive", dict(draft="draft", num_speculative_tokens=4, spec_adaptive=True)),
    Method("ngram k=4", dict(speculative_method="ngram", num_speculative_tokens=4, spec_adaptive=False)),
    Method("ngram adaptive", dict(speculative_method="ngram", num_speculative_tokens=4, spec_adaptive=True)),
)


def code_prompts(tokenizer, num: int, min_len: int = 64, max_len: int = 128) -> list[list[int]]:
    """`num` cuts of 64–128 tokens from this repository's own sources, round-robin over files."""
    files = sorted(p for d in PROMPT_SOURCES for p in (REPO / d).rglob("*.py"))
    per_file = [tokenizer.encode(p.read_text()) for p in files]
    prompts, offset, i = [], 0, 0
    while len(prompts) < num:
        ids = per_file[i % len(per_file)]
        length = min_len + (len(prompts) * 37) % (max_len - min_len + 1)
        start = offset * 211
        if start + length <= len(ids):
            prompts.append(ids[start:start + length])
        i += 1
        if i % len(per_file) == 0:
            offset += 1
            if offset * 211 > max(map(len, per_file)):
                raise ValueError(f"not enough source text for {num} prompts")
    return prompts


class ForwardTimer:
    """Wraps one runner's `execute` and records (tokens in the pass, seconds) per call."""

    def __init__(self, runner):
        self.calls: list[tuple[int, float]] = []
        self._execute = runner.execute
        runner.execute = self

    def __call__(self, batch, *args, **kwargs):
        start = time.perf_counter()
        out = self._execute(batch, *args, **kwargs)
        self.calls.append((sum(e.num_new_tokens for e in batch), time.perf_counter() - start))
        return out

    def median_at(self, num_tokens: int) -> float | None:
        times = [t for n, t in self.calls if n == num_tokens]
        return statistics.median(times) if times else None


def build(method: Method, model: str, draft: str, num_kv_blocks: int, max_num_seqs: int) -> LLM:
    options = dict(method.options)
    if options.pop("draft", None):
        options["draft_model"] = draft
    return LLM(model, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, enable_prefix_caching=False,
               **options)


def stats_snapshot(llm: LLM) -> tuple[int, int, int, list[int]]:
    spec = llm.engine.speculator
    if spec is None:
        return 0, 0, 0, []
    st = spec.stats
    return st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos)


def run_once(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    before = stats_snapshot(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = stats_snapshot(llm)
    num_tokens = sum(len(o.token_ids) for o in outs)
    per_pos = [a - (before[3][i] if i < len(before[3]) else 0) for i, a in enumerate(after[3])]
    return dict(seconds=seconds, num_tokens=num_tokens, token_ids=[o.token_ids for o in outs],
                num_drafts=after[0] - before[0], num_draft_tokens=after[1] - before[1],
                num_accepted_tokens=after[2] - before[2], accepted_per_pos=per_pos)


def ideal_speedup(alpha: float, k: float, c: float) -> float:
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (1 + k * c)


def summarize(method: Method, runs: list[dict], plain: dict | None, c: float | None) -> dict:
    rates = [r["num_tokens"] / r["seconds"] for r in runs]
    rate = statistics.median(rates)
    out = dict(method=method.name, tokens_per_s=rate, tokens_per_s_runs=rates, num_tokens=runs[0]["num_tokens"])
    if plain is None:
        return out
    out["speedup"] = rate / plain["tokens_per_s"]
    drafts = sum(r["num_drafts"] for r in runs)
    draft_tokens = sum(r["num_draft_tokens"] for r in runs)
    accepted = sum(r["num_accepted_tokens"] for r in runs)
    alpha = accepted / draft_tokens if draft_tokens else 0.0
    mean_k = draft_tokens / drafts if drafts else 0.0
    out.update(alpha=alpha, mean_accepted_length=(accepted + drafts) / drafts if drafts else 0.0, mean_k=mean_k,
               num_drafts=drafts, accepted_per_pos=[sum(x) for x in zip(*(r["accepted_per_pos"] for r in runs))],
               c=c)
    if c is not None and drafts:
        out["ideal_speedup"] = ideal_speedup(alpha, mean_k, c)
        out["share_of_ideal"] = out["speedup"] / out["ideal_speedup"]
    return out


def run_benchmark(model: str, draft: str, batch_sizes: list[int], temperatures: list[float], max_tokens: int,
                  runs: int, methods: tuple[Method, ...] = METHODS, progress: bool = True) -> dict:
    """The whole measurement: every method × batch × temperature, `runs` interleaved repeats."""
    max_b = max(batch_sizes)
    blocks = max_b * (-(-(128 + max_tokens + 8) // 16)) + 16
    llms = {m.name: build(m, model, draft, blocks, max_b) for m in methods}
    timers = {m.name: (ForwardTimer(llms[m.name].engine.runner),
                       ForwardTimer(llms[m.name].engine.draft_runner) if llms[m.name].engine.draft_runner else None)
              for m in methods}
    prompts = code_prompts(llms[methods[0].name].engine.tokenizer, max_b)
    cases = [(b, t) for t in temperatures for b in batch_sizes]
    raw: dict[tuple, list[dict]] = {}
    warm = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for llm in llms.values():  # warm up: first passes allocate and fill caches
        llm.generate(prompts[:2], warm)
    with tqdm(total=runs * len(cases) * len(methods), desc="spec_decode", unit="gen", disable=not progress) as bar:
        for rep in range(runs):
            for b, temp in cases:
                params = SamplingParams(temperature=temp, max_tokens=max_tokens, ignore_eos=True, seed=None)
                order = methods if rep % 2 == 0 else methods[::-1]  # alternate who runs first
                for m in order:
                    for t in timers[m.name]:
                        if t is not None:
                            t.calls.clear()
                    r = run_once(llms[m.name], prompts[:b], params)
                    tt, dt = timers[m.name]
                    r["target_forward_s"] = tt.median_at(b)
                    r["draft_forward_s"] = dt.median_at(b) if dt else None
                    raw.setdefault((b, temp, m.name), []).append(r)
                    bar.update(1)
    return collect(raw, methods, cases)


def collect(raw: dict, methods: tuple[Method, ...], cases: list[tuple]) -> dict:
    rows = []
    for b, temp in cases:
        plain_runs = raw[(b, temp, "plain")]
        plain = summarize(METHODS[0], plain_runs, None, None)
        target_s = statistics.median(r["target_forward_s"] for r in plain_runs if r["target_forward_s"])
        plain.update(batch_size=b, temperature=temp, target_forward_s=target_s)
        rows.append(plain)
        # c is the pair's, not a method's: every draft forward over exactly b tokens (one per
        # sequence, past the catch-up pass) at this batch and temperature, whichever method ran it
        draft_times = [r["draft_forward_s"] for m in methods for r in raw[(b, temp, m.name)] if r["draft_forward_s"]]
        draft_s = statistics.median(draft_times) if draft_times else None
        plain["draft_forward_s"] = draft_s
        for m in methods:
            if m.is_plain:
                continue
            runs = raw[(b, temp, m.name)]
            uses_draft = "draft" in m.options
            c = (draft_s / target_s if draft_s is not None else None) if uses_draft else 0.0
            row = summarize(m, runs, plain, c)
            row.update(batch_size=b, temperature=temp)
            if temp == 0:
                row["greedy_identical"] = all(r["token_ids"] == p["token_ids"] for r, p in zip(runs, plain_runs))
            rows.append(row)
    return dict(rows=rows)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| batch | temp | method | tokens/s | speedup | α | mean accepted length | mean k | c | ideal | share of ideal | greedy identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        same = r.get("greedy_identical")
        lines.append(
            f"| {r['batch_size']} | {r['temperature']:g} | {r['method']} | {r['tokens_per_s']:.0f} | "
            f"{fmt(r.get('speedup'), '.2f')} | {fmt(r.get('alpha'), '.2f')} | {fmt(r.get('mean_accepted_length'), '.2f')} | "
            f"{fmt(r.get('mean_k'), '.2f')} | {fmt(r.get('c'), '.2f')} | {fmt(r.get('ideal_speedup'), '.2f')} | "
            f"{fmt(r.get('share_of_ideal'), '.2f')} | {'–' if same is None else ('yes' if same else '**no**')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    batches = sorted({r["batch_size"] for r in rows})
    names = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain"]
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4), squeeze=False)
    width = 0.8 / len(names)
    for ax, temp in zip(axes[0], temps):
        for j, name in enumerate(names):
            ys = [next((r["speedup"] for r in rows if r["method"] == name and r["batch_size"] == b
                        and r["temperature"] == temp), 0) for b in batches]
            ax.bar([i + j * width for i in range(len(batches))], ys, width, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(2.0, color="tab:gray", lw=0.8, ls="--")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_title(f"speedup vs plain decoding, temperature {temp:g}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "demo"))
    ap.add_argument("--draft", default=str(REPO / "models" / "demo-draft"))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 8, 32 tokens, 1 run")
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.max_tokens, args.runs = [1, 8], 32, 1
    torch.set_num_threads(args.threads)
    result = run_benchmark(args.model, args.draft, args.batch_sizes, args.temperatures, args.max_tokens, args.runs)
    result = dict(command=" ".join(["python", "benchmarks/spec_decode.py", *sys.argv[1:]]), args=vars(args),
                  torch_threads=torch.get_num_threads(), **result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "spec_decode.json").write_text(json.dumps(result, indent=2))
    plot(result["rows"], RESULTS / "spec_decode.png")
    print(markdown_table(result["rows"]))


if __name__ == "__main__":
    main()
