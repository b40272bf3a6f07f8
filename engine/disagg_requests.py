"""`DisaggRequests`: a request's life cycle on a disaggregated worker, as `LLMEngine`'s methods
(this class is its mixin): on a prefill worker `add_prefill` (prefill only, the K/V to the hook,
held after the first token) and `release`; on a decode worker `reserve` (blocks for a prompt whose
K/V will arrive, or whose short uncached tail it prefills itself), `activate` (the K/V arrived)
and `draft_kv_landed`. `abort` ends either (`LLMEngine`). Each runs on the engine's thread; the
states they move through are `disagg.py`'s.
"""
from __future__ import annotations

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence, SequenceStatus


class DisaggRequests:
    def add_prefill(self, req_id: str, prompt_ids: list[int], params: SamplingParams, send_from: int = 0) -> Sequence:
        """Prefill worker, when a Prefill call arrives: queue a prompt for prefill only
        (ValueError on a bad request). Steps prefill it in chunks, handing each layer's K/V to
        `kv_hook` from token `send_from` on (the decode worker holds those before); the step that
        completes it samples the first token (in its outputs) and holds it until `release`."""
        seq = self.make_sequence(req_id, prompt_ids, params)
        if not 0 <= send_from < seq.num_prompt_tokens:
            raise ValueError(f"the decode worker holds {send_from} of {seq.num_prompt_tokens} prompt tokens, not fewer")
        seq.is_prefill_only, seq.kv_send_from = True, send_from
        self.add_sequence(seq)
        return seq

    def release(self, req_id: str) -> None:
        """Prefill worker, once a held sequence's K/V were delivered or failed to be: free its
        blocks. Idempotent."""
        req = self._requests.pop(req_id, None)
        if req is not None:
            self.scheduler.finish(req.seq)

    def reserve(self, req_id: str, prompt_ids: list[int], params: SamplingParams,
                local_tail: int = 0, chunk_tokens: int | None = None) -> Sequence | None:
        """Decode worker, when the router asks it to admit a request: validate it (ValueError),
        take blocks for its prompt and first token, whole or nothing, and hold it while its K/V
        arrive (written into `seq.block_table`'s slots, which no step reads). None when the pool
        or `max_num_seqs` has no room. End it with `activate` or `abort`. The prompt's leading
        blocks in the prefix cache (with the draft's K/V too, where there is a draft) are adopted:
        the transfer carries the K/V after their `seq.num_cached_tokens` only, into fresh blocks.
        When they leave at most `local_tail` tokens, no transfer comes: the sequence runs at once
        (RUNNING, not HELD) and this engine prefills the tail, as it would a colocated request;
        then blocks without the draft's K/V count too (an answer decoded while speculation was
        off), and the draft catches up over them before its first proposal; and the tail runs at
        most `chunk_tokens` a step while others decode (`Sequence.chunk_tokens`)."""
        seq = self.make_sequence(req_id, prompt_ids, params)
        prefix = self.block_manager.match_prefix(seq, with_draft=self.draft_runner is not None)
        if self.draft_runner is not None and local_tail:  # prefilled here, the draft catches up as a colocated one's
            whole = self.block_manager.match_prefix(seq)  # blocks whose draft K/V are missing too
            if whole and seq.num_prompt_tokens - len(whole) * self.block_manager.block_size <= local_tail:
                prefix = whole
        if not self.scheduler.reserve(seq, seq.num_prompt_tokens + 1, prefix):
            return None
        self._register(seq)
        if prefix and seq.num_prompt_tokens - seq.num_cached_tokens <= local_tail:
            seq.chunk_tokens = chunk_tokens
            self.scheduler.activate(seq)
        return seq

    def activate(self, req_id: str, first_token: int, first_logprobs: list[tuple[int, float]] | None = None,
                 draft_pending: list[int] | None = None) -> RequestOutput:
        """Decode worker, once a reserved sequence's K/V transfer is verified: its prompt counts
        as computed (in the draft's cache too, which the transfer also filled), it joins the
        running batch, and the first token is appended (which may already finish it), with the
        log-probs the prefill worker computed for it when the request asked for them.

        draft_pending: only the target's K/V are verified yet, and the draft's are still being
        written into these blocks (the prompt's, as reserved). The sequence decodes plainly
        meanwhile (no draft pass touches it) and the blocks stay pinned, whatever becomes of
        it, until `draft_kv_landed`."""
        seq = self._requests[req_id].seq
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(first_logprobs or [(first_token, float("nan"))])
        seq.num_computed_tokens = seq.num_prompt_tokens
        if draft_pending is not None:
            self.block_manager.pin(draft_pending)
            self._pinned[req_id] = list(draft_pending), seq.num_prompt_tokens
            seq.draft_kv_pending = self.draft_runner is not None
        elif self.draft_runner is not None:
            seq.num_draft_computed_tokens = seq.num_prompt_tokens
        self.scheduler.activate(seq)
        return self.append_tokens(seq, [first_token])

    def draft_kv_landed(self, req_id: str, ok: bool) -> None:
        """Decode worker: the transfer into a sequence activated with `draft_pending` ended. ok:
        the draft's K/V of the prompt are verified in its blocks, and the draft takes up the
        sequence from there (catching up on the tokens decoded meanwhile); else the sequence goes
        on without speculation. Its pinned blocks are let go either way; a no-op if none. Landed,
        they mark the prompt's full blocks `has_draft`, even if the request ended, for a next turn."""
        pinned = self._pinned.pop(req_id, None)
        if pinned is None:
            return
        blocks, num_prompt_tokens = pinned
        if ok:
            self.block_manager.mark_drafted(blocks[:num_prompt_tokens // self.block_manager.block_size])
        req = self._requests.get(req_id)
        seq = req.seq if req is not None else None
        if (seq is not None and seq.draft_kv_pending and ok and seq.status is SequenceStatus.RUNNING
                and seq.num_computed_tokens >= seq.num_prompt_tokens and seq.block_table[:len(blocks)] == blocks):
            seq.num_draft_computed_tokens = seq.num_prompt_tokens
            seq.draft_kv_pending = False
        elif seq is not None and seq.draft_kv_pending and seq.block_table[:len(blocks)] != blocks:
            seq.draft_kv_pending = False  # preempted and recomputed: the draft catches up like any other's
        self.block_manager.unpin(blocks)
