"""A cost profile: what one engine step, one KV transfer and speculation cost on some model and
hardware; measured by `pdserve profile` or assumed from published figures (`notes` says which,
number by number). The simulator runs on it. Torch-free; plain JSON on disk.

One step's cost is linear in what the step does (`StepCost`):

    seconds = fixed_s + per_seq_s · sequences + per_token_s · new tokens + per_context_token_s · attention

where `attention` counts (new token, context token) pairs: a decode token at context length L
adds L; a chunk of n tokens after s computed ones adds n·s + n(n+1)/2 (`chunk_attention`).
Prefill and decode steps have a cost each (they are fitted on different shapes: prefill is
compute-bound, decode memory- or overhead-bound). A colocated step that mixes them pays the
decode step plus the prefill chunks' marginal cost (no second fixed cost).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


def chunk_attention(num_computed: int, num_new: int) -> int:
    """(query, key) pairs of `num_new` tokens after `num_computed` cached ones (causal)."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


def _check_nonnegative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value < 0:
            raise ValueError(f"{owner}.{name} must be a number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class StepCost:
    fixed_s: float
    per_seq_s: float = 0.0
    per_token_s: float = 0.0
    per_context_token_s: float = 0.0

    def __post_init__(self) -> None:
        _check_nonnegative("StepCost", fixed_s=self.fixed_s, per_seq_s=self.per_seq_s,
                           per_token_s=self.per_token_s, per_context_token_s=self.per_context_token_s)

    def marginal(self, num_seqs: int, num_tokens: int, attention: int) -> float:
        """What these sequences add to a step that runs anyway."""
        return self.per_seq_s * num_seqs + self.per_token_s * num_tokens + self.per_context_token_s * attention

    def seconds(self, num_seqs: int, num_tokens: int, attention: int) -> float:
        return self.fixed_s + self.marginal(num_seqs, num_tokens, attention)


@dataclass(frozen=True, slots=True)
class SpeculationCost:
    """Speculative decoding at fixed depth k. A step proposes k draft tokens per sequence (k draft
    forwards) and verifies k + 1 positions in one target forward; each draft token is accepted
    with probability `acceptance_rate` until the first rejection, and the step emits the accepted
    ones plus one (the bonus or the resampled token)."""

    num_speculative_tokens: int
    acceptance_rate: float
    draft_cost_ratio: float  # one draft forward / one target decode forward, same batch
    verify_cost_ratio: float = 1.0  # target forward of k + 1 tokens / of 1 token, same batch (derived steps)
    step: StepCost | None = None  # a whole speculative step, measured (per sequence, context as for decode)
    prefill: StepCost | None = None  # prefill steps that fill the draft's cache too (None: as without a draft)

    def __post_init__(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"SpeculationCost.num_speculative_tokens must be >= 1, got {self.num_speculative_tokens!r}")
        if not 0 <= self.acceptance_rate < 1:
            raise ValueError(f"SpeculationCost.acceptance_rate must be in [0, 1), got {self.acceptance_rate!r}")
        _check_nonnegative("SpeculationCost", draft_cost_ratio=self.draft_cost_ratio,
                           verify_cost_ratio=self.verify_cost_ratio)

    def step_seconds(self, decode: StepCost, num_seqs: int, attention: int) -> float:
        """One speculative step over `num_seqs` decoding sequences (`attention` as for plain decode)."""
        if self.step is not None:
            return self.step.seconds(num_seqs, num_seqs, attention)
        plain = decode.seconds(num_seqs, num_seqs, attention)
        return plain * (self.verify_cost_ratio + self.num_speculative_tokens * self.draft_cost_ratio)

    @property
    def mean_tokens_per_step(self) -> float:
        a, k = self.acceptance_rate, self.num_speculative_tokens
        return (1 - a ** (k + 1)) / (1 - a)


def acceptance_from_tokens_per_step(tokens: float, k: int) -> float:
    """α with (1 − α^(k+1)) / (1 − α) = tokens (a speculative step's mean tokens per sequence at
    depth k), by bisection (the mean is increasing in α); in [0, 1)."""
    lo, hi = 0.0, 0.999999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (1 - mid ** (k + 1)) / (1 - mid) < tokens else (lo, mid)
    return lo


@dataclass(frozen=True, slots=True)
class TransferCost:
    """Shipping a prompt's KV (target and draft) from a prefill to a decode worker."""

    kv_bytes_per_token: int
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    overlap: float = 0.0  # share hidden behind the prefill compute (layer-by-layer streaming)

    def __post_init__(self) -> None:
        _check_nonnegative("TransferCost", kv_bytes_per_token=self.kv_bytes_per_token, latency_s=self.latency_s)
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"TransferCost.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"TransferCost.overlap must be in [0, 1], got {self.overlap!r}")

    def seconds(self, num_tokens: int) -> float:
        """From the prompt's last prefill step ending to its KV being usable on the decode side."""
        return self.latency_s + (1 - self.overlap) * num_tokens * self.kv_bytes_per_token / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class ColocatedCost:
    """A colocated worker's own steps, where they were calibrated apart from the disaggregated
    ones (`pdserve calibrate --colocated-only`): its decode steps and the prompts it prefills
    between them, and a request's overhead on the way to it. A served prompt costs a colocated
    worker less than a prefill worker (no first token relayed apart, no K/V handed over), and
    priced as the 1P:1D pair's, the planner validation's colocated TTFT came out 29-33% over the
    measured (BENCHMARKS.md, planner validation). A speculating colocated shape runs its plain
    steps on these but keeps speculation's own (`SpeculationCost`: its steps, its prefills with
    the draft), as calibrated on a disaggregated deployment."""

    decode: StepCost
    prefill: StepCost
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        _check_nonnegative("ColocatedCost", request_overhead_s=self.request_overhead_s)


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_capacity_tokens: int = 1 << 40  # per worker (the simulator reserves prompt + output at admission)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"WorkerLimits.{name} must be an integer >= 1, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class CostProfile:
    model: str
    hardware: str
    prefill: StepCost
    decode: StepCost
    transfer: TransferCost
    limits: WorkerLimits = field(default_factory=WorkerLimits)
    speculation: SpeculationCost | None = None
    request_overhead_s: float = 0.0  # arrival at the router to the request reaching the workers
    notes: dict[str, str] = field(default_factory=dict)  # field -> where its number comes from
    measurements: dict = field(default_factory=dict)  # raw points the fits came from, if measured
    colocated: ColocatedCost | None = None  # a colocated worker's own steps, where calibrated apart

    def __post_init__(self) -> None:
        _check_nonnegative("CostProfile", request_overhead_s=self.request_overhead_s)

    def for_workers(self, colocated: bool) -> "CostProfile":
        """The profile a deployment of this kind runs on: colocated, with the colocated worker's
        own steps and request overhead where the profile has them; else as it is."""
        if not colocated or self.colocated is None:
            return self
        c = self.colocated
        return replace(self, decode=c.decode, prefill=c.prefill, request_overhead_s=c.request_overhead_s)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "CostProfile":
        try:
            spec = obj.get("speculation")
            if spec is not None:
                spec = SpeculationCost(**{**spec, **{k: StepCost(**spec[k]) if spec.get(k) else None
                                                     for k in ("step", "prefill")}})
            colocated = obj.get("colocated")
            if colocated is not None:
                colocated = ColocatedCost(StepCost(**colocated["decode"]), StepCost(**colocated["prefill"]),
                                          colocated.get("request_overhead_s", 0.0))
            return cls(model=obj["model"], hardware=obj["hardware"], prefill=StepCost(**obj["prefill"]),
                       decode=StepCost(**obj["decode"]), transfer=TransferCost(**obj["transfer"]),
                       limits=WorkerLimits(**obj.get("limits", {})), speculation=spec,
                       request_overhead_s=obj.get("request_overhead_s", 0.0), notes=dict(obj.get("notes", {})),
                       measurements=dict(obj.get("measurements", {})), colocated=colocated)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a cost profile: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        try:
            obj = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        try:
            return cls.from_json(obj)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path
