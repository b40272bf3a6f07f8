"""`pdserve bench`, as a function: run a workload against a running system at one or more
request rates, summarize each, find the goodput, and write JSON (+ a PNG) of everything.

    config = BenchConfig(target="127.0.0.1:50051", rates=(1, 2, 4), num_requests=100,
                         slo=SLO(ttft_s=0.5, tpot_s=0.05))
    result = run_bench(config)
    result.write("bench.json")  # and bench.png

Each rate gets the same requests (the workload is drawn from the seed, not the rate) and the
same arrival draws scaled to the rate, so rates differ only in load. With `search`, rates are
bisected between `search.low` and `search.high` after the listed ones.

Same requests, but never the same prompts: a server's prefix cache would otherwise serve every
run after the first from the previous one's K/V. Each run's prompts get a head of their own (the
first 4 token ids, or the first 8 characters of a text prompt, redrawn from a key unique to the
run and to this invocation), which changes every block a prefix cache keys, and no length.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.loadgen.arrivals import ArrivalKind, ArrivalProcess
from pdserve.loadgen.backends import BenchSampling, GrpcBackend, HttpBackend
from pdserve.loadgen.goodput import Bisection, Goodput, from_sweep
from pdserve.loadgen.records import RequestRecord
from pdserve.loadgen.runner import run_requests
from pdserve.loadgen.stats import SLO, RunSummary, summarize
from pdserve.loadgen.workload import RequestSpec, WorkloadConfig, build_workload


@dataclass(frozen=True, slots=True)
class RateSearch:
    low: float
    high: float
    steps: int = 4


@dataclass(frozen=True, slots=True)
class BenchConfig:
    target: str | None = None  # gRPC host:port
    http_url: str | None = None  # or an OpenAI-compatible base URL
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    rates: tuple[float, ...] = (1.0,)
    arrival: ArrivalKind = ArrivalKind.POISSON
    burstiness: float = 1.0
    num_requests: int | None = 100
    duration_s: float | None = None
    max_concurrency: int | None = None
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    sampling: BenchSampling = field(default_factory=BenchSampling)
    request_timeout_s: float = 300.0
    search: RateSearch | None = None
    label: str = ""
    api_key: str | None = None
    num_warmup: int = 1  # requests sent one at a time before measuring, not recorded
    # gRPC: requests go round-robin over this many connections, each its own (the router processes
    # of `router.processes` share a port and the kernel spreads connections, not requests)
    connections: int = 1

    def __post_init__(self) -> None:
        if (self.target is None) == (self.http_url is None):
            raise ValueError("give exactly one of --target (gRPC) and --http (OpenAI HTTP)")
        if not self.rates and self.search is None:
            raise ValueError("give a request rate, a list of them, or a rate search")
        for rate in self.rates:
            ArrivalProcess(rate, self.arrival, self.burstiness)  # validates
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not isinstance(self.connections, int) or self.connections < 1:
            raise ValueError(f"connections must be an integer >= 1, got {self.connections!r}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup must be >= 0, got {self.num_warmup}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.search is not None and not self.slo.is_set:
            raise ValueError("a goodput search needs an SLO (--slo-ttft and/or --slo-tpot)")
        if self.search is not None:
            Bisection(self.search.low, self.search.high, self.search.steps)  # validates
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests or --duration (or both)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if self.num_requests is None and any(math.isinf(r) for r in self.rates):
            raise ValueError("an infinite --request-rate needs --num-requests")

    def process(self, rate: float) -> ArrivalProcess:
        return ArrivalProcess(rate, self.arrival, self.burstiness)

    def to_json(self) -> dict:
        w = self.workload
        return {"target": self.target, "http_url": self.http_url, "label": self.label,
                "workload": {"kind": w.kind.value, "prompt_len": w.prompt_len.spec, "output_len": w.output_len.spec,
                             "vocab_size": w.vocab_size, "dataset": w.dataset, "tokenizer": w.tokenizer,
                             "chars_per_token": w.chars_per_token},
                "rates": ["inf" if math.isinf(r) else r for r in self.rates], "arrival": self.arrival.value,
                "burstiness": self.burstiness, "num_requests": self.num_requests, "duration_s": self.duration_s,
                "max_concurrency": self.max_concurrency, "seed": self.seed,
                "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
                "sampling": {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                             "ignore_eos": self.sampling.ignore_eos},
                "request_timeout_s": self.request_timeout_s, "num_warmup": self.num_warmup,
                "connections": self.connections,
                "search": None if self.search is None else {"low": self.search.low, "high": self.search.high,
                                                            "steps": self.search.steps}}


@dataclass(slots=True)
class RateRun:
    summary: RunSummary
    records: list[RequestRecord]


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    runs: list[RateRun] = field(default_factory=list)  # in the order measured
    goodput: dict[str, Goodput] = field(default_factory=dict)  # by method name

    def summaries(self) -> list[RunSummary]:
        return sorted((r.summary for r in self.runs), key=lambda s: s.rate)

    def to_json(self) -> dict:
        return {"config": self.config.to_json(),
                "goodput": {k: g.to_json() for k, g in self.goodput.items()},
                "runs": [{"summary": r.summary.to_json(), "requests": [x.to_json() for x in r.records]}
                         for r in self.runs]}

    def write(self, path: str | Path, plot: bool = True) -> list[Path]:
        """The JSON at `path` and, with `plot`, a PNG beside it; the paths written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        written = [path]
        if plot:
            from pdserve.loadgen.plot import plot_sweeps

            label = self.config.label or (self.config.target or self.config.http_url)
            written.append(plot_sweeps({label: self.summaries()}, path.with_suffix(".png"), self.config.slo))
        return written


