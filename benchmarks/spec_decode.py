"""Speculative decoding on the demo pair, measured side by side in one run (this machine is
shared and noisy: compare the ratios, not the absolute rates).

    python benchmarks/spec_decode.py [--quick] [--runs 5] [--rounds 1]

Every configuration (plain decoding; the draft-model proposer at fixed k = 4, fixed k = 2 and
adaptive depth up to 4; the n-gram proposer at fixed k = 4 and adaptive; at temperature 1 also the
rejection sampler beside the default coupled verifier; with --extra-methods "draft k=1", a fixed
depth of one too) generates --max-tokens tokens per prompt (ignore_eos, so every run emits the same
number) for batches of 1, 8 and 32 prompts, greedy and at temperature 1. The prompts are
64–128-token cuts of this repository's own engine/ and kernels/ sources, which the demo models never
saw. Each configuration's engine lives in a process of its own,
as a served engine does (with every engine in one process, the same plain configuration built first,
second and third ran its steps 1-6% faster the earlier it was built, so the methods built after
plain were measured slower than they are); a second plain engine in a process of its own is measured
like a method, as a control: how far two processes running the same configuration differ. Every
configuration runs with the tuned options (--graph-capture, --threads); a "newcomer" pair (README's
`LLM("models/demo", draft_model="models/demo-draft", num_speculative_tokens=4)` and plain
`LLM("models/demo")`, default options, default torch threads) is measured beside them at batch 1.

Every engine first runs each case once, whole (its warm-up: a fresh engine's one-time costs, the
adaptive gate's opening bursts among them, reported apart as first runs). Then per configuration,
over --runs repeats interleaved across configurations (the order reverses every repeat), each
configuration's run between two plain runs (B m1 B m2 B …: the host drifts over seconds, so a
speedup divides by the plain runs right beside the method's; with --rounds N, a repeat runs that
sequence N times back to back and keeps, for each run, its median round: one burst from another
tenant then decides no repeat): tokens/s, and that speedup, as min /
median / max, for the whole run and for its decode phase (after every prompt's first token: what
speculation can speed, and what the ideal speedup below models; the prefill is the same work either
way); and a speculative method's run, between two runs of its own engine with its speculator set
aside (B O m O B), its speedup against those: one process, so none of what separates two processes
of one configuration (`process_spread.py`, up to 10% at batch 32 on the Xeon); plain's own row
gives, in the speedup column, one plain run against the plain run before it, one configuration's
runs apart (an A/A control: what the host's drift alone does to a ratio); the acceptance rate α, the
mean accepted length (tokens per verification step), the mean depth k, the draft/target step-cost
ratio c (one draft forward against one target forward at the same batch size, timed around
`ModelRunner.execute` and the draft's passes; inside a fused step, by the op's own timer), the
ideal speedup (1 − α^(k+1)) / ((1 − α)(1 + k·c)), and the decode phase's measured speedup as a
share of it. Greedy outputs with and without speculation, and coupled-verifier
outputs at temperature 1 with and without, are compared token for token. Prints the Markdown it
writes to BENCHMARKS.md, with the command (`spec_decode_report.py` makes it, with the goals and the
plot); JSON and a PNG under benchmarks/results/. An adaptive method's JSON row also keeps each
repeat's drafts and its cost lines before and after the run (`per_repeat`, `cost_lines`).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.tokenizer import Tokenizer  # noqa: E402
from child_process import ChildProcess, replies, reply, requests  # noqa: E402
from prompts import code_prompts  # noqa: E402
from report import machine, update_section  # noqa: E402
from spec_decode_report import collect, decode_spt, first_runs, markdown, plot  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MARKDOWN = REPO / "BENCHMARKS.md"
SECTION = "Speculative decoding (issues 5, 10, 14)"


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    options: dict = field(default_factory=dict)  # LLM options beyond the shared ones
    temperatures: tuple[float, ...] | None = None  # None: every temperature
    is_newcomer: bool = False  # README's options, default torch threads, batch 1 only
    is_control: bool = False  # plain decoding measured like a method: another process's plain engine

    @property
    def speculates(self) -> bool:
        return "num_speculative_tokens" in self.options

    @property
    def is_plain(self) -> bool:
        """A baseline: the plain engine the methods' runs are divided by."""
        return not self.speculates and not self.is_control

    @property
    def uses_draft(self) -> bool:
        return "draft" in self.options


