"""`Speculator`: the engine's one handle on speculative decoding.

Per step: `allow` (the gate: whether this step speculates), `plan` (each decoding sequence's
depth k; the scheduler reserves KV slots for k lookahead tokens by `choose_k`), `propose` (draft
tokens and, for the rejection sampler, their q), then after the target's forward `verify` (the
whole batch at once, by the configured verifier) and `rollback` (cut both caches back to what
was accepted; the blocks past it are freed by the engine). `build_speculator` makes one from the
engine's config.
"""
from __future__ import annotations

import time

from dataclasses import dataclass, field

import torch

from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.costs import LinearCost, target_line
from pdserve.engine.spec_decode.depth import AdaptiveDepth
from pdserve.engine.spec_decode.draft import DraftProposer
from pdserve.engine.spec_decode.gate import SpeculationGate
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.proposer import Proposal, Proposer
from pdserve.engine.spec_decode.verifier import build_verifier


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative counters, named like the Prometheus metrics they feed."""

    num_drafts: int = 0  # verification steps with k >= 1
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the recovered/bonus token)."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0

    def record(self, k: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos.extend([0] * (k - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the gate needs to know of a step, taken before proposals grow its entries."""

    is_decode_only: bool  # every entry decodes one token: comparable with other such steps
    num_seqs: int = 1  # the entries: the sequences the target's cost counts (`costs.BatchCost`)

    @classmethod
    def of(cls, batch: list) -> StepShape:
        return cls(all(e.seq.num_computed_tokens + 1 == e.seq.num_tokens for e in batch), len(batch))


