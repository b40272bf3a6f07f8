"""How the GPU benchmarks time a kernel: the median of CUDA-graph replays from a cold, clean L2.

    graph_ms(fn)          # per call, ms: fn replayed in a CUDA graph, each call after a read-only flush
    events_ms(fn)         # Triton's do_bench: CUDA events around each eager call, after a zeroing flush
    host_ms(fn)           # the host clock, for the same code run on the CPU

Why not only do_bench. Its flush zeroes a 256 MB buffer between calls, which leaves the L2
(50 MB on an H100 or H200) full of dirty lines; the timed kernel's reads evict them, so it pays
for writing up to 50 MB back to memory, a third more traffic than a 134 MB attention call
moves. And each call is launched eagerly, so a launcher whose Python takes longer than the
kernel is timed at the host's pace. The engine replays its decode step as a CUDA graph, so
`graph_ms` times what serving runs: `reps` calls captured in one graph, each preceded by a
reduction over a 256 MB buffer (reads only: the L2 is left cold and clean), less the same graph
of flushes alone. Both are reported side by side by `gpu_check.py`, so the difference is
measured, not argued.
"""
from __future__ import annotations

import functools
import statistics
import time


def events_ms(fn, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


@functools.cache
def _flush_buffer(device: str = "cuda", nbytes: int = 256 << 20):
    """What a read-only pass over evicts the L2 with (> the L2, written never): one per device."""
    import torch

    return torch.ones(nbytes // 4, dtype=torch.float32, device=device)


def host_ms(fn, runs: int = 3) -> float:
    """Median host-clock milliseconds of fn(): the CPU's stand-in (`gpu_check.py --smoke`)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _replay_ms(graph, trials: int) -> list[float]:
    import torch

    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def graph_ms(fn, reps: int = 20, trials: int = 7, flush: bool = True) -> float:
    """Median over `trials` replays of a graph of `reps` calls to fn, per call (ms). With `flush`,
    each call follows a read-only L2 flush, and a graph of the flushes alone is subtracted.
    fn must be capturable: no host syncs, no changes of shape between calls."""
    import torch

    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    flusher = _flush_buffer().sum if flush else None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a warm-up on the capture stream, as torch's docs ask
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def capture(body):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                body()
        return graph

    def flushed():
        flusher()
        fn()

    timed = capture(flushed if flush else fn)
    base = capture(flusher) if flush else None
    _replay_ms(timed, 2)  # warm
    per_call = []
    for _ in range(trials):  # interleaved, so drift hits both alike
        t = _replay_ms(timed, 1)[0]
        b = _replay_ms(base, 1)[0] if base is not None else 0.0
        per_call.append((t - b) / reps)
    del timed, base
    return statistics.median(per_call)
