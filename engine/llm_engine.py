"""`LLMEngine`: requests in, token and text deltas out, one `step()` at a time.

A step reads like the three lines it is: `schedule` (which tokens of which sequences run),
`execute` (one forward pass over the flat batch), `postprocess` (sample, append, detokenize,
finish). A speculative step whose sequences decode greedily or sample by temperature alone may
instead run its drafts and verification as one native call (`_verify_fused`,
`spec_decode.fused_step`) and then append and finish the same way. Single-threaded: callers (the
offline `LLM`, a worker's loop) own the thread.
"""
from __future__ import annotations

import gc
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.capture import resolve_capture
from pdserve.engine.disagg import KVHook, run_handing_off
from pdserve.engine.disagg_requests import DisaggRequests
from pdserve.engine.config import EngineConfig, resolve_device, resolve_dtype, resolve_kv_dtype
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.model.config import check_draft_matches, load_model_config
from pdserve.engine.model_runner import BatchEntry, KVAllocator, ModelRunner, num_kv_blocks
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.penalties import penalize
from pdserve.engine.sampler import Sampler, stack_rows
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.engine.spec_decode.fused_step import FusedSpecStep
from pdserve.engine.spec_decode.speculator import Proposal, StepShape, build_speculator
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kernels import native, select_ops


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    num_sent_tokens: int = 0
    num_steps: int = 0  # outputs that carried tokens (`RequestOutput.num_steps`)


