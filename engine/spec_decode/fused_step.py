"""A speculative decode step's native work as one call, `pdserve::spec_step`
(`kernels/cpu/draft_passes.cpp`): the draft's passes, then the target's verification of every
sequence's drafts, with the target's pick at each verified row (the argmax, or at temperature the
race plain sampling runs, `pdserve::race_rows`, against the noise the draft raced). The engine's
own path runs the same ops with Python between them: the draft's state built and its picks read
back (`DraftProposer`), the verification's inputs built (`step_inputs`), its final norm's output
scored by a third op, the logits split and picked (`verifier`). At batch 1 greedy on the demo
pair a speculative step took 1601 µs that way and 1301 µs fused, the op's own work 1060 µs of it
(scratch profile, one thread, Intel Xeon; BENCHMARKS.md, Speculation by revision). Here the
engine builds one state, reads back the drafts and the picks, and matches them (`verify_greedy`'s
rule, the coupled verifier's); its bookkeeping is the same as on its own path
(`LLMEngine._verify_fused`).

Under the rejection sampler a sampled step runs `pdserve::spec_step_rejection`: the draft's passes
race the draft stream's noise and keep their logits, and after the verification the rule
(`kernels/cpu/rejection.cpp`) takes q and p from them and draws its acceptance tests and last
tokens itself. At batch 1, temperature 1 on the demo pair, a 128-token request took 2.65 ms a
step on the engine's path (draft passes at once, `execute`, the rule in Python) and 1.78 ms fused,
the op 1.15 ms of it; a coupled request 1.61 ms a step, its op 1.05 ms (cProfile, one thread,
Intel Xeon; scratch).

Used for a step whose every sequence decodes greedily, or samples by temperature alone (no top-k,
top-p or min-p) where the sampler races natively, no penalties and no log-probs, at least one of them
with a draft (one without verifies its input token alone), each draft at most two tokens behind
(what `DraftProposer`'s passes at once take, as after every verification), on a draft whose passes
run natively (`DraftPasses.native`) and a target whose forward does (`NativeForward`, its lm_head
packed). Other steps take the engine's path. The tokens are the same either way: the same ops over
the same rows, the same noise (tested against that path).
"""
from __future__ import annotations

import torch

from pdserve.engine import rng
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model_runner import BatchEntry, ModelRunner, passes_state
from pdserve.engine.native_forward import NativePasses, native_weights
from pdserve.engine.penalties import has_penalties
from pdserve.engine.sampler import Sampler, race_noise
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.rejection_sampler import verify_greedy