METHODS = (
    Method("plain"),
    Method("draft k=4", dict(draft="draft", num_speculative_tokens=4, spec_adaptive=False)),
    Method("draft k=2", dict(draft="draft", num_speculative_tokens=2, spec_adaptive=False)),
    Method("draft adaptive", dict(draft="draft", num_speculative_tokens=4, spec_adaptive=True)),
    Method("ngram k=4", dict(speculative_method="ngram", num_speculative_tokens=4, spec_adaptive=False)),
    Method("ngram adaptive", dict(speculative_method="ngram", num_speculative_tokens=4, spec_adaptive=True)),
    # greedy requests are verified the same way by both verifiers: compare them where they differ
    Method("draft k=4 rejection", dict(draft="draft", num_speculative_tokens=4, spec_adaptive=False,
                                       spec_verifier="rejection"), temperatures=(1.0,)),
    Method("draft adaptive rejection", dict(draft="draft", num_speculative_tokens=4, spec_adaptive=True,
                                            spec_verifier="rejection"), temperatures=(1.0,)),
    Method("plain, another process", is_control=True),
)
# measured only when named (--extra-methods): does any depth pay where adaptive sits at parity?
OPTIONAL = (Method("draft k=1", dict(draft="draft", num_speculative_tokens=1, spec_adaptive=False)),)
NEWCOMER = (
    Method("newcomer plain", dict(), is_newcomer=True),
    Method("newcomer draft k=4", dict(draft="draft", num_speculative_tokens=4), is_newcomer=True),
)


class ForwardTimer:
    """Wraps one runner's `execute` and records (tokens in the pass, seconds) per call; and a
    draft's passes run at once (`draft_passes`), as that many passes of equal seconds; a draft's
    passes inside the engine's fused steps too, where `FusedTimer` wraps the fused step."""

    def __init__(self, runner):
        self.calls: list[tuple[int, float]] = []
        self._execute, self._draft_passes = runner.execute, runner.draft_passes
        runner.execute, runner.draft_passes = self, self._timed_passes

    def __call__(self, batch, *args, **kwargs):
        start = time.perf_counter()
        out = self._execute(batch, *args, **kwargs)
        self.calls.append((sum(e.num_new_tokens for e in batch), time.perf_counter() - start))
        return out

    def _timed_passes(self, seqs, token_ids, positions, num_passes, *sampling, **options):
        start = time.perf_counter()
        out = self._draft_passes(seqs, token_ids, positions, num_passes, *sampling, **options)
        if out is not None:
            self.passes(len(seqs), time.perf_counter() - start, num_passes)
        return out

    def passes(self, num_seqs: int, seconds: float, num_passes: int) -> None:
        self.calls += [(num_seqs, seconds / num_passes)] * num_passes

    def median_at(self, num_tokens: int) -> float | None:
        times = [t for n, t in self.calls if n == num_tokens]
        return statistics.median(times) if times else None


class FusedTimer:
    """Wraps an engine's fused step (`fused_step.FusedSpecStep`): the draft's passes inside it go
    to the draft's `ForwardTimer` at the op's own seconds (its timer around the passes), as
    passes run at once go; c's draft figure would otherwise miss every step that fused."""

    def __init__(self, fused, draft_timer: ForwardTimer):
        self._fused, self._timer = fused, draft_timer

    def __getattr__(self, name):  # covers, prepare, takes: the fused step's own
        return getattr(self._fused, name)

    def __call__(self, batch):
        out = self._fused(batch)
        self._timer.passes(len(batch), out[2], max(len(d) for d in out[0]))
        return out


