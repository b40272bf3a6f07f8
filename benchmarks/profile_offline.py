"""Where a decode step's time goes, and what each change to the step bought.

Two modes:

    python benchmarks/profile_offline.py [--model models/demo] [--threads 1]
        One engine (the checkout's): aten ops per batch-1 decode step (a load-independent measure
        of per-step overhead), torch.profiler's top ops by self CPU time, and a cProfile of the
        engine's Python functions over a batch-1 generation.

    python benchmarks/profile_offline.py --variant base=cc75024 --variant step=HEAD \\
        --variant compiled=HEAD:graph_capture=compile [--repeats 7] [--prompt-lens 32,128,512] [--threads 1]
        The same batch-1 greedy decode on several git revisions (each unpacked with `git archive`
        and imported from there, in its own process, with its own engine options), measured side
        by side: the processes take turns, one measurement each per repeat. Per variant: the decode
        step's wall and CPU milliseconds (min / median / max over repeats), the ratio to the first
        variant per repeat, and aten ops per step. Prints the Markdown table it writes to
        BENCHMARKS.md (section "Step cost by change"), JSON and PNG under benchmarks/results/.
        With --prompt-lens, each repeat also times one prefill per length (a request for one
        token on a prompt of that many tokens, new token ids each time, so no prefix is cached)
        and writes a second table, section "Prefill cost by change" (`prefill_by_change.*`), in
        place of the decode step's (printed, and kept in the same JSON).

The decode step is (time for N tokens - time for 1 token) / (N - 1) of one request, on --threads
torch threads (one by default), so prefill and start-up are out of it. With --batch B, of B
requests at once (B different prompts, each PROMPT's ids rotated: nothing is shared between
them), the step of the whole batch: where batch 1 reads the weights once per token, a step of B
rows multiplies them (batch 8: a served step at load, and the rows of a speculative verification).
With --temperature T the requests sample at T instead of decoding greedily (request i seeded i,
so every run draws the same tokens): a sampled step also pays for the sampler's noise.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from report import Spread, export_revision, grouped_bars, machine, revision_subject, update_section  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SECTION = "Step cost by change (issue 14)"
PREFILL_SECTION = "Prefill cost by change (issue 14)"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


# ---- one engine: where the time goes -------------------------------------------------------

def _prompt(llm) -> list[int]:
    """PROMPT's token ids; a checkpoint without a tokenizer (the tests' tiny ones) gets as many fixed ids."""
    try:
        return llm.engine.tokenize(PROMPT)
    except ValueError:
        return [3 + i % 7 for i in range(16)]


def aten_ops_per_step(llm, sampling_params, new_tokens: int = 33) -> float:
    """Top-level aten ops per decode step: ops of an N-token request minus a 1-token one."""
    from torch.profiler import ProfilerActivity, profile

    prompt = _prompt(llm)

    def count(n: int) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate([prompt], sampling_params(temperature=0, max_tokens=n, ignore_eos=True))
        return sum(1 for e in prof.events() if e.name.startswith("aten::")
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))

    count(4)
    return (count(new_tokens) - count(1)) / (new_tokens - 1)


def profile_one(model: str, threads: int, rows: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pdserve.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model)
    prompt = _prompt(llm)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([prompt], params)
    print(f"== {model}: {aten_ops_per_step(llm, SamplingParams):.0f} top-level aten ops per batch-1 decode step")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([prompt], params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], params)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    print("== Python functions by own time\n" + out.getvalue())


# ---- several revisions, side by side -------------------------------------------------------

def batch_prompts(prompt: list[int], batch: int, vocab: int) -> list[list[int]]:
    """`batch` prompts of prompt's length: the first is `prompt`, each after it has every id moved
    on by its index (kept clear of the first three ids, as `prefill_ms`'s are)."""
    return [prompt] + [[3 + (t - 3 + i) % (vocab - 3) for t in prompt] for i in range(1, batch)]


def worker(model: str, options: dict, new_tokens: int, prompt_lens: list[int], threads: int, batch: int = 1,
           temperature: float = 0.0) -> None:
    """Run in a variant's process: load, count ops, then time one decode (and one prefill per
    prompt length) per line on stdin. With a temperature, request i is seeded i: every run draws
    the same tokens."""
    import torch

    from pdserve.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    start = time.perf_counter()
    llm = LLM(model, **options)
    startup = time.perf_counter() - start
    vocab = llm.engine.model_config.vocab_size
    prompts = batch_prompts(_prompt(llm), batch, vocab)

    def timed(n: int) -> tuple[float, float]:
        w, c = time.perf_counter(), time.process_time()
        llm.generate(prompts, [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
                               for i in range(len(prompts))])
        return time.perf_counter() - w, time.process_time() - c

    calls = iter(range(1 << 30))

    def prefill_ms(length: int) -> float:
        """One prompt of `length` token ids never used before in this process (no cached prefix)."""
        first = next(calls) * 7919
        ids = [3 + (first + 31 * i) % (vocab - 3) for i in range(length)]
        w = time.perf_counter()
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        return (time.perf_counter() - w) * 1e3

    timed(8)
    timed(new_tokens)
    for length in prompt_lens:  # first prompts of each length (a graph may specialize once)
        prefill_ms(length)
    ops = aten_ops_per_step(llm, SamplingParams) if options.get("graph_capture", "off") in ("off", "auto") else None
    print(json.dumps(dict(startup_seconds=startup, aten_ops_per_step=ops)), flush=True)
    for _ in sys.stdin:
        full, first = timed(new_tokens), timed(1)
        print(json.dumps(dict(wall_ms=(full[0] - first[0]) / (new_tokens - 1) * 1e3,
                              cpu_ms=(full[1] - first[1]) / (new_tokens - 1) * 1e3,
                              prefill_ms={str(n): prefill_ms(n) for n in prompt_lens})), flush=True)


def unpack(revision: str, into: Path) -> tuple[Path, str]:
    """The revision's sources laid out as the `pdserve` package (`report.export_revision`); its subject line."""
    return export_revision(revision, into), revision_subject(revision)


def parse_variant(text: str) -> tuple[str, str, dict]:
    """NAME=REV[:key=value,...] -> (name, revision, engine options); numbers and true/false are
    parsed, a `*_model` path is taken relative to the repository."""
    name, _, rest = text.partition("=")
    revision, _, opts = rest.partition(":")
    options = {}
    for pair in filter(None, opts.split(",")):
        key, _, value = pair.partition("=")
        if value in ("true", "false"):
            options[key] = value == "true"
        elif value[:1].isdigit():
            options[key] = json.loads(value)
        elif key.endswith("_model"):
            options[key] = str((REPO / value).resolve())
        else:
            options[key] = value
    return name, revision, options


def compare(variants: list[str], model: str, repeats: int, new_tokens: int, prompt_lens: list[int] = (),
            threads: int = 1, batch: int = 1, temperature: float = 0.0) -> dict:
    parsed = [parse_variant(v) for v in variants]
    model = str(Path(model).resolve())  # the workers run elsewhere
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        procs, info = {}, {}
        for i, (name, revision, options) in enumerate(parsed):
            path, subject = unpack(revision, Path(tmp) / f"v{i}")
            env = dict(os.environ, PYTHONPATH=str(path), OMP_NUM_THREADS=str(threads))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model, json.dumps(options), str(new_tokens),
                   json.dumps(list(prompt_lens)), str(threads), str(batch), str(temperature)]
            procs[name] = subprocess.Popen(cmd, env=env, cwd=tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            info[name] = dict(revision=revision, subject=subject, options=options)
        for name, proc in procs.items():
            info[name] |= json.loads(proc.stdout.readline())
        samples = {name: [] for name in procs}
        for rep in range(repeats):
            for name in (list(procs) if rep % 2 == 0 else list(procs)[::-1]):
                procs[name].stdin.write("go\n")
                procs[name].stdin.flush()
                samples[name].append(json.loads(procs[name].stdout.readline()))
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    first = parsed[0][0]
    for name in samples:
        for key in ("wall_ms", "cpu_ms"):
            info[name][key] = Spread.of(s[key] for s in samples[name]).as_dict()
            info[name][f"{key}_speedup"] = Spread.of(a[key] / b[key] for a, b in zip(samples[first], samples[name])).as_dict()
        info[name]["prefill_ms"] = {
            n: dict(ms=Spread.of(s["prefill_ms"][n] for s in samples[name]).as_dict(),
                    speedup=Spread.of(a["prefill_ms"][n] / b["prefill_ms"][n]
                                      for a, b in zip(samples[first], samples[name])).as_dict())
            for n in map(str, prompt_lens)}
    return dict(model=model, repeats=repeats, new_tokens=new_tokens, prompt_lens=list(prompt_lens), threads=threads,
                batch=batch, temperature=temperature, variants=info,
                machine=machine() | {"load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0]})


def markdown(result: dict, command: str) -> str:
    sp = Spread.from_dict
    model = Path(result["model"])
    model = model.relative_to(REPO) if model.is_relative_to(REPO) else model
    batch = result.get("batch", 1)  # older results: batch 1
    requests = "one request" if batch == 1 else f"{batch} requests at once"
    temperature = result.get("temperature", 0.0)  # older results: greedy
    kind = "greedy" if not temperature else f"temperature-{temperature:g}"
    lines = [f"Command: `{command}`. Batch-{batch} {kind} decode step of `{model}` ({requests}, "
             f"{result['new_tokens']} new tokens minus one, {_threads(result)}), each variant in its own process, "
             f"{result['repeats']} repeats taken in turn; min / median / max, speedups per repeat against the first "
             f"variant. Load average (1 min) at the start and end: {result['machine']['load_avg_1m_start']:.2f}, "
             f"{result['machine']['load_avg_1m_end']:.2f}.", "",
             "| variant | revision | options | aten ops / step | wall ms / step | CPU ms / step | speedup (wall) | "
             "speedup (CPU) | start-up s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        ops = "–" if v["aten_ops_per_step"] is None else f"{v['aten_ops_per_step']:.0f}"
        lines.append(f"| {name} | {v['subject'][:60]} | `{v['options'] or '{}'}` | {ops} | {sp(v['wall_ms']).fmt(2)} | "
                     f"{sp(v['cpu_ms']).fmt(2)} | {sp(v['wall_ms_speedup']).fmt(2, '×')} | "
                     f"{sp(v['cpu_ms_speedup']).fmt(2, '×')} | {v['startup_seconds']:.1f} |")
    lines += ["", "aten ops are counted only without graph capture (a compiled step runs generated code)."]
    return "\n".join(lines)


def _threads(result: dict) -> str:
    n = result.get("threads", 1)  # older results: one thread
    return "one torch thread" if n == 1 else f"{n} torch threads"


def prefill_markdown(result: dict, command: str) -> str:
    """Per variant and prompt length: ms to prefill one prompt (and pick its one token), and the
    speedup against the first variant within each repeat."""
    sp = Spread.from_dict
    lens = [str(n) for n in result["prompt_lens"]]
    lines = [f"Command: `{command}`. One request for one token on a prompt of each length (token ids never used "
             f"before in the process, so nothing is cached), batch 1, {_threads(result)}, each variant in its own "
             f"process, {result['repeats']} repeats taken in turn; ms per request, then the first variant's time "
             f"over this one's in the same repeat, min / median / max. Load average (1 min) at the start and end: "
             f"{result['machine']['load_avg_1m_start']:.2f}, {result['machine']['load_avg_1m_end']:.2f}.", "",
             "| variant | options | " + " | ".join(f"{n} tokens: ms" for n in lens) + " | "
             + " | ".join(f"{n} tokens: speedup" for n in lens) + " |", "|---|---|" + "---|" * (2 * len(lens))]
    for name, v in result["variants"].items():
        p = v["prefill_ms"]
        lines.append(f"| {name} | `{v['options'] or '{}'}` | " + " | ".join(sp(p[n]["ms"]).fmt(1) for n in lens) + " | "
                     + " | ".join(sp(p[n]["speedup"]).fmt(2, "×") for n in lens) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 3.5))
    grouped_bars(ax, names, [(key, [result["variants"][n][key] for n in names]) for key in ("wall_ms", "cpu_ms")])
    ax.set_ylabel("ms per decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_prefill(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, lens = list(result["variants"]), [str(n) for n in result["prompt_lens"]]
    fig, ax = plt.subplots(figsize=(1.2 * len(lens) * len(names) / 2 + 3, 3.5))
    grouped_bars(ax, [f"{n} tokens" for n in lens],
                 [(name, [result["variants"][name]["prefill_ms"][n]["ms"] for n in lens]) for name in names])
    ax.set_ylabel("ms per one-token request")
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6]),
               int(sys.argv[7]), float(sys.argv[8]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "models" / "demo"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--variant", action="append", default=[], help="NAME=REV[:key=value,...] (repeatable)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--new-tokens", type=int, default=129)
    p.add_argument("--batch", type=int, default=1, help="requests decoded at once (the decode step's rows)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (request i seeded i) instead of greedy decoding")
    p.add_argument("--prompt-lens", type=_lengths, default=[],
                   help="comma-separated prompt lengths: also time one prefill of each per repeat")
    p.add_argument("--no-markdown", action="store_true",
                   help="do not update BENCHMARKS.md; results go to benchmarks/results/*_by_change_partial.*")
    args = p.parse_args()
    if not args.variant:
        profile_one(args.model, args.threads, args.rows)
        return
    if args.batch < 1:
        p.error(f"--batch must be at least 1, got {args.batch}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    result = compare(args.variant, args.model, args.repeats, args.new_tokens, args.prompt_lens, args.threads,
                     args.batch, args.temperature)
    command = "python benchmarks/profile_offline.py " + " ".join(sys.argv[1:])
    result["command"] = command
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem, section, draw, table = outputs(bool(args.prompt_lens), args.no_markdown)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2))
    draw(result, RESULTS / f"{stem}.png")
    if not args.no_markdown:
        update_section(REPO / "BENCHMARKS.md", section, table(result, command))
    if args.prompt_lens:
        print(f"## {SECTION}\n\n{markdown(result, command)}\n")
    print(f"## {section}\n\n{table(result, command)}")


def outputs(prefill: bool, no_markdown: bool) -> tuple:
    """(files' stem, BENCHMARKS section, plot, table) of a side-by-side run. A prefill run prints its
    decode table but writes only its prefill table's files and section. With --no-markdown the
    files are `*_partial`, as spec_decode.py's: a scratch run does not overwrite the files the
    section's table came from."""
    stem, section, draw, table = (("prefill_by_change", PREFILL_SECTION, plot_prefill, prefill_markdown)
                                  if prefill else ("step_by_change", SECTION, plot, markdown))
    return (f"{stem}_partial" if no_markdown else stem), section, draw, table


def _lengths(text: str) -> list[int]:
    """"32,128,512" -> [32, 128, 512]; anything else is refused by argparse with the reason."""
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"prompt lengths must be comma-separated integers, got {text!r}") from None
    if not lens or min(lens) < 1:
        raise argparse.ArgumentTypeError(f"prompt lengths must be positive, got {text!r}")
    return lens


if __name__ == "__main__":
    main()
