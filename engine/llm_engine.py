"""`LLMEngine`: requests in, token and text deltas out, one `step()` at a time.

A step reads like the three lines it is: `schedule` (which tokens of which sequences run),
`execute` (one forward pass over the flat batch), `postprocess` (sample, append, detokenize,
finish). Single-threaded: callers (the offline `LLM`, a worker's loop) own the thread.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.block_manager import BlockManager, cdiv
from pdserve.engine.config import EngineConfig, resolve_device, resolve_dtype
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.model.config import load_model_config
from pdserve.engine.model_runner import BatchEntry, ModelRunner, kv_bytes_per_block
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.engine.spec_decode.depth import AdaptiveDepth, LinearCost
from pdserve.engine.spec_decode.draft import DraftProposer
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.speculator import Proposal, Speculator
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kernels import select_ops


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
        # a draft is loaded whenever one is named (a prefill worker fills its cache without speculating)
        has_draft = config.draft_model and config.speculative_method != "ngram"
        self.draft_config = load_model_config(config.draft_model) if has_draft else None
        self.max_model_len = min(config.max_model_len or cfg.max_model_len, cfg.max_model_len,
                                 self.draft_config.max_model_len if self.draft_config else cfg.max_model_len)
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model)
        num_blocks = self._num_blocks()
        self.runner = ModelRunner(cfg, Path(config.model), self.ops, self.dtype, self.device,
                                  num_blocks, config.block_size)
        self.draft_runner = self._build_draft_runner(num_blocks)
        self.speculator = self._build_speculator()
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
                                   self.block_manager)
        self.sampler = Sampler(self.ops)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._requests: dict[str, _Request] = {}
        self._speculate = False  # this step's gate decision
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.draft_config:
            per_block += kv_bytes_per_block(self.draft_config, self.config.block_size, self.dtype)
        useful = self.config.max_num_seqs * cdiv(self.max_model_len, self.config.block_size)
        return max(1, min(self.config.kv_cache_memory_bytes // per_block, useful))

    def _build_draft_runner(self, num_blocks: int) -> ModelRunner | None:
        if self.draft_config is None:
            return None
        self._check_draft_matches()
        return ModelRunner(self.draft_config, Path(self.config.draft_model), self.ops, self.dtype,
                           self.device, num_blocks, self.config.block_size)

    def _build_speculator(self) -> Speculator | None:
        config, method = self.config, self.config.spec_method
        if method is None:
            return None
        self.target_cost = LinearCost(a=5e-3, b=5e-4)
        draft_cost = None
        if method == "ngram":
            proposer = NgramProposer(config.ngram_min, config.ngram_max)
        else:
            draft_cost = LinearCost(a=2e-3, b=5e-5)
            proposer = DraftProposer(self.draft_runner, self.ops, draft_cost)
        depth = AdaptiveDepth(config.num_speculative_tokens, config.spec_adaptive, self.target_cost, draft_cost)
        return Speculator(proposer, depth, self.ops, self.model_config.vocab_size)

    def _check_draft_matches(self) -> None:
        draft, target = self.draft_config, self.model_config
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"draft model vocab_size {draft.vocab_size} differs from the target's {target.vocab_size}")
        paths = [Path(self.config.model) / "tokenizer.json", Path(self.config.draft_model) / "tokenizer.json"]
        if all(p.is_file() for p in paths) and paths[0].read_bytes() != paths[1].read_bytes():
            raise ValueError("draft model's tokenizer.json differs from the target's: they must share one tokenizer")

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
        step_start = time.perf_counter()
        batch_size = len(self.scheduler.running)
        self._speculate = self.speculator is not None and self.speculator.allow(batch_size)
        sched = self.scheduler.schedule(self._lookahead)
        if sched.is_empty:
            return []
        batch = self._batch(sched)
        # a draft catching up on many tokens (a fresh prompt, or after plain steps) makes one
        # step unrepresentative of steady speculation: the gate skips it
        steady = all(e.seq.num_tokens - e.seq.num_draft_computed_tokens <= 2 for e in batch if e.num_new_tokens > 1) \
            or self.draft_runner is None
        proposals = self._propose(batch)
        start = time.perf_counter()
        logits = self.runner.execute(batch)
        if self.speculator is not None:  # every pass, prefill chunks too: they spread n for the fit
            self.target_cost.observe(sum(e.num_new_tokens for e in batch), time.perf_counter() - start)
        is_decode_only = all(e.seq.num_computed_tokens + 1 == e.seq.num_tokens for e in batch)
        outputs = self._postprocess(batch, logits, proposals)
        if self.speculator is not None and is_decode_only and steady:  # the gate compares like with like
            emitted = sum(len(o.new_token_ids) for o in outputs)
            self.speculator.gate.observe(len(batch), bool(proposals), time.perf_counter() - step_start, emitted)
        return outputs

    def _lookahead(self, seq: Sequence) -> int:
        if not self._speculate:
            return 0
        return self.speculator.choose_k(seq, len(self.scheduler.running), self.max_model_len)

    @staticmethod
    def _batch(sched: SchedulerOutput) -> list[BatchEntry]:
        return [BatchEntry(s.seq, s.num_new_tokens, int(s.seq.num_computed_tokens + s.num_new_tokens >= s.seq.num_tokens))
                for s in sched.scheduled]

    def _propose(self, batch: list[BatchEntry]) -> dict[int, Proposal]:
        """Draft tokens for the decoding entries given lookahead slots; entries grow to verify them."""
        idx = [i for i, e in enumerate(batch) if e.num_new_tokens > 1 and e.seq.num_uncomputed_tokens == 1]
        if not idx:
            return {}
        props = self.speculator.propose([batch[i].seq for i in idx], [batch[i].num_new_tokens - 1 for i in idx])
        for i, prop in zip(idx, props):
            batch[i].extra_token_ids = prop.token_ids
            batch[i].num_new_tokens = batch[i].num_logits = 1 + len(prop.token_ids)
        return {i: prop for i, prop in zip(idx, props) if prop.token_ids}

    def _postprocess(self, batch: list[BatchEntry], logits, proposals: dict[int, Proposal]) -> list[RequestOutput]:
        rows = logits.split([e.num_logits for e in batch])
        for e in batch:
            e.seq.num_computed_tokens += e.num_new_tokens
        plain = [i for i, e in enumerate(batch) if e.num_logits and i not in proposals]
        outputs = self._sample_plain([batch[i].seq for i in plain], [rows[i] for i in plain])
        for i, prop in proposals.items():
            outputs.append(self._verify(batch[i].seq, prop, rows[i]))
        for e in batch:
            if not e.num_logits:
                self.block_manager.commit(e.seq)
            elif self.speculator is not None and not e.seq.is_finished:
                self.block_manager.truncate(e.seq, e.seq.num_tokens)  # unused lookahead slots
        return outputs

    def _sample_plain(self, seqs: list[Sequence], rows: list) -> list[RequestOutput]:
        if not seqs:
            return []
        logits = torch.cat(rows)
        tokens = self.sampler.sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                     [s.num_tokens for s in seqs])
        outputs = []
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            self._record_logprobs(seq, logits[i:i + 1], [tok])
            outputs.append(self.append_tokens(seq, [tok]))
        return outputs

    def _verify(self, seq: Sequence, prop: Proposal, logits) -> RequestOutput:
        before = seq.num_tokens
        tokens = self.speculator.verify(seq, prop, logits)
        self.speculator.rollback(seq, before, len(tokens) - 1)
        self._record_logprobs(seq, logits[:len(tokens)], tokens)
        return self.append_tokens(seq, tokens)

    def _record_logprobs(self, seq: Sequence, logits, tokens: list[int]) -> None:
        if seq.params.logprobs is not None:
            seq.output_logprobs.extend(self.sampler.top_logprobs(logits, tokens, seq.params.logprobs))

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
        if self.speculator is not None:
            self.speculator.forget(req.seq.req_id)

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
            logprobs=seq.output_logprobs[:seq.num_output_tokens] if seq.params.logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
        )