def run_bench(config: BenchConfig, progress: bool = True) -> BenchResult:
    """Run the whole benchmark (blocking). TargetError if the target cannot be reached."""
    return asyncio.run(run_bench_async(config, progress))


async def run_bench_async(config: BenchConfig, progress: bool = True) -> BenchResult:
    backend = make_backend(config)
    result = BenchResult(config)
    invocation = secrets.token_hex(8)
    try:
        await backend.check()
        await warm_up(backend, config)
        for rate in config.rates:
            result.runs.append(await measure_rate(backend, config, rate, progress, f"{invocation}/{len(result.runs)}"))
        if config.slo.is_set and config.rates:
            swept, interpolated = from_sweep([(s.rate, s.slo_attainment) for s in result.summaries()])
            result.goodput.update(swept=swept, interpolated=interpolated)
        if config.search is not None:
            search = Bisection(config.search.low, config.search.high, config.search.steps)
            while (rate := search.next_rate()) is not None:
                run = await measure_rate(backend, config, rate, progress, f"{invocation}/{len(result.runs)}")
                result.runs.append(run)
                search.record(rate, run.summary.slo_attainment)
            result.goodput["bisection"] = search.result()
    finally:
        await backend.close()
    return result


def make_backend(config: BenchConfig):
    if config.target is not None:
        return GrpcBackend(config.target, config.sampling, config.request_timeout_s, config.api_key,
                           connections=config.connections)
    return HttpBackend(config.http_url, config.sampling, config.request_timeout_s, config.api_key)


async def warm_up(backend, config: BenchConfig) -> None:
    """A few requests one at a time, so the first measured ones do not pay for cold caches."""
    if config.num_warmup:
        specs = build_workload(config.workload, config.num_warmup, config.seed + 1)
        await run_requests(backend, specs, [0.0] * len(specs), max_concurrency=1)


async def measure_rate(backend, config: BenchConfig, rate: float, progress: bool, run_key: str = "") -> RateRun:
    """One run at `rate`; `run_key`, unique to the run, gives its prompts their own heads."""
    times = config.process(rate).times(config.num_requests, config.seed, config.duration_s)
    specs = own_prompts(build_workload(config.workload, len(times), config.seed), run_key, config.workload.vocab_size)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc=f"{rate:g} req/s", unit="req", leave=False)
    try:
        records = await run_requests(backend, specs, times, config.max_concurrency, bar)
    finally:
        if bar is not None:
            bar.close()
    return RateRun(summarize(records, rate, config.slo), records)


HEAD_TOKENS, HEAD_CHARS = 4, 8


def own_prompts(specs: list[RequestSpec], run_key: str, vocab_size: int) -> list[RequestSpec]:
    """The workload with each prompt's head redrawn from (run_key, its index): token ids from
    3 up to `vocab_size` (clear of the usual special ids), text as lowercase letters. The lengths,
    and so what a simulator is given, do not change."""
    out = []
    for i, spec in enumerate(specs):
        rng = random.Random(f"{run_key}/{i}")
        if isinstance(spec.prompt, tuple):
            n = min(HEAD_TOKENS, len(spec.prompt))
            low = 3 if vocab_size > 3 else 0
            head = tuple(rng.randrange(low, vocab_size) for _ in range(n))
            prompt = head + spec.prompt[n:]
        else:
            n = min(HEAD_CHARS, len(spec.prompt))
            prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)) + spec.prompt[n:]
        out.append(RequestSpec(prompt, spec.max_tokens, spec.num_prompt_tokens))
    return out


def format_table(summaries: list[RunSummary]) -> str:
    """A Markdown table: one row per rate, latencies in milliseconds."""
    def ms(s, attr):
        return "-" if s is None else f"{getattr(s, attr) * 1e3:.1f}"

    head = ("| rate (req/s) | ok/sent | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | ITL p50 (ms) "
            "| e2e p50 / p99 (ms) | req/s | tok/s | SLO attained |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        att = "-" if s.slo_attainment is None else f"{s.slo_attainment:.0%}"
        failed = "".join(f" {code}: {n}" for code, n in s.failures.items())
        rows.append(f"| {s.rate:g} | {s.num_ok}/{s.num_requests} | {ms(s.ttft, 'p50')} / {ms(s.ttft, 'p90')} / "
                    f"{ms(s.ttft, 'p99')} | {ms(s.tpot, 'p50')} / {ms(s.tpot, 'p90')} / {ms(s.tpot, 'p99')} | "
                    f"{ms(s.itl, 'p50')} | {ms(s.e2e, 'p50')} / {ms(s.e2e, 'p99')} | {s.request_throughput:.2f} | "
                    f"{s.output_token_throughput:.1f} | {att}{failed} |")
    return "\n".join(rows)