class FusedSpecStep:
    """`pdserve::spec_step` over a target's and a draft's runners (`of`); `covers` says whether a
    step can take it, calling it runs the step's drafts and verification."""

    def __init__(self, runner: ModelRunner, draft_runner: ModelRunner, weights: list[torch.Tensor],
                 sampler: Sampler | None, rejection: bool = False):
        self.draft_runner = draft_runner
        self.sampler = sampler  # sampled rows' noise; None: greedy steps only
        self.rejection = rejection  # sampled steps verify by the rejection sampler's rule
        self.weights = weights  # the target's, with its lm_head
        target = runner.native_forward
        self.target = (target.caches, target.cos, target.sin, *target.shape)
        self.block_size = runner.block_size
        # positions the two rotary tables hold: the draft's passes write past a shallow
        # sequence's verification, and near the context end past what either model has
        self.max_position = min(target.cos.shape[0], _native_passes(draft_runner).cos.shape[0])

    @classmethod
    def of(cls, runner: ModelRunner, draft_runner: ModelRunner | None, sampler: Sampler,
           draft_stream: int) -> FusedSpecStep | None:
        """The fused step for this pair, or None where it cannot run: no draft, either model not
        run natively, the target's lm_head not packed (a tied one would need a packed copy), or
        the two caches in different block sizes. Sampled steps too where the sampler races
        natively: the coupled verifier's (the draft races plain sampling's noise, `draft_stream`)
        or the rejection sampler's (its own stream; `pdserve::spec_step_rejection`)."""
        from pdserve.engine.model.llama import PackedLinear

        if (draft_runner is None or runner.native_forward is None or _native_passes(draft_runner) is None
                or not isinstance(runner.model.lm_head, PackedLinear) or runner.block_size != draft_runner.block_size):
            return None
        weights = native_weights(runner.model, runner.kv_caches, "spec_step", with_head=True)
        samples = sampler.races_natively and draft_stream in (rng.SAMPLE_STREAM, rng.DRAFT_STREAM)
        return None if weights is None else cls(runner, draft_runner, weights, sampler if samples else None,
                                                rejection=draft_stream == rng.DRAFT_STREAM)

    def covers(self, batch: list[BatchEntry]) -> bool:
        """Whether every entry is a decode (at least one given lookahead slots for a draft; one
        without verifies its input token alone, as a sequence at its last token does), greedy
        or (where this step samples) sampling by temperature alone, with no penalties or
        log-probs, its draft one or two tokens behind, its block table reaching every slot the
        step writes (its verification's, and its draft's passes' to the batch's deepest k, as
        `ModelRunner.can_draft_passes` asks) and no slot past the rotary tables; and the draft's
        passes still native (a benchmark may swap them)."""
        last_slots = self._last_slots(batch)
        return last_slots is not None and all(last // self.block_size < len(seq.block_table)
                                              for seq, last in last_slots)

    def prepare(self, batch: list[BatchEntry], block_manager: BlockManager) -> bool:
        """`covers`, each entry's block table first grown to the last slot the step writes: the
        draft's passes run every sequence to the batch's deepest k, beyond the lookahead the
        scheduler gave a shallower one. False where the step cannot fuse or the pool is short.
        The step truncates every table to its tokens afterwards, on either path
        (`LLMEngine._verify_fused`, `_postprocess`)."""
        last_slots = self._last_slots(batch)
        return last_slots is not None and all(block_manager.allocate(seq, last + 1) for seq, last in last_slots)

    def _last_slots(self, batch: list[BatchEntry]) -> list[tuple[Sequence, int]] | None:
        """Each entry's sequence and the last position the step writes for it, or None where the
        step cannot fuse whatever the block tables hold."""
        if not self.takes([e.seq for e in batch]):
            return None
        deepest = max(e.num_new_tokens for e in batch) - 1
        if deepest < 1:
            return None
        last_slots = []
        for e in batch:
            seq, k = e.seq, e.num_new_tokens - 1
            last = seq.num_tokens - 1 + max(k, deepest - 1)  # the verification's, or the draft's deepest pass's
            if (seq.num_uncomputed_tokens != 1 or seq.num_tokens < 2 or last >= self.max_position
                    or not 1 <= seq.num_tokens - seq.num_draft_computed_tokens <= 2):
                return None
            last_slots.append((seq, last))
        return last_slots

    def takes(self, seqs: list[Sequence]) -> bool:
        """Whether steps of these sequences can fuse by what they ask (greedy, or sampling by
        temperature alone where this step samples; no penalties, no log-probs, no prefill-only
        request, none whose draft K/V are still arriving) and the draft's passes are native:
        what the depth model plans for (`AdaptiveDepth.plan`'s fused) before the step's state is
        known."""
        if _native_passes(self.draft_runner) is None:
            return False
        for seq in seqs:
            p = seq.params
            if (p.logprobs is not None or has_penalties(seq) or seq.is_prefill_only or seq.draft_kv_pending
                    or not (p.is_greedy or (self.sampler is not None and p.filters_by_temperature_only))):
                return False
        return True

    def __call__(self, batch: list[BatchEntry]) -> tuple[list[list[int]], list[list[int]], float, float]:
        """Per entry (k = num_new_tokens - 1 drafts): its k drafts and the tokens it emits (the
        drafts it keeps, then one); then the seconds of the draft's passes and of the
        verification. Under the coupled verifier (and in any greedy step) each keeps its drafts
        while they match the target's picks (`picks`, `verify_greedy`'s rule); a sampled step under
        the rejection sampler runs its rule natively (`_rejection_step`)."""
        seqs = [e.seq for e in batch]
        if self.rejection and not all(s.params.is_greedy for s in seqs):
            drafts, tokens, seconds = self._rejection_step(seqs, [e.num_new_tokens - 1 for e in batch])
            return drafts, tokens, *seconds.tolist()
        drafts, picks, draft_seconds, target_seconds = self.picks(batch)
        return drafts, [verify_greedy(p, d) for p, d in zip(picks, drafts)], draft_seconds, target_seconds

    def picks(self, batch: list[BatchEntry]) -> tuple[list[list[int]], list[list[int]], float, float]:
        """`pdserve::spec_step`: per entry its k drafts and the target's picks at its last token and
        each draft (k + 1), a sampled one with the noise plain sampling would draw for its position;
        then the seconds of the draft's passes and of the verification. The draft's passes run to
        the deepest k, as `DraftProposer`'s do."""
        seqs, ks = [e.seq for e in batch], [e.num_new_tokens - 1 for e in batch]
        deepest, draft = max(ks), _native_passes(self.draft_runner)
        temperature = noise = None
        if not all(s.params.is_greedy for s in seqs):  # every pass's and row's noise: positions n .. n + deepest
            temperature = torch.tensor([float(s.params.temperature) for s in seqs], dtype=torch.float32)
            noise = race_noise([s.params for s in seqs] * (deepest + 1), [s.seed for s in seqs] * (deepest + 1),
                               [s.num_tokens + j for j in range(deepest + 1) for s in seqs],
                               self.draft_runner.cfg.vocab_size, rng.SAMPLE_STREAM, temperature.device,
                               self.sampler.hash_fn).view(deepest + 1, len(seqs), -1)
        drafts, picks, seconds = torch.ops.pdserve.spec_step(
            self._state(seqs, ks), torch.tensor(ks), draft.weights, draft.caches, draft.cos, draft.sin,
            *draft.shape, self.weights, *self.target, temperature, noise)
        self._drafted(seqs, ks)
        drafts, picks = drafts.tolist(), picks.tolist()
        out_drafts, out_picks, row = [], [], 0
        for k, d in zip(ks, drafts):
            out_drafts.append(d[:k])
            out_picks.append(picks[row:row + k + 1])
            row += k + 1
        draft_seconds, target_seconds = seconds.tolist()
        return out_drafts, out_picks, draft_seconds, target_seconds

    def _state(self, seqs: list[Sequence], ks: list[int]) -> torch.Tensor:
        """draft_passes' catch-up state of the step's sequences, with the blocks of every slot its
        passes and verification write."""
        deepest = max(ks)
        width = max(s.num_tokens - 1 + max(k, deepest - 1) for s, k in zip(seqs, ks)) // self.block_size + 1
        previous, last = zip(*(s.last_token_ids(2) for s in seqs))
        return torch.from_numpy(passes_state(seqs, [list(previous), list(last), [s.num_tokens - 1 for s in seqs]],
                                             width))

    @staticmethod
    def _drafted(seqs: list[Sequence], ks: list[int]) -> None:
        """Each sequence's draft cache marked computed to the deepest k, where the step's passes ran
        it (as `DraftProposer`'s do)."""
        for seq in seqs:
            seq.num_draft_computed_tokens = seq.num_tokens + max(ks) - 1

    def _rejection_step(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[list[int]],
                                                                          torch.Tensor]:
        """`pdserve::spec_step_rejection`: the draft's passes race the draft stream's noise (pass j
        at position n + j), and the rule draws its acceptance tests and last tokens itself."""
        deepest, draft = max(ks), _native_passes(self.draft_runner)
        vocab = self.draft_runner.cfg.vocab_size
        temperature = torch.tensor([float(s.params.temperature) for s in seqs], dtype=torch.float32)
        noise = race_noise([s.params for s in seqs] * deepest, [s.seed for s in seqs] * deepest,
                           [s.num_tokens + j for j in range(deepest) for s in seqs], vocab, rng.DRAFT_STREAM,
                           temperature.device, self.sampler.hash_fn).view(deepest, len(seqs), -1)
        drafts, accepted, last, seconds = torch.ops.pdserve.spec_step_rejection(
            self._state(seqs, ks), torch.tensor(ks), draft.weights, draft.caches, draft.cos, draft.sin, *draft.shape,
            self.weights, *self.target, temperature, noise, rng.seed_words([s.seed for s in seqs]),
            rng.vocab_codes(vocab))
        self._drafted(seqs, ks)
        out_drafts = [d[:k] for d, k in zip(drafts.tolist(), ks)]
        return out_drafts, [d[:a] + [t] for d, a, t in zip(out_drafts, accepted.tolist(), last.tolist())], seconds


def _native_passes(draft_runner: ModelRunner) -> NativePasses | None:
    """The draft's passes as one native call (`DraftPasses.native`), when that is how they run."""
    return getattr(draft_runner.passes, "native", None)
