"""`Sequence`: one request's tokens, KV blocks and progress, as the scheduler sees it.

Token accounting:

    token_ids           = prompt_token_ids + output_token_ids
    num_computed_tokens = tokens whose K/V are in the cache (a prefix of token_ids)
    num_cached_tokens   = how many of those came from the prefix cache at admission
    num_draft_computed_tokens = likewise for the draft model's cache (speculative decoding)

A sequence is "prefilling" while num_computed_tokens < num_tokens - 1 and "decoding" after.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where the scheduler keeps a sequence."""

    WAITING = "waiting"  # queued for (re)admission
    RUNNING = "running"  # scheduled every step
    # blocks held outside both queues, for disaggregated serving: a prefilled prompt whose K/V
    # a prefill worker is sending, or a decode worker's reservation whose K/V are arriving
    HELD = "held"
    FINISHED = "finished"  # blocks freed


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled, or failed (transfer, timeout)


@dataclass(slots=True, eq=False)
class Sequence:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int = 0  # FCFS order
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_computed_tokens: int = 0  # tokens whose K/V are in the draft model's cache
    # decode worker: decoding began on the target's K/V while the draft's are still arriving
    # (`LLMEngine.activate`'s draft_pending): no draft pass may touch this sequence until they land
    draft_kv_pending: bool = False
    num_preemptions: int = 0
    # prefill worker: once the prompt is computed and the first token sampled, hand the
    # sequence off (HELD, blocks kept while its K/V are sent) instead of decoding it
    is_prefill_only: bool = False
    # decode worker: a tail it prefills itself takes at most this many prompt tokens in a step that
    # also decodes, shared with the step's other such tails, the oldest first (`LLMEngine.reserve`'s
    # chunk_tokens; None: no cap of its own)
    chunk_tokens: int | None = None
    # prefill worker: the decode worker holds the prompt's first kv_send_from tokens already (its
    # prefix cache): the K/V handed over start after them
    kv_send_from: int = 0
    # top-N log-probs per output token, when params.logprobs is set: (token_id, logprob) pairs
    output_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # what the speculative proposer keeps of this sequence between steps (the n-gram proposer's
    # index of its n-grams, `ngram.NgramIndex`): it lives and dies with the sequence
    proposer_state: object = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int | None = None) -> list[int]:
        """token_ids[start:stop], joining the prompt and the output only where the slice spans both."""
        prompt, out = self.prompt_token_ids, self.output_token_ids
        if start >= len(prompt):
            return out[start - len(prompt):None if stop is None else stop - len(prompt)]
        if stop is not None and stop <= len(prompt):
            return prompt[start:stop]
        return prompt[start:] + (out if stop is None else out[:stop - len(prompt)])

    def last_token_ids(self, n: int) -> list[int]:
        """The last n tokens, without joining the prompt and the output where the output holds them."""
        out = self.output_token_ids
        return out[-n:] if len(out) >= n else (self.prompt_token_ids + out)[-n:]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
