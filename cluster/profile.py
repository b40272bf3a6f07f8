"""`pdserve profile`: measure this system's step costs on a model (and draft) and write the
cost profile that `pdserve plan` and the simulator run on.

What it measures, each on the engine the worker in question would run (same dtype, block size,
budget), timing whole engine steps so scheduling and sampling overheads are in:

- prefill steps (the prefill worker's engine step over prefill-only requests) over a grid of prompts per step and prompt
  lengths -> `prefill` (fit), and with a draft, whose cache it fills too -> `speculation.prefill`;
- plain decode steps over batch sizes and context lengths -> `decode` (fit);
- with a draft and k: speculative steps at fixed depth on standard-library code prompts ->
  `speculation.step` (fit) and the acceptance rate; draft-only decode steps against target-only
  ones at the same shapes -> the draft cost ratio;
- KV bytes per token from the model configs; loopback gRPC bandwidth and latency of a bytes
  stream between two processes (or `--transfer-bandwidth`).

It runs pinned where it is told (`--cpus`, applied with sched_setaffinity before torch starts
its threads) with `--num-threads` torch threads, so the profile matches runs pinned the same way.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

from pdserve.loadgen.costs import (CostProfile, SpeculationCost, TransferCost, WorkerLimits,
                                   acceptance_from_tokens_per_step, chunk_attention)
from pdserve.loadgen.fit import StepPoint, fit_step_cost


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    model: str
    draft_model: str | None = None
    num_speculative_tokens: int = 0
    dtype: str = "auto"
    device: str = "auto"
    num_threads: int = 1
    cpus: tuple[int, ...] | None = None
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    temperature: float = 0.0
    transfer_bandwidth: float | None = None  # bytes/s; None: measure
    transfer_overlap: float = 0.0
    request_overhead_s: float = 0.0
    is_quick: bool = False
    seed: int = 0
    kv_cache_dtype: str = "auto"  # the workers' (`EngineConfig.kv_cache_dtype`): a transfer's bytes per token

    def __post_init__(self) -> None:
        if self.num_speculative_tokens and not self.draft_model:
            raise ValueError("--num-speculative-tokens needs --draft-model")
        if self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads}")
        if self.cpus is not None and not set(self.cpus) <= os.sched_getaffinity(0):
            raise ValueError(f"--cpus {list(self.cpus)}: this process may only run on {sorted(os.sched_getaffinity(0))}")

    def engine_options(self, **overrides) -> dict:
        opts = dict(dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, device=self.device,
                    block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens, enable_prefix_caching=False, seed=self.seed)
        return {**opts, **overrides}


def pin(cpus: tuple[int, ...] | None, num_threads: int) -> None:
    """Before any torch work: the process's cores and torch's intra-op threads."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    import torch

    torch.set_num_threads(num_threads)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _random_prompt(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def measure_prefill(config: ProfileConfig, draft: str | None) -> list[StepPoint]:
    """Whole prefill steps of `n` prompts of `length` tokens, as the prefill worker runs them."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    lengths = (16, 96, 384, 768) if config.is_quick else (16, 64, 256, 512, 1024)
    counts, reps = (1, 3) if config.is_quick else (1, 2, 4), 3 if config.is_quick else 5
    engine = LLMEngine(EngineConfig(model=config.model, **config.engine_options(draft_model=draft)))
    limit = min(engine.max_model_len - 1, config.max_num_batched_tokens)
    rng, points, ids = random.Random(config.seed), [], iter(range(1 << 30))
    for length in (x for x in lengths if x <= limit):
        for n in (c for c in counts if c * length <= config.max_num_batched_tokens):
            times = []
            for _ in range(reps + 1):  # the first of each shape warms up
                seqs = [engine.add_prefill(f"p{next(ids)}", _random_prompt(rng, engine.model_config.vocab_size, length),
                                           SamplingParams(max_tokens=1)) for _ in range(n)]
                times.append(_timed(engine.step))  # the prefill worker's step: every prompt fits one step
                for seq in seqs:
                    engine.release(seq.req_id)
            points.append(StepPoint(n, n * length, n * chunk_attention(0, length), statistics.median(times[1:])))
    return points


@dataclass(slots=True)
class DecodeRun:
    points: list[StepPoint]
    num_tokens: int = 0  # emitted by the measured steps
    num_steps_seqs: int = 0  # sequence-steps measured


def measure_decode(config: ProfileConfig, model: str, prompts, draft: str | None = None, k: int = 0) -> DecodeRun:
    """Pure decode steps (speculative when `k`) over batch sizes and context lengths."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    batches = [b for b in ((1, 4, 16) if config.is_quick else (1, 2, 4, 8, 16, 32)) if b <= config.max_num_seqs]
    contexts = (64, 256) if config.is_quick else (32, 128, 384)
    num_steps, warm = (6, 2) if config.is_quick else (12, 2)
    room = max(contexts) + (num_steps + warm + 2) * (k + 1) + 8
    blocks = max(batches) * -(-room // config.block_size) + 8
    engine = LLMEngine(EngineConfig(model=model, **config.engine_options(
        draft_model=draft, num_speculative_tokens=k, spec_adaptive=False, num_kv_blocks=blocks,
        max_model_len=None)))
    run, ids = DecodeRun([]), iter(range(1 << 30))
    params = SamplingParams(temperature=config.temperature, max_tokens=(num_steps + warm + 2) * (k + 1) + 2,
                            ignore_eos=True, seed=config.seed)
    shapes = [(c, b) for c in contexts if c + params.max_tokens < engine.max_model_len for b in batches]
    for i, (length, b) in enumerate([shapes[0], *shapes]):  # the first shape twice: a warm-up
        seqs = [engine.add_request(f"d{next(ids)}", prompts(length), params) for _ in range(b)]
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
            engine.step()  # prefill (and the first token)
        for _ in range(warm):  # a draft catches up on the prompt in its first steps
            engine.step()
        times, contexts_seen, before = [], [], sum(s.num_output_tokens for s in seqs)
        for _ in range(num_steps):
            contexts_seen.append(sum(s.num_tokens for s in seqs))
            times.append(_timed(engine.step))
        if i > 0:  # one point per shape: the median step (this machine is shared and noisy)
            run.points.append(StepPoint(b, b, round(statistics.fmean(contexts_seen)), statistics.median(times)))
            run.num_tokens += sum(s.num_output_tokens for s in seqs) - before
            run.num_steps_seqs += b * num_steps
        for s in seqs:
            engine.abort(s.req_id)
    return run


def code_prompts(config: ProfileConfig):
    """prompts(length) -> token ids: standard-library code when the model has a tokenizer."""
    from pathlib import Path

    from pdserve.loadgen.workload import CodeCutter, WorkloadConfig, WorkloadKind

    rng = random.Random(config.seed)
    if not (Path(config.model) / "tokenizer.json").is_file():
        from pdserve.engine.model.config import load_model_config

        vocab = load_model_config(config.model).vocab_size
        return lambda n: _random_prompt(rng, vocab, n)
    cutter = CodeCutter(WorkloadConfig(WorkloadKind.CODE, tokenizer=config.model))
    return lambda n: list(cutter.cut(n, rng))


# ---- KV transfer: a bytes stream between two processes over loopback gRPC --------------------
_SINK_METHOD = "/pdserve.profile.Sink/Push"


def _sink_server(port_queue) -> None:  # in a child process
    from concurrent import futures

    import grpc

    def push(request_iterator, context):
        return str(sum(len(b) for b in request_iterator)).encode()

    handler = grpc.method_handlers_generic_handler("pdserve.profile.Sink", {
        "Push": grpc.stream_unary_rpc_method_handler(push)})
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler],
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    port_queue.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def measure_transfer(total_bytes: int, chunk_bytes: int = 1 << 20, reps: int = 3) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a client stream of `chunk_bytes` messages to another process."""
    import multiprocessing as mp

    import grpc

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_sink_server, args=(queue,), daemon=True)
    proc.start()
    try:
        port = queue.get(timeout=60)
        options = [("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            push = channel.stream_unary(_SINK_METHOD)
            payload = bytes(chunk_bytes)
            n = max(1, total_bytes // chunk_bytes)
            push(iter([b"x"]), timeout=30)  # warm the connection
            latency = statistics.median(_timed(lambda: push(iter([b"x"]), timeout=30)) for _ in range(20))
            seconds = statistics.median(_timed(lambda: push(iter([payload] * n), timeout=300)) for _ in range(reps))
        return n * chunk_bytes / max(seconds - latency, 1e-9), latency
    finally:
        proc.kill()
        proc.join(timeout=10)


def kv_bytes_per_token(config: ProfileConfig) -> int:
    from pdserve.engine.config import kv_dtype_named, resolve_device, resolve_dtype
    from pdserve.engine.model.config import load_model_config
    from pdserve.engine.model_runner import kv_bytes_per_block

    total = 0
    for path in (config.model, config.draft_model):
        if path:
            cfg = load_model_config(path)
            dtype = resolve_dtype(config.dtype, cfg, resolve_device(config.device))
            total += kv_bytes_per_block(cfg, 1, kv_dtype_named(config.kv_cache_dtype, dtype))
    return total


# ---- the profile ------------------------------------------------------------------------------
def build_profile(config: ProfileConfig, log=print) -> CostProfile:
    """Every measurement, then the fits, as a `CostProfile` whose notes say how each was found."""
    pin(config.cpus, config.num_threads)
    where = (f"cpus {list(config.cpus) if config.cpus else sorted(os.sched_getaffinity(0))}, "
             f"{config.num_threads} torch thread(s)")
    notes, measurements = {}, {}
    log("transfer ...")
    if config.transfer_bandwidth is None:
        bandwidth, latency = measure_transfer((16 if config.is_quick else 64) << 20)
        notes["transfer"] = (f"measured: a 1 MiB-message gRPC client stream between two processes on loopback, "
                             f"{bandwidth / 1e9:.2f} GB/s, {latency * 1e3:.2f} ms per empty stream")
    else:
        bandwidth, latency = config.transfer_bandwidth, 0.0
        notes["transfer"] = f"given: --transfer-bandwidth {bandwidth:g} B/s"
    notes["transfer.overlap"] = f"given: --transfer-overlap {config.transfer_overlap:g}"
    transfer = TransferCost(kv_bytes_per_token(config), bandwidth, latency, config.transfer_overlap)
    notes["transfer.kv_bytes_per_token"] = "computed from the model configs (target + draft), K and V, all layers"
    log("prefill steps ...")
    points = measure_prefill(config, None)
    prefill = fit_step_cost(points)
    measurements["prefill"] = [_point_json(p) for p in points]
    notes["prefill"] = f"measured: steps of the prefill worker's engine, {where}; {prefill.describe()}"
    log("decode steps ...")
    prompts = code_prompts(config)
    plain = measure_decode(config, config.model, prompts)
    decode = fit_step_cost(plain.points, ("fixed_s", "per_seq_s", "per_context_token_s"))
    measurements["decode"] = [_point_json(p) for p in plain.points]
    notes["decode"] = f"measured: plain engine steps, {where}; {decode.describe()}"
    speculation = None
    if config.num_speculative_tokens:
        speculation = _measure_speculation(config, prompts, plain, notes, measurements, where, log)
    limits = WorkerLimits(config.max_num_seqs, config.max_num_batched_tokens)
    notes["limits"] = "given: the worker flags --max-num-seqs and --max-num-batched-tokens profiled with"
    notes["request_overhead_s"] = f"given: --request-overhead {config.request_overhead_s:g}"
    hardware = (f"{os.uname().machine} {where}, device {config.device}, dtype {config.dtype}, "
                f"KV cache {config.kv_cache_dtype}")
    name = config.model + (f" + draft {config.draft_model} k={config.num_speculative_tokens}" if speculation else "")
    return CostProfile(name, hardware, prefill.cost, decode.cost, transfer, limits, speculation,
                       config.request_overhead_s, notes, measurements)


def _measure_speculation(config, prompts, plain: DecodeRun, notes, measurements, where, log) -> SpeculationCost:
    k = config.num_speculative_tokens
    log("prefill steps with the draft ...")
    points = measure_prefill(config, config.draft_model)
    prefill = fit_step_cost(points)
    measurements["prefill_with_draft"] = [_point_json(p) for p in points]
    notes["speculation.prefill"] = f"measured: prefill steps filling the draft's cache too, {where}; {prefill.describe()}"
    log("speculative steps ...")
    spec = measure_decode(config, config.model, prompts, config.draft_model, k)
    step = fit_step_cost(spec.points, ("fixed_s", "per_seq_s", "per_context_token_s"))
    log("draft steps ...")
    draft = measure_decode(config, config.draft_model, prompts)
    ratios = [d.seconds / t.seconds for d, t in zip(draft.points, plain.points)]
    tokens_per_step = spec.num_tokens / spec.num_steps_seqs
    alpha = acceptance_from_tokens_per_step(tokens_per_step, k)
    measurements["speculative"] = [_point_json(p) for p in spec.points]
    measurements["draft"] = [_point_json(p) for p in draft.points]
    notes["speculation.step"] = f"measured: speculative engine steps at fixed k={k}, {where}; {step.describe()}"
    notes["speculation.acceptance_rate"] = (f"measured: {tokens_per_step:.2f} tokens per sequence-step on standard "
                                            f"library code at temperature {config.temperature:g}, solved for i.i.d. α")
    notes["speculation.draft_cost_ratio"] = "measured: median of draft-only / target-only plain decode steps, same shapes"
    notes["speculation.verify_cost_ratio"] = "unused: the measured step includes verification"
    return SpeculationCost(k, alpha, statistics.median(ratios), 1.0, step.cost, prefill.cost)


def _point_json(p: StepPoint) -> dict:
    return {"num_seqs": p.num_seqs, "num_tokens": p.num_tokens, "attention": p.attention, "seconds": p.seconds}


def profile_main(args) -> int:
    cpus = tuple(_parse_cpus(args.cpus)) if args.cpus else None
    config = ProfileConfig(args.model, args.draft_model, args.num_speculative_tokens, args.dtype, args.device,
                           args.num_threads, cpus, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                           args.temperature, args.transfer_bandwidth, args.transfer_overlap, args.request_overhead,
                           args.quick, args.seed, args.kv_cache_dtype)
    profile = build_profile(config, log=lambda m: print(m, file=sys.stderr, flush=True))
    path = profile.save(args.output)
    print(f"prefill {profile.prefill}\ndecode {profile.decode}\nspeculation {profile.speculation}\n"
          f"transfer {profile.transfer}\nwrote {path}")
    return 0


def _parse_cpus(text: str) -> list[int]:
    """'0', '0,2', '0-3' (taskset's list form)."""
    cpus = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--cpus must be a list like 0 or 0,2 or 0-3, got {text!r}") from None
    return cpus
