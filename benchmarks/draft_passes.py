"""How the draft's passes run, side by side in one process: one native call, the model's own
passes as graphs, and the same engine drafting pass by pass.

    python benchmarks/draft_passes.py [--repeats 10] [--adaptive] [--no-markdown]

Engines on the demo pair with the draft at fixed depth k = 4 (with --adaptive, adaptive depth up
to 4) and the tuned options (`graph_capture="compile"`, one torch thread), differing only in how
the draft's passes run: "native", the default (a batch drafting to one depth runs its passes as
one call of `pdserve::draft_passes`, `native_forward.NativePasses`, the catch-up pass included once it is
one or two tokens, as after every verification; greedy and temperature-only sampled batches; since
the fused step, a greedy or temperature-sampled batch's passes and verification as one call,
`fused_step.FusedSpecStep`);
"graphs" (the same passes at once through the model's own code, one compiled graph per pass:
`DraftPasses(native=False)`, the default before the native call); "catch-up apart"
(`proposer.catch_up_at_once = False`: the catch-up pass through `execute` and the sampler, the
passes after it at once, as before 3668ba0); "pass by pass" (`ModelRunner.passes` None: every
pass built on the host and sampled by the sampler, as before 2bb21d1). Plain decoding is measured
beside them. Cases: batch 1 greedy and at temperature 1 (4 prompts of code, 128 tokens each, one
after another), and batch 8 at temperature 1 (one batch of 8 prompts). The engines run in turn
within each repeat, the order reversing every repeat. Per case: tokens/s of each engine, and the
ratios of native to each other engine in the same repeat and of graphs and pass by pass to plain,
as min / median / max. Writes benchmarks/results/draft_passes.json and .png
(draft_passes_adaptive.* with --adaptive) and, unless --no-markdown, its BENCHMARKS.md section.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.draft_passes import DraftPasses  # noqa: E402
from report import Spread, files_line, fmt_spread, host, machine, publish  # noqa: E402
from prompts import code_prompts  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SECTION = "Draft passes at once (`benchmarks/draft_passes.py`)"
SECTION_ADAPTIVE = "Draft passes at once, adaptive depth (`benchmarks/draft_passes.py --adaptive`)"
CASES = ((1, 0.0), (1, 1.0), (8, 1.0))  # (batch, temperature)
ENGINES = ("native", "graphs", "catch-up apart", "pass by pass", "plain")


def build(model: str, draft: str, capture: str, num_kv_blocks: int, adaptive: bool = False) -> dict[str, LLM]:
    common = dict(num_kv_blocks=num_kv_blocks, max_num_seqs=16, enable_prefix_caching=False, graph_capture=capture)
    spec = dict(draft_model=draft, num_speculative_tokens=4, spec_adaptive=adaptive)
    llms = {name: LLM(model, **common, **spec) for name in ENGINES[:-1]}
    llms["plain"] = LLM(model, **common)
    graphs = llms["graphs"].engine.draft_runner
    if graphs.passes is not None:  # the model's own passes, compiled as the engine did before the native call
        graphs.passes = DraftPasses(graphs.model, graphs.kv_caches, graphs.block_size, compiled=capture == "compile",
                                    native=False)
        graphs.warm_up_draft_passes()
    llms["catch-up apart"].engine.speculator.proposer.catch_up_at_once = False  # the catch-up through `execute`
    llms["catch-up apart"].engine.fused_step = None  # its greedy steps too (graphs and pass by pass: never fused)
    llms["pass by pass"].engine.draft_runner.passes = None  # every pass through `execute` and the sampler
    return llms


def generate(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams) -> float:
    """Tokens/s: batch 1 runs the prompts one after another, else them all as one batch."""
    start = time.perf_counter()
    if batch == 1:
        n = sum(len(llm.generate([p], params)[0].token_ids) for p in prompts)
    else:
        n = sum(len(o.token_ids) for o in llm.generate(prompts, params))
    return n / (time.perf_counter() - start)


def run(model: str, draft: str, repeats: int, max_tokens: int, capture: str = "compile", threads: int = 1,
        progress: bool = True, adaptive: bool = False) -> dict:
    torch.set_num_threads(threads)
    llms = build(model, draft, capture, num_kv_blocks=16 * (-(-(128 + max_tokens + 8) // 16)) + 16, adaptive=adaptive)
    prompts = code_prompts(llms["plain"].engine.tokenizer, max(b for b, _ in CASES))
    for llm in llms.values():  # warm up: first passes allocate and fill caches
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    rates: dict[tuple, list[float]] = {}
    with tqdm(total=repeats * len(CASES) * len(ENGINES), desc="draft_passes", unit="gen", disable=not progress) as bar:
        for rep in range(repeats):
            for batch, temp in CASES:
                params = SamplingParams(temperature=temp, max_tokens=max_tokens, ignore_eos=True, seed=rep)
                for name in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
                    work = prompts[:4] if batch == 1 else prompts[:batch]
                    rates.setdefault((batch, temp, name), []).append(generate(llms[name], work, batch, params))
                    bar.update(1)
    rows = []
    for batch, temp in CASES:
        r = {name: rates[(batch, temp, name)] for name in ENGINES}
        rows.append(dict(batch=batch, temperature=temp,
                         tokens_per_s={name: Spread.of(v).as_dict() for name, v in r.items()},
                         **{f"{_key(a)}_vs_{_key(b)}": Spread.of(x / y for x, y in zip(r[a], r[b])).as_dict()
                            for a, b in RATIOS}))
    return dict(rows=rows, repeats=repeats, max_tokens=max_tokens, capture=capture, threads=threads, adaptive=adaptive,
                machine=machine())


RATIOS = (("native", "graphs"), ("native", "catch-up apart"), ("native", "pass by pass"), ("native", "plain"),
          ("graphs", "plain"), ("pass by pass", "plain"))


def _key(engine: str) -> str:
    return engine.replace(" ", "_").replace("-", "_")


def markdown(result: dict, command: str) -> str:
    depth = "adaptive depth up to 4" if result.get("adaptive") else "k = 4 fixed"
    lines = [f"Command: `{command}`. Demo pair, draft {depth}, `graph_capture=\"{result['capture']}\"`, "
             f"{result['threads']} torch thread, on {host(result['machine'])}; {result['repeats']} repeats, engines in "
             "turn, the order reversing every repeat; min / median / max, ratios within a repeat. \"Native\" runs the "
             "draft's passes at once in one native call (the default), \"graphs\" at once as compiled graphs of the "
             "model's passes (`DraftPasses(native=False)`), \"catch-up apart\" runs the catch-up pass through "
             "`execute` (`proposer.catch_up_at_once = False`), \"pass by pass\" every pass "
             "(`draft_runner.passes = None`).", "",
             "| batch | temp | " + " | ".join(f"tokens/s {e}" for e in ENGINES) + " | "
             + " | ".join(f"{a} / {b}" for a, b in RATIOS) + " |", "|---|---|" + "---|" * (len(ENGINES) + len(RATIOS))]
    for r in result["rows"]:
        t = r["tokens_per_s"]
        lines.append(f"| {r['batch']} | {r['temperature']:g} | " + " | ".join(fmt_spread(t[e], 0) for e in ENGINES) + " | "
                     + " | ".join(fmt_spread(r[f"{_key(a)}_vs_{_key(b)}"], 3, "×") for a, b in RATIOS) + " |")
    stem = "draft_passes_adaptive" if result.get("adaptive") else "draft_passes"
    lines += files_line(stem)
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"batch {r['batch']}, temp {r['temperature']:g}" for r in result["rows"]]
    width = 0.8 / len(RATIOS)
    for i, (a, b) in enumerate(RATIOS):
        key = f"{_key(a)}_vs_{_key(b)}"
        med = [r[key]["median"] for r in result["rows"]]
        err = [[r[key]["median"] - r[key]["min"] for r in result["rows"]], [r[key]["max"] - r[key]["median"] for r in result["rows"]]]
        ax.bar([x + width * (i - (len(RATIOS) - 1) / 2) for x in range(len(labels))], med, width, yerr=err, capsize=3,
               label=f"{a} / {b}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("tokens/s ratio (median, min–max)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "demo"))
    parser.add_argument("--draft", default=str(REPO / "models" / "demo-draft"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--graph-capture", default="compile", choices=["off", "compile"])
    parser.add_argument("--adaptive", action="store_true", help="the drafting engines at adaptive depth up to 4")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 1:
        parser.error("--repeats and --max-tokens must be at least 1")
    result = run(args.model, args.draft, args.repeats, args.max_tokens, args.graph_capture, adaptive=args.adaptive)
    publish(result, "draft_passes", argv if argv is not None else sys.argv[1:], args.out, markdown, plot,
            None if args.no_markdown else SECTION_ADAPTIVE if args.adaptive else SECTION,
            stem="draft_passes_adaptive" if args.adaptive else None)

if __name__ == "__main__":
    main()
