"""Plain and speculative decoding of this checkout against another revision, side by side: what a
change to the engine bought in tokens per second, not only in the ratio speculation gets.

    python benchmarks/spec_by_revision.py --baseline REV [--rounds 8] [--cases 1:0 8:1]

`spec_decode.py` reports speculation's speed as a ratio to plain decoding on the same code. A
change that makes the target's step cheaper moves that ratio down even when every mode got
faster; this script measures the modes themselves against the revision before the change.

Two long-lived processes, one per revision (the baseline exported with `git archive` and put
first on PYTHONPATH, as `recovery.py` does), each with a plain engine and a speculative one (the
demo pair, the draft at adaptive depth up to 4 (the engine's default), `graph_capture="compile"`,
one torch thread), warmed up on every case.
They take turns: each round runs every case once in each process, the order of the processes
alternating round by round, so only one process computes at a time and the host's drift lands on
both. A case is one `generate` of 128 tokens per request (EOS ignored) at its batch size and
temperature; --cases names the batch sizes and temperatures (BATCH:TEMPERATURE, each measured plain
and speculating; by default batch 1 greedy and batch 8 at temperature 1). Per case: tokens/s of
each revision (min / median / max over rounds) and this checkout's over the baseline's, per
round. Writes benchmarks/results/spec_by_revision.json and .png and the "Speculation by
revision" section of BENCHMARKS.md; with other --cases, spec_by_revision_cases.json and .png, and
no section.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from child_process import ChildProcess, replies, reply, requests  # noqa: E402
from report import Spread, export_revision, files_line, grouped_bars, host, machine, publish  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SECTION = "Speculation by revision (`benchmarks/spec_by_revision.py`)"
DEFAULT_CASES = ("1:0", "8:1")
MAX_TOKENS = 128


def cases_of(specs) -> list[tuple[str, int, float]]:
    """BATCH:TEMPERATURE strings -> the cases, plain and speculating for each."""
    cases = []
    for spec in specs:
        try:
            b, t = spec.split(":")
            batch, temperature = int(b), float(t)
        except ValueError:
            raise ValueError(f"a case is BATCH:TEMPERATURE, as 8:1; got {spec!r}") from None
        if not 1 <= batch <= 32 or temperature < 0:
            raise ValueError(f"case {spec!r}: the batch must be 1 to 32 and the temperature at least 0")
        cases += [("plain", batch, temperature), ("spec", batch, temperature)]
    return cases


def serve(specs: list[str]) -> None:
    """The child: build both engines, warm them up, then run each case named on stdin."""
    cases = cases_of(specs)
    out = replies()
    import torch

    torch.set_num_threads(1)
    from pdserve.engine import LLM, SamplingParams
    from prompts import code_prompts

    models = REPO / "models"
    # 640 blocks: batch 32 without preemption
    options = dict(graph_capture="compile", num_kv_blocks=640, max_num_seqs=32, enable_prefix_caching=False)
    engines = {"plain": LLM(str(models / "demo"), **options),
               "spec": LLM(str(models / "demo"), draft_model=str(models / "demo-draft"), num_speculative_tokens=4,
                           **options)}
    sizes = sorted({b for _, b, _ in cases})
    prompts = {b: code_prompts(engines["plain"].engine.tokenizer, b) for b in sizes}
    params = {t: SamplingParams(temperature=t, max_tokens=MAX_TOKENS, ignore_eos=True, seed=1)
              for t in {t for _, _, t in cases}}
    for name, b, t in cases:
        engines[name].generate(prompts[b], params[t])
    reply(out, "ready")
    for name, b, t in requests():
        start = time.perf_counter()
        engines[name].generate(prompts[b], params[t])
        reply(out, MAX_TOKENS * b / (time.perf_counter() - start))


def case_name(case: tuple) -> str:
    name, b, t = case
    return f"{name}, batch {b}, temp {t:g}"


def measure(baseline: str, rounds: int, specs: list[str]) -> dict:
    from tqdm import tqdm

    measured = cases_of(specs)
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"this": dict(os.environ),
                "baseline": dict(os.environ, PYTHONPATH=str(export_revision(baseline, Path(tmp) / "baseline")))}
        procs = {}
        try:
            for arm, env in arms.items():  # the child's first line says it is ready
                procs[arm] = ChildProcess(f"engine ({env.get('PYTHONPATH') or 'this checkout'})", __file__,
                                          ["--serve", *specs], env=env, quiet=True)
            rates = {arm: {case_name(c): [] for c in measured} for arm in arms}
            with tqdm(total=rounds * len(measured) * 2, desc="spec_by_revision", unit="run") as bar:
                for r in range(rounds):
                    order = list(arms) if r % 2 == 0 else list(arms)[::-1]
                    for case in measured:
                        for arm in order:
                            rates[arm][case_name(case)].append(procs[arm].ask(case, timeout_s=300))
                            bar.update(1)
        finally:
            for proc in procs.values():
                proc.close()
    cases = {}
    for case in measured:
        key = case_name(case)
        this, base = rates["this"][key], rates["baseline"][key]
        cases[key] = dict(this=Spread.of(this).as_dict(), baseline=Spread.of(base).as_dict(),
                          ratio=Spread.of(t / b for t, b in zip(this, base)).as_dict())
    for b, t in sorted({(b, t) for _, b, t in measured}):
        plain, spec = rates["this"][case_name(("plain", b, t))], rates["this"][case_name(("spec", b, t))]
        bplain, bspec = rates["baseline"][case_name(("plain", b, t))], rates["baseline"][case_name(("spec", b, t))]
        cases[f"speculation / plain, batch {b}, temp {t:g}"] = dict(
            this=Spread.of(s / p for s, p in zip(spec, plain)).as_dict(),
            baseline=Spread.of(s / p for s, p in zip(bspec, bplain)).as_dict())
    return dict(baseline=baseline, head=_head(), rounds=rounds, cases=cases, case_specs=list(specs))


def _head() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--", "*.py", "*.cpp"],
                           capture_output=True, text=True).stdout.strip()  # results and notes do not count
    return out.stdout.strip() + (" (with uncommitted code)" if dirty else "")


def markdown(result: dict, command: str) -> str:
    fmt = lambda d, digits=0: Spread(**d).fmt(digits)  # noqa: E731
    lines = [f"Command: `{command}`. This checkout ({result['head']}) against {result['baseline']}: the demo pair, "
             f"the draft at adaptive depth up to 4 (the default), `graph_capture=\"compile\"`, 1 torch thread, {MAX_TOKENS} tokens per request; "
             f"{result['rounds']} rounds, the two revisions' processes taking turns; min / median / max. "
             f"Machine: {host(result['machine'])}.", "",
             "| case | tokens/s, this checkout | tokens/s, baseline | this / baseline |", "|---|---|---|---|"]
    for case in cases_of(result["case_specs"]):
        c = result["cases"][case_name(case)]
        lines.append(f"| {case_name(case)} | {fmt(c['this'])} | {fmt(c['baseline'])} | {fmt(c['ratio'], 2)}× |")
    lines += ["", "| speculation / plain | this checkout | baseline |", "|---|---|---|"]
    for key, c in result["cases"].items():
        if key.startswith("speculation"):
            lines.append(f"| {key.split(', ', 1)[1]} | {fmt(c['this'], 2)}× | {fmt(c['baseline'], 2)}× |")
    stem = result.get("stem", "spec_by_revision")
    lines += files_line(stem)
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [case_name(c) for c in cases_of(result["case_specs"])]
    fig, ax = plt.subplots(figsize=(8, 4))
    grouped_bars(ax, names, [(label, [result["cases"][n][arm] for n in names])
                             for arm, label in (("this", result["head"]), ("baseline", result["baseline"]))])
    ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    ax.set_ylabel("tokens/s (median, min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        return serve(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the git revision to measure beside this checkout")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), metavar="BATCH:TEMPERATURE",
                    help="batch sizes and temperatures, each measured plain and speculating (default: 1:0 8:1)")
    ap.add_argument("--no-markdown", action="store_true", help="do not update BENCHMARKS.md")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        cases_of(args.cases)
    except ValueError as e:
        ap.error(str(e))
    default = tuple(args.cases) == DEFAULT_CASES
    stem = "spec_by_revision" if default else "spec_by_revision_cases"
    result = measure(args.baseline, args.rounds, args.cases) | dict(machine=machine(), stem=stem)
    publish(result, "spec_by_revision", sys.argv[1:], RESULTS, markdown, plot,
            None if args.no_markdown or not default else SECTION, stem=stem)


if __name__ == "__main__":
    main()
