"""Engine hooks for prefill/decode disaggregation. Functions over an `LLMEngine`; no gRPC.

Prefill side (a prefill worker's loop):

    add_prefill ──► scheduler waiting ──► running (chunked prefill, `prefill_step`)
        ──last chunk: first token sampled──► detached (out of the scheduler, blocks kept)
        ──decode side acknowledged / aborted──► `release` (blocks freed)

Decode side (a decode worker's loop):

    `reserve` (blocks for prompt + 1 tokens, whole or nothing) ──► reserved
        ──K/V written by `write_kv`, transfer verified──► `activate` (running, prompt computed)
        ──transfer failed / aborted──► `release`

K/V travel as token ranges of one layer of one named group (`kv_cache_groups`): the target
model's cache, and the draft model's when speculation uses one. Every group is indexed by the
same block ids, so one block table (and one token range) addresses all of them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import BatchEntry
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence, SequenceStatus

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V): [num_blocks, block_size, num_kv_heads, head_dim]
KV_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True, slots=True)
class KVGroupLayout:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_cache_groups(engine: LLMEngine) -> list[tuple[str, KVCache]]:
    """Every KV cache the engine keeps, by name; all share the engine's block ids."""
    groups = [("target", engine.runner.kv_caches)]
    if engine.draft_runner is not None:
        groups.append(("draft", engine.draft_runner.kv_caches))
    return groups


def kv_group_layouts(engine: LLMEngine) -> list[KVGroupLayout]:
    return [KVGroupLayout(name, len(kv), kv[0][0].shape[2], kv[0][0].shape[3]) for name, kv in kv_cache_groups(engine)]


def model_identity(model: torch.nn.Module, config_hash: str) -> str:
    """A hash of the config and of every weight's name and shape (not the values: cheap)."""
    h = hashlib.sha256(config_hash.encode())
    for name, tensor in model.state_dict().items():
        h.update(f"{name}:{tuple(tensor.shape)};".encode())
    return h.hexdigest()[:16]


def engine_identity(engine: LLMEngine) -> str:
    return model_identity(engine.runner.model, engine.model_config.identity_hash())


@dataclass(frozen=True, slots=True)
class WorkerDescription:
    """What a worker runs. A prefill and a decode worker pair only if `pairing_fields` agree."""

    model_identity: str
    dtype: str
    block_size: int
    kv_layout: str
    kv_groups: tuple[KVGroupLayout, ...]
    spec_method: str
    num_speculative_tokens: int
    draft_identity: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    eos_token_ids: tuple[int, ...]


def describe(engine: LLMEngine) -> WorkerDescription:
    cfg = engine.config
    draft_identity = ""
    if cfg.draft_model:
        from pdserve.engine.model.config import load_model_config

        draft_identity = load_model_config(cfg.draft_model).identity_hash()
    return WorkerDescription(
        model_identity=engine_identity(engine), dtype=DTYPE_NAMES[engine.dtype], block_size=cfg.block_size,
        kv_layout=KV_LAYOUT, kv_groups=tuple(kv_group_layouts(engine)), spec_method=cfg.spec_method or "",
        num_speculative_tokens=cfg.num_speculative_tokens, draft_identity=draft_identity,
        max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
        num_blocks=engine.block_manager.num_blocks, eos_token_ids=tuple(sorted(engine.eos_token_ids)))