class Speculator:
    # Steps right after a prefill run slower, in either mode: on the demo target the first
    # decode steps after 8 prompts' prefill took 7.0, 6.4, 5.0, 4.1, 3.4 ms, then 3.1 ms from the
    # sixth on (every op about 2x slower at first, the step's Python included). Not the prefill
    # itself: 100 ms of anything else between two decode steps (a matmul loop, a Python spin, a
    # sleep) did the same in a scratch test, while sweeping 64 MB did not, so the steps' weights
    # and data are fetched again after a pause (on a shared host's cache). Measured there, a mode
    # looks dearer than it is, and at batch 8, temperature 1 that made the gate speculate where
    # plain decoding was cheaper (0.85x). So the gate neither measures nor moves its schedule
    # until this many pure-decode steps have run since the last step with prefill tokens.
    WARMUP_STEPS = 6
    LENGTHS_DECAY = 0.9  # per finished request, for the gate's prompt tokens per output token

    def __init__(self, proposer: Proposer, depth: AdaptiveDepth, verifier, catches_up: bool):
        """verifier: a `verifier.CoupledVerifier` or `verifier.RejectionVerifier`. catches_up:
        the proposer must first see the tokens plain steps emitted (a draft model)."""
        self.proposer, self.depth, self.verifier = proposer, depth, verifier
        self.catches_up = catches_up
        self.stats = SpecDecodeStats()
        self.gate = SpeculationGate(predict=depth.verdict)
        self._speculated = False  # whether this step proposed any draft token
        self._speculated_before = False  # whether the step before did
        self._ks: dict[str, int] = {}  # this step's depth per request, from `plan`
        self._regime = (0, False)  # the gate's: this step's batch size, and whether any request samples
        self._cohort: set[str] = set()  # the requests running when the gate was last renewed
        self._decode_run = 0  # pure-decode steps since the last step with prefill tokens
        self._propose_seconds = 0.0  # this step's, so far
        self._lengths = [0.0, 0.0]  # decayed sums of finished requests' prompt and output tokens
        # (regime, seconds, tokens) of the latest switch to speculation, until the gate has
        # speculation's seconds per token in that regime (a new regime's first burst) to price it
        self._switched: tuple | None = None

    def observe_step(self, shape: StepShape | None, seconds: float, outputs: list, target_pass: tuple[int, float]) -> None:
        """After each engine step (shape None: nothing was scheduled): a pure-decode step's
        target side (tokens, seconds) feeds the cost model (`costs.BatchCost`: not a step with
        prompt tokens, whose rows cost less, nor one of the slow steps right after it unless the
        model's slope is still a guess); its wall time and emitted tokens feed the gate, which
        compares like with like. The first speculative step after plain ones is left out: its
        draft catches up on every token the plain steps emitted, a cost of switching modes that
        the gate's own exploring causes, not of speculating: the gate gets it apart
        (`observe_switch`; in a new regime, after its first speculative step is measured) and
        spaces its exploring by it. Later catch-ups (a fresh prompt, a sequence whose depth was
        0) are part of speculating and count."""
        proposing, self._propose_seconds = self._propose_seconds, 0.0
        if shape is None or not self.depth.adaptive:  # a fixed depth reads neither costs nor the gate
            return
        # the target's side of the step: its wall time less the draft's proposal (the forward
        # alone left out the verification's sampling and the step's bookkeeping, which also grow
        # with the tokens verified)
        num_tokens, forward = target_pass
        self._decode_run = self._decode_run + 1 if shape.is_decode_only else 0
        if shape.is_decode_only and (self._decode_run > self.WARMUP_STEPS or self.depth.target_cost.is_guess):
            self.depth.target_cost.observe(num_tokens, max(seconds - proposing, forward), seqs=shape.num_seqs)
        switching = self.catches_up and self._speculated and not self._speculated_before
        if self.catches_up:
            seconds_caught_up, caught_up = self.proposer.take_catch_up()
            if caught_up and not (switching and self._decode_run > self.WARMUP_STEPS):  # a switch's is apart
                self.gate.observe_catch_up(self._regime[0], seconds_caught_up, caught_up, self._regime[1])
        if self._decode_run > self.WARMUP_STEPS:
            num_tokens = sum(len(o.new_token_ids) for o in outputs)
            if switching:  # what the switch cost, once speculation's steps are known here
                self._switched = (self._regime, seconds, num_tokens)
            else:
                self.gate.observe(self._regime[0], self._speculated, seconds, num_tokens, self._regime[1])
            if self._switched and self._switched[0] == self._regime and (
                    per_token := self.gate.seconds_per_token(self._regime[0], True, self._regime[1])) is not None:
                _, seconds, num_tokens = self._switched
                self.gate.observe_switch(self._regime[0], seconds - per_token * num_tokens, self._regime[1])
                self._switched = None
        self._speculated_before = self._speculated

    def allow(self, running: list[Sequence], filling: int = 0) -> bool:
        """Whether this step speculates at all: always at fixed depth; with adaptive depth, while
        the gate measures it paying for a batch like this one (its size, and whether any request
        samples). When most of the batch is new since the gate last heard so, it is told to
        measure again soon. Within WARMUP_STEPS of a prefill the gate keeps its current verdict,
        that of the batch the running sequences and `filling` (requests waiting for a place,
        or for their K/V) make together: a batch of 32 admitted over two steps is 22 running at
        the second, and at temperature 1 on the demo pair the 16–31 bucket (measured on the
        draining tails of earlier runs) said speculate where the 32–63 bucket said plain, so
        each run's second step ran the draft over 22 whole prompts for nothing (300–430 ms
        against 220–310 ms plain, 2–4% of a 128-token run)."""
        self._speculated = False
        if not self.depth.adaptive:
            return True
        settled = self._decode_run >= self.WARMUP_STEPS
        self._regime = (len(running) + (0 if settled else filling), any(not s.params.is_greedy for s in running))
        if sum(1 for s in running if s.req_id not in self._cohort) * 2 > len(running):
            self.gate.renew(*self._regime)
            self._cohort = {s.req_id for s in running}
        return self.gate.allow(*self._regime, settled=settled)

    def plan(self, seqs: list[Sequence], max_model_len: int, fused: bool = False) -> None:
        """The step's depths for the sequences about to decode (`choose_k` then answers the
        scheduler): fixed, or picked for the batch by the depth model (fused: the step can run
        as one native call, `AdaptiveDepth.plan`). A sequence whose draft K/V are still arriving
        (`Sequence.draft_kv_pending`) has no room: it decodes plainly until they land."""
        rooms = [-1 if s.draft_kv_pending else
                 min(s.params.max_tokens - s.num_output_tokens, max_model_len - s.num_tokens) - 1 for s in seqs]
        self._ks = dict(zip((s.req_id for s in seqs), self.depth.plan(seqs, rooms, fused)))

    def choose_k(self, seq: Sequence) -> int:
        return self._ks.get(seq.req_id, 0)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        start = time.perf_counter()
        proposals = self.proposer.propose(seqs, ks)
        self._propose_seconds += time.perf_counter() - start
        self._speculated = any(p.token_ids for p in proposals)
        return proposals

    def verify(self, seqs: list[Sequence], proposals: list[Proposal], rows: list[torch.Tensor]) -> list[list[int]]:
        """rows[b]: the target's logits [k_b + 1, vocab_size] at seqs[b]'s last token and each
        draft token. Each sequence's emitted tokens: accepted drafts, then one more."""
        tokens = self.verifier.verify(seqs, proposals, rows)
        self._record(seqs, [len(p.token_ids) for p in proposals], tokens)
        return tokens

    def record_fused(self, seqs: list[Sequence], ks: list[int], tokens: list[list[int]], draft_seconds: float) -> None:
        """A fused step's (`fused_step.FusedSpecStep`) drafts and verification, booked as
        `propose` and `verify` book theirs: ks[b] drafts of seqs[b], tokens[b] emitted, the
        draft's passes (to the deepest k) in draft_seconds. A sequence at depth 0 verified its
        input token alone: a plain step's token, not a draft (as on the engine's path)."""
        self._propose_seconds += draft_seconds
        self._speculated = True
        self.proposer.observe_passes(len(seqs), draft_seconds, max(ks))
        drafted = [i for i, k in enumerate(ks) if k]
        self._record([seqs[i] for i in drafted], [ks[i] for i in drafted], [tokens[i] for i in drafted])

    def _record(self, seqs: list[Sequence], ks: list[int], tokens: list[list[int]]) -> None:
        for seq, k, out in zip(seqs, ks, tokens):
            self.stats.record(k, len(out) - 1)
            if self.depth.adaptive:
                self.depth.record(seq.req_id, k, len(out) - 1, not seq.params.is_greedy)

    def rollback(self, seq: Sequence, num_tokens_before: int, num_accepted: int) -> None:
        """Only the K/V of the last token and the accepted drafts stay valid, in both caches."""
        seq.num_computed_tokens = num_tokens_before + num_accepted
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)

    def forget(self, seq: Sequence) -> None:
        """A request finished: its acceptance is dropped, and its lengths join the gate's figure
        of prompt tokens per output token (over which a draft's catch-up on a prompt spreads)."""
        self.depth.forget(seq.req_id)
        if self.catches_up and seq.num_output_tokens:
            self._lengths = [x * self.LENGTHS_DECAY + n for x, n in
                             zip(self._lengths, (seq.num_prompt_tokens, seq.num_output_tokens))]
            self.gate.prompt_per_output = self._lengths[0] / self._lengths[1]