@dataclass(slots=True)
class Setup:
    model: str
    draft: str
    num_kv_blocks: int
    max_num_seqs: int
    tuned: dict  # options every tuned configuration gets (graph capture)
    threads: int
    default_threads: int

    @classmethod
    def of(cls, model: str, draft: str, max_batch: int, max_tokens: int, tuned: dict, threads: int) -> Setup:
        """The setup for batches up to `max_batch` of `code_prompts` (up to 128 tokens) generating
        `max_tokens`: a KV cache every sequence fits in at once (16-token blocks, a few spare)."""
        return cls(model, draft, max_batch * (-(-(128 + max_tokens + 8) // 16)) + 16, max_batch, tuned, threads,
                   torch.get_num_threads())


def build(method: Method, setup: Setup) -> tuple[LLM, float]:
    """The engine and its start-up seconds (weights, caches, graph capture)."""
    options = dict(method.options)
    if options.pop("draft", None):
        options["draft_model"] = setup.draft
    if not method.is_newcomer:
        options |= dict(num_kv_blocks=setup.num_kv_blocks, max_num_seqs=setup.max_num_seqs,
                        enable_prefix_caching=False, **setup.tuned)
    start = time.perf_counter()
    llm = LLM(setup.model, **options)
    return llm, time.perf_counter() - start


def stats_snapshot(llm: LLM) -> tuple[int, int, int, list[int]]:
    spec = llm.engine.speculator
    if spec is None:
        return 0, 0, 0, []
    st = spec.stats
    return st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos)


def run_once(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    before = stats_snapshot(llm)
    start = time.perf_counter()
    outs, decode_start, decode_tokens = generate_timed(llm, prompts, params)
    end = time.perf_counter()
    after = stats_snapshot(llm)
    num_tokens = sum(len(o.token_ids) for o in outs)
    per_pos = [a - (before[3][i] if i < len(before[3]) else 0) for i, a in enumerate(after[3])]
    return dict(seconds=end - start, num_tokens=num_tokens, token_ids=[o.token_ids for o in outs],
                decode_seconds=end - decode_start, decode_tokens=decode_tokens,
                num_drafts=after[0] - before[0], num_draft_tokens=after[1] - before[1],
                num_accepted_tokens=after[2] - before[2], accepted_per_pos=per_pos)


def generate_timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float, int]:
    """`LLM.generate`'s loop over the engine's steps, also noting when the decode phase starts:
    the end of the step that gave the last request its first token (every prompt prefilled).
    Returns the outputs in prompt order, that time, and the tokens emitted after it. The decode
    phase is what speculation can speed (the prefill is the same work either way) and what the
    ideal speedup models; the whole run's speedup is reported beside it."""
    engine = llm.engine
    seqs = [engine.make_sequence(f"spec-bench-{next(_run_ids)}", p, params) for p in prompts]
    for seq in seqs:
        engine.add_sequence(seq)
    done: dict[str, object] = {}
    started: set[str] = set()
    decode_start, decode_tokens = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if decode_start is not None:
                decode_tokens += len(out.new_token_ids)
            if out.new_token_ids or out.finished:
                started.add(out.req_id)
            if out.finished:
                done[out.req_id] = out
        if decode_start is None and len(started) == len(seqs):
            decode_start = time.perf_counter()
    if decode_start is None:  # every request finished in its first step
        decode_start = time.perf_counter()
    return [done[s.req_id] for s in seqs], decode_start, decode_tokens


_run_ids = itertools.count()


def cases_of(method: Method, batch_sizes: list[int], temperatures: list[float]) -> list[tuple[int, float]]:
    temps = [t for t in temperatures if method.temperatures is None or t in method.temperatures]
    batches = [1] if method.is_newcomer and 1 in batch_sizes else ([] if method.is_newcomer else batch_sizes)
    return [(b, t) for t in temps for b in batches]


def run_benchmark(model: str, draft: str, batch_sizes: list[int], temperatures: list[float], max_tokens: int,
                  runs: int, methods: tuple[Method, ...] = METHODS + NEWCOMER, tuned: dict | None = None,
                  threads: int = 1, progress: bool = True, rounds: int = 1) -> dict:
    """The whole measurement: every method × batch × temperature, `runs` interleaved repeats,
    each method's engine in a process of its own (`start_engine`); each repeat of a case runs its
    paired sequence (`_paired`) `rounds` times back to back and keeps each run's median round
    (`median_round`)."""
    max_b = max(batch_sizes)
    setup = Setup.of(model, draft, max_b, max_tokens, tuned if tuned is not None else {"graph_capture": "compile"},
                     threads)
    prompts = code_prompts(Tokenizer.from_dir(model), max_b)
    warm = dict(temperature=0, max_tokens=16, ignore_eos=True)
    cases = [(b, t) for t in temperatures for b in batch_sizes]
    raw: dict[tuple, list[dict]] = {}
    calls = []  # the runs a repeat's paired sequences ask for, the own-plain runs among them
    for b, t in cases:
        list(_paired([m for m in methods if (b, t) in cases_of(m, batch_sizes, temperatures)],
                     lambda m, own_plain=False: calls.append(m) or dict(seconds=1.0, token_ids=None)))
    total = runs * rounds * len(calls)
    engines: dict[str, ChildProcess] = {}
    first: dict[tuple, dict] = {}  # (batch, temperature, method) -> the engine's first run of the case
    run = lambda m, b, params, own_plain=False: engines[m.name].ask(  # noqa: E731
        dict(prompts=prompts[:b], params=params, own_plain=own_plain))
    try:
        for m in tqdm(methods, desc="spec_decode: engines", unit="engine", disable=not progress):
            engines[m.name] = start_engine(m, setup)  # one at a time: start-up seconds are each one's own
            # Every case runs once, whole, before the timed repeats. A process's first run at a
            # batch size ran its prefill slower (the control, plain decoding in another process,
            # measured 0.77-0.83x whole-run against 1.07x decode in its first batch-32 repeat);
            # after a 16-token warm-up at each batch size, the first batch-32 greedy repeat still
            # had every method low, the control at 0.93x whole-run (4e58e98's table); and an
            # adaptive engine's first steps in a batch size and kind are the gate's opening
            # bursts (`gate.py`), which a served engine runs once. The first runs are reported
            # apart (`first_runs`), not hidden.
            run(m, 2, warm)
            for b, t in cases_of(m, batch_sizes, temperatures):
                first[(b, t, m.name)] = run(m, b, dict(temperature=t, max_tokens=max_tokens, ignore_eos=True,
                                                       seed=999_000 + b))
        with tqdm(total=total, desc="spec_decode", unit="gen", disable=not progress) as bar:
            for rep in range(runs):
                for b, temp in cases:
                    params = dict(temperature=temp, max_tokens=max_tokens, ignore_eos=True, seed=1000 * rep + b)
                    measured = [m for m in methods if (b, temp) in cases_of(m, batch_sizes, temperatures)]
                    order = measured if rep % 2 == 0 else measured[::-1]  # alternate who runs first
                    each_round = []
                    for _ in range(rounds):
                        each_round.append(list(_paired(order, lambda m, own_plain=False: (
                            bar.update(1), run(m, b, params, own_plain))[1])))
                    for position in zip(*each_round):  # a run's place in the sequence, in every round
                        m = position[0][0]
                        raw.setdefault((b, temp, m.name), []).append(median_round([r for _, r in position], m))
    finally:
        for e in engines.values():
            e.close()
    return dict(rows=collect(raw, methods, cases), first_runs=first_runs(first, methods),
                startup_seconds={n: e.hello for n, e in engines.items()},
                threads=threads, default_threads=setup.default_threads, tuned_options=setup.tuned)


def median_round(rounds: list[dict], method: Method) -> dict:
    """Of one repeat's rounds, the records of one run (the same place in each round's sequence),
    the record whose ratio is the median: a method's speedup over the plain runs beside it, plain
    decoding's A/A pair (or, without one, its seconds). One real run's record, every figure of it
    from that run: a burst from another tenant that slows one round decides no repeat (the lower
    median for an even count)."""
    if method.is_plain:
        key = lambda r: (r["previous_baseline_seconds"] / r["seconds"]  # noqa: E731
                         if "previous_baseline_seconds" in r else -r["seconds"])
    else:
        key = lambda r: r["baseline_seconds"] / r["seconds"]  # noqa: E731
    return sorted(rounds, key=key)[(len(rounds) - 1) // 2]


def start_engine(method: Method, setup: Setup) -> ChildProcess:
    """The method's engine in a process of its own (this script with --serve): it answers a run's
    prompts and sampling parameters with `_timed_run`'s record. Its hello is its start-up seconds."""
    spec = json.dumps(dict(method=method.name, setup=dataclasses.asdict(setup)))
    return ChildProcess(f"{method.name!r} engine", __file__, ["--serve", spec])


def serve(spec: str) -> None:
    """`start_engine`'s child: build the method's engine, then answer runs until stdin closes."""
    out = replies()
    cfg = json.loads(spec)
    method = {m.name: m for m in METHODS + OPTIONAL + NEWCOMER}[cfg["method"]]
    setup = Setup(**cfg["setup"])
    torch.set_num_threads(setup.default_threads if method.is_newcomer else setup.threads)
    llm, startup = build(method, setup)
    timers = (ForwardTimer(llm.engine.runner),
              ForwardTimer(llm.engine.draft_runner) if llm.engine.draft_runner else None)
    if llm.engine.fused_step is not None:
        llm.engine.fused_step = FusedTimer(llm.engine.fused_step, timers[1])
    reply(out, startup)
    for req in requests():
        reply(out, _timed_run(llm, timers, req["prompts"], SamplingParams(**req["params"]), method, setup,
                              req.get("own_plain", False)))


def _paired(order: list[Method], run):
    """Runs `order`'s methods with each one's baseline (plain decoding; the newcomer plain engine
    for the newcomer draft) right before and right after it: B m1 B m2 B … The host drifts over
    seconds, so a speedup divides a method's run by its two neighbouring baseline runs (their
    mean), not by one baseline run several runs away. A speculative method's run also sits between
    two runs of its own engine with its speculator set aside (`_timed_run`'s own_plain): B O m O B.
    Processes of one configuration differ by more than the batch-32 goals' margin
    (`process_spread.py`), and that ratio is within one process, the same target weights and
    caches. Yields (method, run) for every run, the baselines' included (not the own plain runs).
    A method's run carries `baseline_seconds` and `baseline_token_ids`, and a speculative one's
    `own_plain_seconds` and `own_plain_token_ids`; a baseline run right after another of the same
    engine's (one method's runs between them) carries `previous_baseline_seconds`, the A/A control:
    how far the same engine moves between two runs."""
    base_of = lambda m: next(b for b in order if b.is_plain and b.is_newcomer == m.is_newcomer)  # noqa: E731
    previous: tuple[Method, dict] | None = None  # the latest baseline run, while it is the latest run
    last_of: dict[str, dict] = {}  # baseline name -> its latest run

    def baseline(b: Method) -> dict:
        r = run(b)
        if b.name in last_of:
            r["previous_baseline_seconds"] = last_of[b.name]["seconds"]
            if "decode_seconds" in r:
                r["previous_baseline_decode_spt"] = decode_spt(last_of[b.name])
        last_of[b.name] = r
        return r

    for m in (m for m in order if not m.is_plain):
        b = base_of(m)
        if previous is not None and previous[0] is b:
            before = previous[1]
        else:
            last_of.pop(b.name, None)  # not adjacent: no A/A pair across other engines' runs
            before = baseline(b)
            yield b, before
        own_before = run(m, own_plain=True) if m.speculates else None
        r = run(m)
        own_after = run(m, own_plain=True) if m.speculates else None
        after = baseline(b)
        r["baseline_seconds"] = (before["seconds"] + after["seconds"]) / 2
        if "decode_seconds" in r:  # per decode-phase token: the phases' token counts may differ by a step's
            r["baseline_decode_spt"] = (decode_spt(before) + decode_spt(after)) / 2
        r["baseline_token_ids"] = after["token_ids"]
        if m.speculates:
            r["own_plain_seconds"] = (own_before["seconds"] + own_after["seconds"]) / 2
            if "decode_seconds" in r:
                r["own_plain_decode_spt"] = (decode_spt(own_before) + decode_spt(own_after)) / 2
            r["own_plain_token_ids"] = own_after["token_ids"]
        yield m, r
        yield b, after
        previous = (b, after)


def cost_lines(llm: LLM, batch_size: int) -> dict | None:
    """An adaptive engine's cost lines as a run's plan reads them (`engine/spec_decode/costs.py`):
    the draft's pass (seconds a pass, a sequence, whether a guess) and the target's step at this
    batch size (its fixed seconds, a row's). Kept per repeat in the JSON: at 700f6dc draft
    adaptive decoded plainly through three repeats of batch 1 greedy, and the run kept no trace
    of why."""
    spec = llm.engine.speculator
    if spec is None or not spec.depth.adaptive:
        return None
    d, t = spec.depth.draft_cost, spec.depth.target_cost
    return dict(draft=None if d is None else dict(a=d.a, b=d.b, is_guess=d.is_guess),
                target=dict(fixed=t.intercept(batch_size), row=t.rows_slope))


def _timed_run(llm: LLM, timers: tuple, prompts, params, method: Method, setup: Setup, own_plain: bool = False) -> dict:
    """One run's record. own_plain: with the engine's speculator set aside for the run, so it
    decodes plainly (`LLMEngine.step` without one): the same target weights, caches and process
    as the method's runs; its gate sees none of it."""
    torch.set_num_threads(setup.default_threads if method.is_newcomer else setup.threads)
    for t in timers:
        if t is not None:
            t.calls.clear()
    speculator = llm.engine.speculator
    if own_plain:
        llm.engine.speculator = None
    lines = None if own_plain else cost_lines(llm, len(prompts))
    try:
        r = run_once(llm, prompts, params)
    finally:
        llm.engine.speculator = speculator
    if lines is not None:
        r["cost_lines"] = dict(before=lines, after=cost_lines(llm, len(prompts)))
    tt, dt = timers
    r["target_forward_s"] = tt.median_at(len(prompts))
    r["draft_forward_s"] = dt.median_at(len(prompts)) if dt else None
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "demo"))
    ap.add_argument("--draft", default=str(REPO / "models" / "demo-draft"))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of each repeat's paired runs, back to back; a repeat keeps each run's median round")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the tuned configurations")
    ap.add_argument("--graph-capture", default="compile", help="graph_capture of the tuned configurations")
    ap.add_argument("--extra-methods", nargs="+", default=[], choices=[m.name for m in OPTIONAL],
                    help="methods measured beside the usual ones (after draft k=2)")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 8, 32 tokens, 2 runs, no capture")
    ap.add_argument("--no-markdown", action="store_true",
                    help="do not update BENCHMARKS.md; results go to benchmarks/results/spec_decode_partial.*")
    ap.add_argument("--render", metavar="JSON",
                    help="write BENCHMARKS.md's section again from a full run's JSON (benchmarks/results/spec_decode.json)")
    ap.add_argument("--serve", metavar="JSON", help=argparse.SUPPRESS)  # an engine process (`start_engine`)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve)
    if args.render:  # the section again from a run's JSON (its figures as measured, the report's current shape)
        result = json.loads(Path(args.render).read_text())
        text = markdown(result, Path(args.render).stem)
        update_section(MARKDOWN, SECTION, text)
        print(f"## {SECTION}\n\n{text}")
        return
    if args.quick:
        args.batch_sizes, args.max_tokens, args.runs, args.graph_capture = [1, 8], 32, 2, "off"
    load_start = os.getloadavg()[0]
    at = [m.name for m in METHODS].index("draft k=2") + 1  # the extra methods run after it
    methods = METHODS[:at] + tuple(m for m in OPTIONAL if m.name in args.extra_methods) + METHODS[at:] + NEWCOMER
    result = run_benchmark(args.model, args.draft, args.batch_sizes, args.temperatures, args.max_tokens, args.runs,
                           methods, {"graph_capture": args.graph_capture}, threads=args.threads, rounds=args.rounds)
    result = dict(command=" ".join(["python", "benchmarks/spec_decode.py", *sys.argv[1:]]), args=vars(args),
                  runs=args.runs, rounds=args.rounds, machine=machine() | {"load_avg_1m_start": load_start,
                                                       "load_avg_1m_end": os.getloadavg()[0]}, **result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    # the file BENCHMARKS.md's table comes from is written only by a run that writes the table
    stem = "spec_decode_quick" if args.quick else "spec_decode_partial" if args.no_markdown else "spec_decode"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(result["rows"], RESULTS / f"{stem}.png")
    text = markdown(result, stem)
    if not (args.quick or args.no_markdown):
        update_section(MARKDOWN, SECTION, text)
    print(f"## {SECTION}\n\n{text}")


if __name__ == "__main__":
    main()
