"""`Sampler`: turns logits rows into tokens under each request's own `SamplingParams`.

One path for every sampled token: filter (temperature, top-k, top-p, min-p) and draw by the
exponential race against the row's noise (`kernels/sampling.py`), fused in one kernel on CUDA; on
the CPU a row that filters by temperature alone races in one native call (`pdserve::race_rows`).
The noise comes from `rng`, keyed by each row's request seed and the position the sampled token
will occupy, so a token depends on nothing else the batch holds. Greedy rows take the argmax
without noise, and a batch of only greedy rows skips filtering altogether.
"""
from __future__ import annotations

import torch

from pdserve.engine import rng
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels import KernelOps, argmax_rows, native


class SamplingTensors:
    """Per-row (temperature, top_k, top_p, min_p) for the sampling ops, written into buffers
    allocated once (and grown when a batch outgrows them) rather than built per step."""

    def __init__(self, device: torch.device, capacity: int = 64):
        self.device, self._capacity = device, 0
        # CUDA: recorded after each build's copies, so the next build waits until they have read the host buffers
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self._capacity = capacity
        pin = self.device.type == "cuda"
        dtypes = (torch.float32, torch.int64, torch.float32, torch.float32)
        self._host = [torch.zeros(capacity, dtype=dt, pin_memory=pin) for dt in dtypes]
        self._np = [t.numpy() for t in self._host]

    def build(self, params: list[SamplingParams]) -> tuple[torch.Tensor, ...]:
        n = len(params)
        if self._copied is not None:  # two builds in one step (verification): the first's copies may still be queued
            self._copied.synchronize()  # at once if never recorded
        if n > self._capacity:
            self._grow(max(n, 2 * self._capacity))
        for buf, values in zip(self._np, zip(*((p.temperature, p.top_k, p.top_p, p.min_p) for p in params))):
            buf[:n] = values
        out = tuple(t[:n].to(self.device, non_blocking=True) for t in self._host)
        if self._copied is not None:
            self._copied.record()
        return out


def param_tensors(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-row (temperature, top_k, top_p, min_p) tensors for the sampling ops (fresh tensors:
    for tests and one-off callers; the engine's components hold a `SamplingTensors`)."""
    return SamplingTensors(device, max(len(params), 1)).build(params)


class Sampler:
    def __init__(self, ops: KernelOps, device: torch.device, compile_noise: bool = False):
        """The noise's hash runs natively on the CPU where the native ops are loaded (`cpu/noise.cpp`:
        one pass instead of a dozen over [rows, vocab], the same bits); else, with compile_noise,
        through a compiled `rng.hash_uniforms` (one fused loop too; seconds to compile)."""
        self.ops = ops
        self.tensors = SamplingTensors(device)
        self.hash_fn = rng.hash_uniforms
        # rows that filter by temperature alone race natively on the CPU (`pdserve::race_rows`): the
        # function a fused speculative step picks with (`spec_decode.fused_step`), so that its
        # verification draws what plain sampling draws, bit for bit
        self.races_natively = device.type == "cpu" and native.loaded() and ops.name == "torch"
        if device.type == "cpu" and native.loaded():
            self.hash_fn = rng.NativeHash()
        elif compile_noise:
            self.hash_fn = torch.compile(rng.hash_uniforms, dynamic=True)
            for rows in (1, 3):  # compile now, not in the first sampled requests' steps: one row, then any number
                rng.exponentials([0] * rows, list(range(rows)), 8, device=device, hash_fn=self.hash_fn)

    def sample(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        stream: int = rng.SAMPLE_STREAM,
    ) -> list[int]:
        return self.sample_tensor(logits, params, seeds, positions, stream).tolist()

    def sample_tensor(self, logits, params, seeds, positions, stream: int | list[int] = rng.SAMPLE_STREAM,
                      noise: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled ids as a tensor [num_rows] int64, on the logits' device. noise: the rows'
        exponentials when the caller has them (`race_noise`'s, for these seeds, positions and
        stream); else they are hashed here."""
        if not params:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        if all(p.is_greedy for p in params):  # one-hot rows: the race's winner is the argmax
            return argmax_rows(logits)
        if noise is None:
            noise = race_noise(params, seeds, positions, logits.shape[-1], stream, logits.device, self.hash_fn)
        return self._by_kind(params, lambda tensors: self.ops.sample(logits, *tensors, noise),
                             lambda i, temperature: torch.ops.pdserve.race_rows(logits[i].float(), temperature,
                                                                                noise[i]))

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distributions the rows are sampled from [num_rows, vocab_size] float32 (one-hot on
        the argmax for a greedy row): where rows race natively, those rows' as the native race
        makes them (`pdserve::temperature_probs`), so that the rejection sampler's q and p are the
        numbers its tokens were raced against; the others' the kernels' filter."""
        return self._by_kind(params, lambda tensors: self.ops.filter_probs(logits, *tensors),
                             lambda i, temperature: torch.ops.pdserve.temperature_probs(logits[i].float(), temperature))

    def native_rows(self, params: list[SamplingParams]) -> list[int]:
        """The rows that race natively (greedy or sampling by temperature alone, where the sampler
        races natively): their picks and distributions come from the native ops."""
        if not self.races_natively:
            return []
        return [i for i, p in enumerate(params) if p.is_greedy or p.filters_by_temperature_only]

    def _by_kind(self, params: list[SamplingParams], kernels, native) -> torch.Tensor:
        """Each row by its own kind, so a row's result never depends on what else the batch holds:
        `native(index, temperature)` for the rows that race natively, `kernels(tensors)` (the
        per-row parameter tensors) for the batch otherwise, those rows then overwritten."""
        tensors = self.tensors.build(params)
        rows = self.native_rows(params)
        if rows and len(rows) == len(params):
            return native(slice(None), tensors[0])
        out = kernels(tensors)
        if rows:
            index = torch.tensor(rows)
            out[index] = native(index, tensors[0][index])
        return out

    @staticmethod
    def top_logprobs(logits: torch.Tensor, token_ids: list[int], num: int) -> list[list[tuple[int, float]]]:
        """The sampled token's log-prob first, then the top `num`, from the raw model logits."""
        logp = logits.float().log_softmax(-1)
        top = logp.topk(num, dim=-1) if num else None
        out = []
        for i, tok in enumerate(token_ids):
            row = [(tok, float(logp[i, tok]))]
            if top is not None:
                row += list(zip(top.indices[i].tolist(), top.values[i].tolist()))
            out.append(row)
        return out


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """The rows of several sequences as one tensor: a lone one as it is, not copied. In a batch-1
    step the copy cost more than itself: the argmax of the copy's fresh rows took 20 µs where the
    same rows in place took 2 (a verification of 5 rows of 4096, scratch timing in the step)."""
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def race_noise(params: list[SamplingParams], seeds: list[int], positions: list[int], vocab_size: int,
               stream: int | list[int], device: torch.device,
               hash_fn=rng.hash_uniforms) -> torch.Tensor:  # [num_rows, vocab_size] float32
    """Each sampled row's exponentials; greedy rows (which ignore them) get ones, not computed."""
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    streams = [stream[i] for i in sampled] if isinstance(stream, list) else stream
    noise = rng.exponentials([seeds[i] for i in sampled], [positions[i] for i in sampled], vocab_size, streams, device,
                             hash_fn)
    if len(sampled) == len(params):
        return noise
    out = torch.ones(len(params), vocab_size, device=device)
    out[torch.tensor(sampled, device=device)] = noise
    return out
