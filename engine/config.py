"""`EngineConfig`: every engine option in one validated, frozen record, and how `"auto"`
values resolve. Only composition roots (`LLMEngine`, the CLI, the workers' mains) read it whole."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.capture import GRAPH_CAPTURES
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.loader import DTYPES
from pdserve.engine.spec_decode.verifier import SPEC_VERIFIERS
from pdserve.kernels import BACKENDS
from pdserve.kernels.native import CPU_ATTENTIONS, CPU_LINEARS

SPECULATIVE_METHODS = ("draft", "ngram")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto: the config's dtype on CUDA, float32 on CPU
    device: str = "auto"
    kernel_backend: str = "auto"
    # the forward pass as one captured graph: "auto" (CUDA graphs on CUDA, off on the CPU), "off",
    # "compile" (torch.compile; tens of seconds per model at start-up), "cuda_graphs"
    graph_capture: str = "auto"
    # the CPU's attention for decode and verification steps: "auto" (the native op where it builds,
    # `kernels/native.py`: 10–20 s once per machine), "native" (an error where it cannot), "torch"
    cpu_attention: str = "auto"
    # the CPU's float32 projections: "auto" (weights packed for the native `linear_packed` where
    # the native ops build with AVX-512 or AVX2), "native" (an error where they cannot), "torch" (nn.Linear)
    cpu_linear: str = "auto"
    # the KV cache's dtype: "auto" (the model's), or a 16-bit one under a float32 model on the CPU
    # ("bfloat16", "float16"): half the bytes a step's attention reads and a transfer moves, twice
    # the blocks in kv_cache_memory_bytes; K and V rounded once, when written (not token-identical
    # to float32 caches). On CUDA the caches take the model's dtype.
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; else sized by kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 512 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    # the most prompt tokens a step that also decodes takes (`Scheduler`): it bounds the gap a
    # prompt's prefill puts between the running requests' tokens, at the prompt's TTFT (colocated
    # serving, a decode worker's prefill fallback); None or 0: no cap beyond the step's budget.
    # A decode worker caps the tails it prefills itself on its own (`local_prefill_chunk_tokens`)
    prefill_chunk_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0  # draws the seeds of requests that bring none
    draft_model: str | None = None
    num_speculative_tokens: int = 0
    speculative_method: str | None = None  # "draft" or "ngram"; inferred from draft_model
    ngram_max: int = 4
    ngram_min: int = 1
    spec_adaptive: bool = True  # depth per step, for the batch, from acceptance and step costs; False: always k
    # how a sampled request's draft tokens are verified: "coupled" (the target's own (seed,
    # position) draws, kept while the drafts match them: the same tokens with or without
    # speculation, at any depth) or "rejection" (min(1, p/q) acceptance; accepts more, but the
    # tokens depend on the draft). Both are exact in distribution; greedy requests are unaffected.
    spec_verifier: str = "coupled"

    def __post_init__(self) -> None:
        _check(self.dtype in ("auto", *DTYPES), "dtype", self.dtype, f"must be one of {('auto', *DTYPES)}")
        _check(self.kv_cache_dtype in ("auto", *DTYPES), "kv_cache_dtype", self.kv_cache_dtype,
               f"must be one of {('auto', *DTYPES)}")
        _check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device", self.device,
               "must be 'auto', 'cpu' or 'cuda'")
        _check(self.kernel_backend in BACKENDS, "kernel_backend", self.kernel_backend, f"must be one of {BACKENDS}")
        _check(self.graph_capture in GRAPH_CAPTURES, "graph_capture", self.graph_capture,
               f"must be one of {GRAPH_CAPTURES}")
        _check(self.cpu_attention in CPU_ATTENTIONS, "cpu_attention", self.cpu_attention,
               f"must be one of {CPU_ATTENTIONS}")
        _check(self.cpu_linear in CPU_LINEARS, "cpu_linear", self.cpu_linear, f"must be one of {CPU_LINEARS}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        _check(self.prefill_chunk_tokens is None or (isinstance(self.prefill_chunk_tokens, int)
               and not isinstance(self.prefill_chunk_tokens, bool) and self.prefill_chunk_tokens >= 0),
               "prefill_chunk_tokens", self.prefill_chunk_tokens, "must be an integer >= 0 or None")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", self.num_kv_blocks, "must be >= 1")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be >= 2")
        _check(self.num_speculative_tokens >= 0, "num_speculative_tokens", self.num_speculative_tokens, "must be >= 0")
        _check(self.speculative_method in (None, *SPECULATIVE_METHODS), "speculative_method",
               self.speculative_method, f"must be one of {SPECULATIVE_METHODS}")
        _check(not (self.speculative_method == "draft" and not self.draft_model), "draft_model", self.draft_model,
               "is required when speculative_method='draft'")
        _check(self.spec_verifier in SPEC_VERIFIERS, "spec_verifier", self.spec_verifier,
               f"must be one of {SPEC_VERIFIERS}")
        _check(1 <= self.ngram_min <= self.ngram_max, "ngram_min", (self.ngram_min, self.ngram_max),
               "must satisfy 1 <= ngram_min <= ngram_max")

    @property
    def spec_method(self) -> str | None:
        """The proposer in use, or None when speculation is off."""
        if self.num_speculative_tokens == 0:
            return None
        return self.speculative_method or ("draft" if self.draft_model else "ngram")


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name} {why}, got {value!r}")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half types are slow and inexact on CPU
    return DTYPES.get(cfg.config_dtype, torch.float16)


def kv_dtype_named(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype that `kv_cache_dtype` names over a model computing in `dtype`
    ("auto": the model's), unchecked: `resolve_kv_dtype` checks it for an engine."""
    return dtype if name == "auto" else DTYPES[name]


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device, ops_name: str) -> torch.dtype:
    """The KV cache's dtype: the model's for "auto"; another only where every path of the step
    reads and writes it (the CPU's torch ops and its native attention): a 16-bit cache under a
    float32 model. ValueError names what cannot be."""
    if kv_dtype_named(name, dtype) == dtype:
        return dtype
    if device.type != "cpu" or ops_name != "torch":
        raise ValueError(f"EngineConfig.kv_cache_dtype {name!r} differs from the model's dtype "
                         f"({str(dtype).removeprefix('torch.')}): only the CPU's torch kernels take that, "
                         f"not {device.type} with kernel_backend {ops_name!r}")
    if dtype != torch.float32 or DTYPES[name] == torch.float32:
        raise ValueError(f"EngineConfig.kv_cache_dtype {name!r} under a {str(dtype).removeprefix('torch.')} "
                         "model: a cache narrower than the model is 16-bit under float32, or the model's own dtype")
    return DTYPES[name]