class LLMEngine(DisaggRequests):
    def __init__(self, config: EngineConfig, kv_allocator: KVAllocator | None = None):
        """kv_allocator: where the KV caches (target, then draft) live, when not in ordinary memory."""
        self.config = config
        self._kv_allocator = kv_allocator
        self.model_config = cfg = load_model_config(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, cfg, self.device)
        self.ops = select_ops(config.kernel_backend, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device, self.ops.name)
        self.capture = resolve_capture(config.graph_capture, self.device, self.ops.name)
        self.native_attention = native.resolve(config.cpu_attention, self.device, self.ops.name)
        self.native_linear = native.resolve_linear(config.cpu_linear, self.device, self.dtype)
        # a draft is loaded whenever one is named (a prefill worker fills its cache without speculating)
        has_draft = config.draft_model and config.speculative_method != "ngram"
        self.draft_config = load_model_config(config.draft_model) if has_draft else None
        self.max_model_len = min(config.max_model_len or cfg.max_model_len, cfg.max_model_len,
                                 self.draft_config.max_model_len if self.draft_config else cfg.max_model_len)
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model)
        # whether outputs carry text: a serving worker sets it False, as the router detokenizes for
        # its clients; the engine then detokenizes only requests with stop strings, to stop at them
        self.text_outputs = True
        num_blocks = self._num_blocks()
        self.runner = ModelRunner(cfg, Path(config.model), self.ops, self.dtype, self.device,
                                  num_blocks, config.block_size, self.capture, config.max_num_seqs, kv_allocator,
                                  self.native_attention, self.native_linear, config.max_num_batched_tokens,
                                  kv_dtype=self.kv_dtype)
        self.draft_runner = self._build_draft_runner(num_blocks)
        self.sampler = Sampler(self.ops, self.device, compile_noise=self.capture == "compile")
        self.speculator = build_speculator(config, self.sampler, self.draft_runner,
                                           warm_up=self.capture == "compile", row_blocks=self.runner.row_blocks)
        # a speculative step's drafts and verification in one native call (None: never)
        self.fused_step = FusedSpecStep.of(self.runner, self.draft_runner, self.sampler,
                                           self.speculator.verifier.draft_stream) if self.speculator else None
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.prefill_chunk_tokens), self.block_manager)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._requests: dict[str, _Request] = {}
        self._speculate = False  # this step's gate decision
        self._shape: StepShape | None = None  # this step's, for the gate
        # prefill worker: called on this thread, for a pass running prefill-only sequences, once
        # layer `layer` of KV group `group` (0 target, 1 draft) is in the cache: as each layer lands
        # (kv_hook_streams), or for all once the pass is done (a hook that sends after the step)
        self.kv_hook: KVHook | None = None
        self.kv_hook_streams = True
        # prefill worker: a step's draft pass over its prompts waits for `hand_over_draft` (or the
        # next step), so the first tokens it samples go out without waiting for it
        self.defer_draft_handoff = False
        self._draft_handoff: Callable[[], None] | None = None
        self._held_in_step: list[str] = []  # prefill-only requests this step held (`_hand_off`)
        self._pinned: dict[str, tuple[list[int], int]] = {}  # decode worker: blocks the draft's K/V come to
        self.forward_started_at: float | None = None  # perf_counter: the last step's target pass began
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        if self.capture == "compile":
            # Compiling leaves thousands of dead objects in reference cycles: collected now, not
            # in a first request's step (400-430 ms on the demo pair), where inside the speculation
            # gate's first burst it kept batch-1 greedy plain for hundreds of steps (BENCHMARKS.md,
            # Speculation by revision).
            gc.collect()

    def _num_blocks(self) -> int:
        c = self.config
        models = [self.model_config] + ([self.draft_config] if self.draft_config else [])
        return c.num_kv_blocks or num_kv_blocks(c.kv_cache_memory_bytes, c.max_num_seqs, self.max_model_len,
                                                c.block_size, models, self.kv_dtype)

    def _build_draft_runner(self, num_blocks: int) -> ModelRunner | None:
        if self.draft_config is None:
            return None
        check_draft_matches(self.model_config, self.draft_config, Path(self.config.model),
                            Path(self.config.draft_model))
        return ModelRunner(self.draft_config, Path(self.config.draft_model), self.ops, self.dtype,
                           self.device, num_blocks, self.config.block_size, self.capture, self.config.max_num_seqs,
                           self._kv_allocator, self.native_attention, self.native_linear,
                           self.config.max_num_batched_tokens, kv_dtype=self.kv_dtype)

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
        self._register(seq)
        self.scheduler.add(seq)

    def _register(self, seq: Sequence) -> None:
        detok = None
        if self.tokenizer is not None and not seq.is_prefill_only and (self.text_outputs or seq.params.stop):
            decode = lambda ids, skip=seq.params.skip_special_tokens: self.tokenizer.decode(ids, skip)  # noqa: E731
            detok = IncrementalDetokenizer(decode, seq.prompt_token_ids, seq.params.stop)
        self._requests[seq.req_id] = _Request(seq, detok)

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

    def abort_unfinished(self) -> list[str]:
        """Abort every queued or running request (after a failed step); their ids. Held ones,
        which no step touches, stay, except those the failed step itself held: their first tokens
        were in the outputs it never returned, so nothing else would end them (a prefill worker's
        push would wait for its transfer timeout). The failed step's draft pass
        (`hand_over_draft`) is dropped: run later, its layers would reach the hook among others'."""
        self._draft_handoff = None
        ids = [s.req_id for s in (*self.scheduler.running, *self.scheduler.waiting)] + self._held_in_step
        self._held_in_step = []
        for req_id in ids:
            self.abort(req_id)
        return ids

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration over every running sequence. With speculation, the step is also timed
        for the speculation gate, outside the step itself."""
        self._held_in_step = []
        self.hand_over_draft()
        start = time.perf_counter()
        outputs = self._step()
        self._held_in_step = []  # their first tokens are in the outputs
        if self.speculator is not None:
            self.speculator.observe_step(self._shape, time.perf_counter() - start, outputs, self.runner.last_pass)
        return outputs

    def _step(self) -> list[RequestOutput]:
        self._shape = None
        sched = self._schedule()
        if sched.is_empty:
            return []
        batch = self._prepare(sched)
        if self._speculate and self.fused_step is not None and self.fused_step.prepare(batch, self.block_manager):
            return self._verify_fused(batch)
        proposals = self._propose(batch)
        logits = self._run(batch)
        return self._postprocess(batch, logits, proposals)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler  # filling: the sequences waiting or held that the batch still has room for
        self._speculate = self.speculator is not None and self.speculator.allow(
            sched.running, min(sched.num_seqs, sched.config.max_num_seqs) - len(sched.running))
        if self._speculate:
            decoding = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
            self.speculator.plan(decoding, self.max_model_len,
                                 fused=self.fused_step is not None and self.fused_step.takes(decoding))
        return self.scheduler.schedule(self._lookahead)

    def _prepare(self, sched: SchedulerOutput) -> list[BatchEntry]:
        batch = [BatchEntry(s.seq, s.num_new_tokens, int(s.seq.num_computed_tokens + s.num_new_tokens >= s.seq.num_tokens))
                 for s in sched.scheduled]
        self._shape = StepShape.of(batch)  # before proposals grow the entries
        return batch

    def _run(self, batch: list[BatchEntry]):
        """The target's forward pass over the flat batch (prefill-only sequences' K/V to
        `kv_hook`: `disagg.run_handing_off`)."""
        self.forward_started_at = time.perf_counter()
        logits, draft_pass = run_handing_off(self.runner, self.draft_runner, batch, self.kv_hook,
                                             self.kv_hook_streams, self.block_manager.block_size)
        if draft_pass is not None and self.defer_draft_handoff:
            self._draft_handoff = draft_pass
        elif draft_pass is not None:
            draft_pass()
        return logits

    @property
    def draft_handoff_pending(self) -> bool:
        """Whether the last step's draft pass over prompt tokens waits for `hand_over_draft`."""
        return self._draft_handoff is not None

    def hand_over_draft(self) -> None:
        """Prefill worker (engine thread): the last step's draft pass over its prompt tokens, whose
        layers go to `kv_hook` (`disagg.run_handing_off`), if it is still to run. With
        `defer_draft_handoff` the worker calls this once the step's first tokens are on their
        way; the next step calls it first in any case, so no prompt's draft K/V are skipped."""
        draft_pass, self._draft_handoff = self._draft_handoff, None
        if draft_pass is not None:
            draft_pass()

    def _lookahead(self, seq: Sequence) -> int:
        if not self._speculate:
            return 0
        return self.speculator.choose_k(seq)

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
        # what picks tokens sees the penalized logits; reported log-probs are the model's own
        sizes = [e.num_logits for e in batch]
        raw, rows = logits.split(sizes), penalize(logits, batch).split(sizes)
        for e in batch:
            e.seq.num_computed_tokens += e.num_new_tokens
        plain = [i for i, e in enumerate(batch) if e.num_logits and i not in proposals]
        outputs = self._sample_plain([batch[i].seq for i in plain], [rows[i] for i in plain], [raw[i] for i in plain])
        if proposals:
            verified = list(proposals)
            outputs += self._verify([batch[i].seq for i in verified], [proposals[i] for i in verified],
                                    [rows[i] for i in verified], [raw[i] for i in verified])
        for e in batch:
            if not e.num_logits:
                self.block_manager.commit(e.seq)
            elif self._speculate and not e.seq.is_finished:  # only a step that may speculate reserves any
                self.block_manager.truncate(e.seq, e.seq.num_tokens)  # unused lookahead slots
        return outputs

    def _sample_plain(self, seqs: list[Sequence], rows: list, raw_rows: list) -> list[RequestOutput]:
        if not seqs:
            return []
        logits = stack_rows(rows)
        tokens = self.sampler.sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                     [s.num_tokens for s in seqs])
        outputs = []
        for seq, raw, tok in zip(seqs, raw_rows, tokens):
            self._record_logprobs(seq, raw, [tok])
            if seq.is_prefill_only:
                outputs.append(self._hand_off(seq, tok))
                continue
            outputs.append(self.append_tokens(seq, [tok]))
        return outputs

    def _hand_off(self, seq: Sequence, first_token: int) -> RequestOutput:
        """A prefill-only sequence's prompt is computed: report its first token and hold it."""
        seq.output_token_ids.append(first_token)
        self.block_manager.commit(seq)
        self.scheduler.hold(seq)
        self._held_in_step.append(seq.req_id)
        return self._output(self._requests[seq.req_id])

    def _verify(self, seqs: list[Sequence], props: list[Proposal], rows: list, raw_rows: list) -> list[RequestOutput]:
        """Every speculating sequence's drafts at once; then each keeps what it accepted. `rows`
        pick the tokens (penalized); `raw_rows` are the model's own, for reported log-probs."""
        outputs = []
        for seq, tokens, raw in zip(seqs, self.speculator.verify(seqs, props, rows), raw_rows):
            self.speculator.rollback(seq, seq.num_tokens, len(tokens) - 1)
            self._record_logprobs(seq, raw[:len(tokens)], tokens)
            outputs.append(self.append_tokens(seq, tokens))
        return outputs

    def _verify_fused(self, batch: list[BatchEntry]) -> list[RequestOutput]:
        """The step's drafts and verification as one native call (`fused_step.FusedSpecStep`:
        every entry a decode with lookahead slots, greedy or sampling by temperature alone), then
        what `_postprocess` and `_verify` do for such a batch with the tokens each sequence emits
        (the drafts its verifier kept, then one)."""
        self.forward_started_at = time.perf_counter()
        drafts, tokens, draft_seconds, target_seconds = self.fused_step(batch)
        self.runner.last_pass = (sum(e.num_new_tokens for e in batch), target_seconds)
        seqs = [e.seq for e in batch]
        self.speculator.record_fused(seqs, [len(d) for d in drafts], tokens, draft_seconds)
        outputs = []
        for seq, toks in zip(seqs, tokens):
            self.speculator.rollback(seq, seq.num_tokens, len(toks) - 1)
            outputs.append(self.append_tokens(seq, toks))
            if not seq.is_finished:
                self.block_manager.truncate(seq, seq.num_tokens)  # unused lookahead slots
        return outputs

    def _record_logprobs(self, seq: Sequence, logits, tokens: list[int]) -> None:
        if seq.params.logprobs is not None:
            seq.output_logprobs.extend(self.sampler.top_logprobs(logits, tokens, seq.params.logprobs))

    def append_tokens(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Append accepted tokens to a running sequence, stopping at the first that finishes it."""
        req = self._requests[seq.req_id]
        reason, detok = None, req.detok
        if detok is not None and detok.has_stop:  # a stop string may end the request at any token
            for tok in tokens:
                seq.output_token_ids.append(tok)
                detok.add(tok)
                if (reason := self._finish_reason(seq, tok, req)) is not None:
                    break
        else:  # the tokens end it by themselves: the text is decoded once for all of them
            p = seq.params
            for n, tok in enumerate(tokens, 1):
                seq.output_token_ids.append(tok)
                if (reason := self.finish_reason_of(p, tok, seq.num_output_tokens, seq.num_tokens)) is not None:
                    break
            if detok is not None:
                detok.add_many(tokens[:n] if reason is not None else tokens)
        self.block_manager.commit(seq)
        if reason is not None:
            self._finish(req, reason)
        return self._output(req)

    def _finish_reason(self, seq: Sequence, tok: int, req: _Request) -> FinishReason | None:
        if req.detok is not None and req.detok.stopped:
            return FinishReason.STOP
        return self.finish_reason_of(seq.params, tok, seq.num_output_tokens, seq.num_tokens)

    def finish_reason_of(self, p: SamplingParams, tok: int, num_output_tokens: int,
                         num_tokens: int) -> FinishReason | None:
        """Whether `tok`, the `num_output_tokens`-th output token (`num_tokens` in all), ends a
        request (stop strings aside). Reads only what never changes: callable from any thread."""
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return FinishReason.STOP
        if num_output_tokens >= p.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: _Request, reason: FinishReason) -> None:
        if req.seq.finish_reason is None:
            req.seq.finish_reason = reason
        self.scheduler.finish(req.seq)
        if self.speculator is not None:
            self.speculator.forget(req.seq)

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        finished = seq.is_finished
        new_ids = seq.output_token_ids[req.num_sent_tokens:]
        req.num_sent_tokens = seq.num_output_tokens
        req.num_steps += bool(new_ids)
        delta = req.detok.take_delta(final=finished) if req.detok else ""
        text = req.detok.text if req.detok else ""
        if finished:
            self._requests.pop(seq.req_id, None)
        return RequestOutput(
            req_id=seq.req_id, prompt_token_ids=seq.prompt_token_ids, token_ids=list(seq.output_token_ids),
            text=text, new_token_ids=new_ids, new_text=delta, finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            logprobs=seq.output_logprobs[:seq.num_output_tokens] if seq.params.logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens, num_steps=req.num_steps,
        )
