"""`LLMEngine`: requests in, token and text deltas out, one `step()` at a time.

A step reads like the three lines it is: `schedule` (which tokens of which sequences run),
`execute` (one forward pass over the flat batch), `postprocess` (sample, append, detokenize,
finish). Single-threaded: callers (the offline `LLM`, a worker's loop) own the thread.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

from engine.block_manager import BlockManager, cdiv
from engine.config import EngineConfig, resolve_device, resolve_dtype
from engine.detokenizer import IncrementalDetokenizer
from engine.model.config import load_model_config
from engine.model_runner import BatchEntry, ModelRunner, kv_bytes_per_block
from engine.outputs import RequestOutput
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import FinishReason, Sequence
from engine.tokenizer import Tokenizer
from kernels import select_ops


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    num_sent_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = cfg = load_model_config(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, cfg, self.device)
        self.ops = select_ops(config.kernel_backend, self.device)
        self.max_model_len = min(config.max_model_len or cfg.max_model_len, cfg.max_model_len)
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model)
        num_blocks = self._num_blocks()
        self.runner = ModelRunner(cfg, Path(config.model), self.ops, self.dtype, self.device,
                                  num_blocks, config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
                                   self.block_manager)
        self.sampler = Sampler(self.ops)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._requests: dict[str, _Request] = {}
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        useful = self.config.max_num_seqs * cdiv(self.max_model_len, self.config.block_size)
        return max(1, min(self.config.kv_cache_memory_bytes // per_block, useful))

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer.json: pass prompts as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        self._check_prompt(ids)
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len}, "
                             "which leaves no room to generate")

    def make_sequence(self, req_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Validate a request and build its sequence, without adding it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in use")
        ids = self.tokenize(prompt)
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.block_manager.blocks_for(total) > self.block_manager.num_blocks:
            raise ValueError(f"request needs {self.block_manager.blocks_for(total)} KV blocks but the cache has "
                             f"{self.block_manager.num_blocks}; lower max_tokens or grow the cache")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Sequence(req_id, ids, params, seed, arrival=next(self._arrivals))

    def add_sequence(self, seq: Sequence) -> None:
        detok = None
        if self.tokenizer is not None:
            decode = lambda ids, skip=seq.params.skip_special_tokens: self.tokenizer.decode(ids, skip)  # noqa: E731
            detok = IncrementalDetokenizer(decode, seq.prompt_token_ids, seq.params.stop)
        self._requests[seq.req_id] = _Request(seq, detok)
        self.scheduler.add(seq)

    def add_request(self, req_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        seq = self.make_sequence(req_id, prompt, params)
        self.add_sequence(seq)
        return seq

    def abort(self, req_id: str) -> RequestOutput | None:
        """End a request now and free its blocks. Idempotent; None if it is not known."""
        req = self._requests.get(req_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return self._output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        batch = self._batch(sched)
        logits = self.runner.execute(batch)
        return self._postprocess(batch, logits)

    @staticmethod
    def _batch(sched: SchedulerOutput) -> list[BatchEntry]:
        return [BatchEntry(s.seq, s.num_new_tokens, int(s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens))
                for s in sched.scheduled]

    def _postprocess(self, batch: list[BatchEntry], logits) -> list[RequestOutput]:
        for e in batch:
            e.seq.num_computed_tokens += e.num_new_tokens
        sampled = [e.seq for e in batch if e.num_logits]
        tokens = self.sampler.sample(logits, [s.params for s in sampled], [s.seed for s in sampled],
                                     [s.num_tokens for s in sampled])
        logprobs = self._logprobs(logits, sampled, tokens)
        outputs = []
        for i, (seq, tok) in enumerate(zip(sampled, tokens)):
            if logprobs is not None and seq.params.logprobs is not None:
                seq.output_logprobs.append(logprobs[i][:seq.params.logprobs + 1])
            outputs.append(self.append_tokens(seq, [tok]))
        for e in batch:
            if not e.num_logits:
                self.block_manager.commit(e.seq)
        return outputs

    def _logprobs(self, logits, sampled: list[Sequence], tokens: list[int]):
        num = max((s.params.logprobs for s in sampled if s.params.logprobs is not None), default=None)
        return None if num is None else self.sampler.top_logprobs(logits, tokens, num)

    def append_tokens(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Append accepted tokens to a running sequence, stopping at the first that finishes it."""
        req = self._requests[seq.req_id]
        reason = None
        for tok in tokens:
            seq.output_token_ids.append(tok)
            if req.detok is not None:
                req.detok.add(tok)
            reason = self._finish_reason(seq, tok, req)
            if reason is not None:
                break
        self.block_manager.commit(seq)
        if reason is not None:
            self._finish(req, reason)
        return self._output(req)

    def _finish_reason(self, seq: Sequence, tok: int, req: _Request) -> FinishReason | None:
        p = seq.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return FinishReason.STOP
        if req.detok is not None and req.detok.stopped:
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        if req.seq.finish_reason is None:
            req.seq.finish_reason = reason
        self.scheduler.finish(req.seq)

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        finished = seq.is_finished
        new_ids = seq.output_token_ids[req.num_sent_tokens:]
        req.num_sent_tokens = seq.num_output_tokens
        delta = req.detok.take_delta(final=finished) if req.detok else ""
        text = req.detok.text if req.detok else ""
        if finished:
            self._requests.pop(seq.req_id, None)
        return RequestOutput(
            req_id=seq.req_id, prompt_token_ids=seq.prompt_token_ids, token_ids=list(seq.output_token_ids),
            text=text, new_token_ids=new_ids, new_text=delta, finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            logprobs=seq.output_logprobs if seq.params.logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
        )