def slot_ids(seq: Sequence, block_size: int, token_start: int, num_tokens: int) -> torch.Tensor:
    """Flat cache slots of tokens [token_start, token_start + num_tokens) of a sequence."""
    pos = torch.arange(token_start, token_start + num_tokens)
    table = torch.tensor(seq.block_table, dtype=torch.int64)
    return table[pos // block_size] * block_size + pos % block_size


# ---- prefill side ---------------------------------------------------------------------------
@dataclass(slots=True)
class PrefillChunk:
    """Tokens [token_start, token_start + num_tokens) of `seq` whose K/V this step completes: the
    ones it ran, plus any prefix-cache hits ahead of them."""

    seq: Sequence
    token_start: int
    num_tokens: int
    slots: torch.Tensor  # [num_tokens] int64


@dataclass(slots=True)
class PrefillDone:
    seq: Sequence
    first_token: int


# Called with (layer index, this step's chunks) once that layer's K/V are in the cache.
LayerHook = Callable[[int, list[PrefillChunk]], None]


def add_prefill(engine: LLMEngine, req_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
    """Queue a prompt for prefill only. ValueError on a bad request."""
    seq = engine.make_sequence(req_id, prompt_ids, params)
    engine.scheduler.add(seq)
    return seq


@dataclass(slots=True)
class PrefillStepOutput:
    chunks: list[PrefillChunk]  # what ran, for groups that are not streamed layer by layer
    done: list[PrefillDone]


def prefill_step(engine: LLMEngine, on_layer: LayerHook | None = None) -> PrefillStepOutput:
    """One chunked-prefill step. `on_layer` sees the target's K/V layer by layer as they land.
    Sequences whose prompt completes sample their first token and leave the scheduler with their
    blocks (detached), until `release`."""
    sched = engine.scheduler.schedule()
    if sched.is_empty:
        return PrefillStepOutput([], [])
    bs = engine.block_manager.block_size
    batch, chunks = [], []
    for s in sched.scheduled:
        seq, start = s.seq, s.seq.num_computed_tokens
        batch.append(BatchEntry(seq, s.num_new_tokens, int(start + s.num_new_tokens == seq.num_tokens)))
        # a first chunk after prefix-cache hits also carries the cached tokens, which the decode side lacks
        send_from = 0 if start == seq.num_cached_tokens else start
        num_send = start + s.num_new_tokens - send_from
        chunks.append(PrefillChunk(seq, send_from, num_send, slot_ids(seq, bs, send_from, num_send)))
    callback = None if on_layer is None else (lambda i: on_layer(i, chunks))
    logits = engine.runner.execute(batch, layer_callback=callback)
    if engine.draft_runner is not None:  # the draft's K/V for the same tokens, shipped too
        engine.draft_runner.execute([BatchEntry(e.seq, e.num_new_tokens, 0) for e in batch])
    for e in batch:
        e.seq.num_computed_tokens += e.num_new_tokens
        engine.block_manager.commit(e.seq)
    sampled = [e.seq for e in batch if e.num_logits]
    tokens = engine.sampler.sample(logits, [s.params for s in sampled], [s.seed for s in sampled],
                                   [s.num_tokens for s in sampled])
    for seq in sampled:
        engine.scheduler.running.remove(seq)
        seq.status = SequenceStatus.FINISHED  # for the scheduler: gone; its blocks stay until release
    return PrefillStepOutput(chunks, [PrefillDone(seq, tok) for seq, tok in zip(sampled, tokens)])


def queued_prompt_tokens(engine: LLMEngine) -> int:
    sched = engine.scheduler
    return sum(s.num_uncomputed_tokens for s in (*sched.waiting, *sched.running))


# ---- decode side ----------------------------------------------------------------------------
def reserve(engine: LLMEngine, req_id: str, prompt_ids: list[int], params: SamplingParams,
            num_reserved: int = 0) -> Sequence | None:
    """Validate a request (ValueError) and take blocks for its prompt and first token, whole or
    nothing; None when the pool or the sequence limit has no room (`num_reserved`: sequences
    this caller holds reserved, which count against `max_num_seqs`)."""
    seq = engine.make_sequence(req_id, prompt_ids, params)
    sched = engine.scheduler
    if len(sched.running) + len(sched.waiting) + num_reserved >= sched.config.max_num_seqs:
        return None
    if not engine.block_manager.allocate(seq, seq.num_prompt_tokens + 1):
        return None
    return seq


# Moving K/V between the cache and a transfer is plain copying. On CPU it goes through numpy,
# single-threaded, not torch's index_select / index_copy_: those fan out to the intra-op thread
# pool, whose threads then wait for cores that the forward pass (or, on a 2-core host, the other
# worker) holds. Measured on 2 busy cores, one 4 MiB layer: 30 ms through torch, 0.2 ms through numpy.
def read_kv(cache: KVCache, layer: int, slots: torch.Tensor) -> np.ndarray:
    """K then V of `slots` of one layer, as one contiguous host array
    [2, num_tokens, num_kv_heads, head_dim] (the KVData layout) of the cache's raw bytes."""
    k_cache, v_cache = cache[layer]
    if k_cache.device.type != "cpu":
        return _raw(torch.stack([_flat(k_cache).index_select(0, slots), _flat(v_cache).index_select(0, slots)]).cpu())
    k_host, v_host, idx = _raw(_flat(k_cache)), _raw(_flat(v_cache)), slots.numpy()
    out = np.empty((2, len(idx), *k_host.shape[1:]), dtype=k_host.dtype)
    np.take(k_host, idx, axis=0, out=out[0])
    np.take(v_host, idx, axis=0, out=out[1])
    return out


def write_kv(cache: KVCache, layer: int, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:  # k, v: [num_tokens, num_kv_heads, head_dim]
    """Write received K/V into reserved slots. Safe beside a running step: the slots belong to
    a reserved sequence that no step reads."""
    k_cache, v_cache = cache[layer]
    if k_cache.device.type != "cpu":
        _flat(k_cache).index_copy_(0, slots, k.to(k_cache.device))
        _flat(v_cache).index_copy_(0, slots, v.to(v_cache.device))
        return
    idx = slots.numpy()
    _raw(_flat(k_cache))[idx] = _raw(k)
    _raw(_flat(v_cache))[idx] = _raw(v)


def _flat(cache: torch.Tensor) -> torch.Tensor:  # [num_blocks * block_size, num_kv_heads, head_dim]
    return cache.view(-1, *cache.shape[2:])


_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a numpy view of same-width integers (numpy has no bfloat16)."""
    return t.view(_RAW_DTYPES[t.element_size()]).numpy()


def activate(engine: LLMEngine, seq: Sequence, first_token: int) -> RequestOutput:
    """Join a reserved sequence, whose prompt K/V are now in its blocks, to the running batch
    and append its first token (which may already finish it)."""
    engine.add_sequence(seq)  # registers the request (detokenizer, stop strings) ...
    engine.scheduler.waiting.remove(seq)  # ... but it needs no prefill: straight to running
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = seq.num_prompt_tokens
    if engine.draft_runner is not None:  # the transfer carried the draft's K/V too
        seq.num_draft_computed_tokens = seq.num_prompt_tokens
    engine.scheduler.running.append(seq)
    return engine.append_tokens(seq, [first_token])


def release(engine: LLMEngine, seq: Sequence) -> None:
    """Free a sequence's blocks wherever it is: queued or prefilling (prefill side), detached,
    or reserved (decode side). Idempotent."""
    engine.scheduler.finish(seq)