def build_speculator(config, sampler, draft_runner, warm_up: bool, row_blocks=None) -> Speculator | None:
    """The engine's speculator for its `EngineConfig` (None: no speculation): the proposer (a
    draft model's passes on `draft_runner`, or n-grams), the depth model with its cost lines, and
    the verifier. warm_up: compile the draft's passes now, not in the first requests. row_blocks:
    the target runner's `ModelRunner.row_blocks`, called for the target's cost model where the
    depth is adaptive (it times the projections)."""
    method = config.spec_method
    if method is None:
        return None
    verifier = build_verifier(config.spec_verifier, sampler)
    draft_cost = None
    if method == "ngram":
        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        draft_cost = LinearCost(a=2e-3, b=5e-5, guess=True)  # free until a pass is measured
        proposer = DraftProposer(draft_runner, sampler, draft_cost if config.spec_adaptive else None,
                                 verifier.draft_stream, keep_probs=verifier.needs_draft_probs)
        if warm_up:
            draft_runner.warm_up_draft_passes()
    blocks = row_blocks() if row_blocks is not None and config.spec_adaptive else None
    depth = AdaptiveDepth(config.num_speculative_tokens, config.spec_adaptive, target_line(blocks), draft_cost)
    return Speculator(proposer, depth, verifier, catches_up=draft_cost is not None)
