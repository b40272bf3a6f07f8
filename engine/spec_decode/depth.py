"""Adaptive speculation depth: the step's k follows the batch's recent acceptance, through a
cost model of target and draft step times that knows the batch size.

For a sequence with per-token acceptance rate α, k draft tokens yield on average
E(k) = (1 − α^(k+1)) / (1 − α) tokens per step. A step over B decoding sequences at depths k_i
costs

    cost = T_target(Σ (k_i + 1), B) + Σ_{j=1..max k_i} T_draft(#{i: k_i ≥ j})

with T_target(n, B) the measured time of a step's target side over n tokens of B sequences (the
step's wall time less the draft's proposal: the forward, the verification's sampling and the
step's bookkeeping; `costs.BatchCost`, which also counts the row blocks of AMX tiles) and T_draft(n)
that of a draft pass: the target verifies every draft token in one pass, the draft runs one pass
per depth over the sequences still drafting. Fit on the
target's forward alone, T_target left out the sampling and bookkeeping that also grow with the tokens verified, so deep
verification looked cheaper than it was: at batch 8, temperature 1 on the demo pair (Sapphire
Rapids Xeon) adaptive depth ran 0.95x plain at the median where fixed k = 2 ran 1.17x, and 1.10x
fit on the whole target side (a scratch A/B, three interleaved runs). The
passes' fixed cost is shared by the batch, so depths are chosen for the batch, not sequence by
sequence (each sequence choosing alone, as if the whole batch were at its depth, mixed depths in
one batch and cost more than either fixed depth: at batch 32, temperature 1 on the demo pair,
0.91x plain where fixed k = 2 gave 1.08x). `plan` tries each depth k for the whole batch,
trims each sequence to the positions worth their own marginal cost (position j of sequence i
stays while α_i^j, its chance of adding a token, times the step's seconds per token covers the
slopes of both cost lines), and keeps the k whose trimmed depths maximise ΣE / cost. k = 0
(plain decoding) wins when verification stops being nearly free, as at large batches. A
sequence that stops speculating drifts back to the prior, so it tries again; one never planned
counts as accepting everything, so its first step drafts and measures it.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.costs import BatchCost, LinearCost


@dataclass(slots=True)
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0


class AdaptiveDepth:
    PRIOR, PRIOR_WEIGHT, DECAY, DRIFT = 0.7, 2.0, 0.8, 0.97
    KIND_DECAY, MIN_KIND_TRIALS = 0.98, 8.0  # a kind's acceptance: per verified sequence, over all of them
    ALPHA_STEPS, LINES_MOVED = 64, 0.03  # a batch of one's depth is kept (`_best_one_kept`) while these hold
    REMEASURE_PLANS = 64  # plans without a draft pass observed before one of no drafts restarts the draft's line

    def __init__(self, max_k: int, adaptive: bool, target_cost: BatchCost | LinearCost, draft_cost: LinearCost | None):
        self.max_k, self.adaptive = max_k, adaptive
        self.target_cost, self.draft_cost = target_cost, draft_cost
        self._acc: dict[str, _Acceptance] = {}
        self._kinds: dict[bool, _Acceptance] = {}  # sampled -> acceptance over every sequence of that kind
        self._kept_lines: tuple[float, float] | None = None  # the predicted seconds `_kept` was picked on
        self._kept: dict[tuple[int, int], int] = {}  # (α step, top) -> a batch of one's depth
        self._plans = 0  # plans made (with a draft model)
        self._draft_fed = (0, 0)  # the draft line's observations, and the plan at which that count was new

    def alpha(self, req_id: str, sampled: bool = False) -> float:
        """The sequence's recent acceptance, pulled towards PRIOR. One never planned starts at
        the recent acceptance of its kind (greedy or sampled: on the demo pair about 0.97 against
        0.65), or 1 before its kind has MIN_KIND_TRIALS: an untried sequence drafts at the depth
        its kind earns, once, and so shows its own rate. Started at PRIOR instead, it stayed
        plain from its first step wherever the fitted costs made PRIOR not worth a draft token,
        and it never drafted, so its real acceptance (about 0.97 on the demo pair, greedy) was
        never seen. Started at 1 every time, each exploring burst of the gate (`gate.py`) opened
        with every new sequence at the full depth: at batch 8, temperature 1, the n-gram
        proposer (acceptance about 0.01) verified 4 tokens a sequence in a burst's first step."""
        acc = self._acc.get(req_id)
        if acc is None:
            kind = self._kinds.get(sampled)
            return 1.0 if kind is None or kind.trials < self.MIN_KIND_TRIALS else kind.accepted / kind.trials
        return (acc.accepted + self.PRIOR * self.PRIOR_WEIGHT) / (acc.trials + self.PRIOR_WEIGHT)

    def plan(self, seqs: list[Sequence], rooms: list[int], fused: bool = False) -> list[int]:
        """Each decoding sequence's k for this step, at most its room (tokens left before
        max_tokens / the context end) and max_k. fused: the step can run as one native call
        (`fused_step`), whose draft runs every sequence to the deepest k and which takes only
        sequences with a draft: then, in a batch, the draft's passes cost the whole batch's rows
        at every depth, a position's marginal cost is its verification alone, and a sequence
        trimmed below one draft keeps one (`_best_batch`).

        Each sequence's powers α^j and expected tokens E(k) are tabled once per plan, and a
        step's cost is the closed form of `step_cost` (the draft's passes sum to
        a·max k + b·Σk on its line): the plan tried every depth with both recomputed, 29 µs at
        batch 1, 65 at 8 and 185 at 32, every speculative step (scratch timing).

        Where no sequence's acceptance covers the least a token can add to the step at plain
        decoding's rate, the plan is plain without trying the depths (`_all_plain`): the n-gram
        proposer at temperature 1 (acceptance near 0) planned nothing but plain steps, at 53 µs
        a plan at batch 8 and 144 at 32, some 2% of the step (scratch timing, Intel Xeon)."""
        tops = [max(0, min(self.max_k, r)) for r in rooms]
        if not self.adaptive or not seqs:
            return tops
        alphas = [self.alpha(s.req_id, not s.params.is_greedy) for s in seqs]
        all_plain = self._all_plain(alphas)
        best_ks = [0] * len(seqs) if all_plain else self._best(alphas, tops, fused)
        if self.draft_cost is not None:
            best_ks = self._remeasured(best_ks, all_plain, alphas, tops, fused)
        for s, k in zip(seqs, best_ks):
            if k == 0:  # not speculating: forget slowly so the sequence tries again later
                acc = self._acc.setdefault(s.req_id, _Acceptance())
                acc.accepted *= self.DRIFT
                acc.trials *= self.DRIFT
        return best_ks

    def _remeasured(self, ks: list[int], all_plain: bool, alphas: list[float], tops: list[int],
                    fused: bool) -> list[int]:
        """The plan; or, where it drafts nothing and the draft's line has not been fed for
        REMEASURE_PLANS plans (steps the gate let speculate), the plan on the draft's line
        started afresh (`LinearCost.reset`: its passes priced free until measured again). The
        line is fed only by the draft's passes: walked up by a run of stalls, it kept every plan
        plain for good (`LinearCost`). In one run of `spec_decode.py` draft adaptive decoded
        plainly through three repeats of batch 1 greedy (0.98x plain, where k = 4 ran 3.2x),
        likely so (the run kept no trace of the line). Where the line was right, the plan drafts
        a step or two in REMEASURE_PLANS before the line is measured again.
        Not where no depth pays with the passes free (`_all_plain`: the target's line alone)."""
        self._plans += 1
        fed = self.draft_cost.observations
        if fed != self._draft_fed[0]:
            self._draft_fed = (fed, self._plans)
        if any(ks) or self._plans - self._draft_fed[1] < self.REMEASURE_PLANS or not self._draft_measured:
            return ks
        self._draft_fed = (fed, self._plans)  # once a period, whether this one drafts or not
        if all_plain:
            return ks
        self.draft_cost.reset()
        return self._best(alphas, tops, fused)

    def _all_plain(self, alphas: list[float]) -> bool:
        """Whether plain decoding is the best plan whatever the depths: the first draft of the
        most accepting sequence adds α tokens at most, and no less than the target's least
        seconds a token (`least_slope`: its row blocks may come free) to the step; where
        α < that × the plain step's tokens per second, every plan with drafts is slower than
        the plain step (each draft adds fewer tokens than its seconds earn at plain decoding's
        rate, and the draft's passes cost more on top)."""
        target, num_seqs = self.target_cost, len(alphas)
        return max(alphas) * target(num_seqs, num_seqs) < target.least_slope * num_seqs

    def verdict(self, batch_size: int, sampled: bool) -> bool | None:
        """Whether the model expects speculation to pay for a batch of `batch_size` new requests
        of a kind (greedy or sampled), at their kind's recent acceptance; None until it can
        tell: the kind's acceptance, the target's line and the draft's (a draft model's) all
        measured. The gate (`gate.py`) follows it on a new regime's steps before it measures."""
        kind = self._kinds.get(sampled)
        if (not self.adaptive or kind is None or kind.trials < self.MIN_KIND_TRIALS or self.target_cost.is_guess
                or (self.draft_cost is not None and not self._draft_measured)):
            return None
        return any(self._best([kind.accepted / kind.trials] * batch_size, [self.max_k] * batch_size))

    def _best(self, alphas: list[float], tops: list[int], fused: bool = False) -> list[int]:
        """The depths, at most `tops`, that maximise the batch's expected tokens per second (a
        batch of one: its passes are its own either way, and depth 0 is a plain step, not a
        step that no longer fuses)."""
        if len(alphas) == 1:
            return [self._best_one_kept(alphas[0], tops[0])]
        return self._best_batch(alphas, tops, fused)

    def _best_one_kept(self, alpha: float, top: int) -> int:
        """`_best_one`, kept for the acceptance (in steps of 1/ALPHA_STEPS) and the top while
        neither the target's predicted seconds for a full-depth verification nor the draft's for
        its passes has moved by more than LINES_MOVED of that verification's since it was picked.
        One sequence's plan ran every speculative step and took about 10 µs of it, 0.6% of a
        batch-1 greedy step on the demo pair (Intel Xeon, scratch timing), for a choice that
        changes only where α or the lines cross a boundary between two depths. Not each line's
        parameters within 1%: the draft's intercept moved by 1-5% from one step to the next, and
        the depth was picked again at four steps in five (scratch trace)."""
        t = self.target_cost
        d = self.draft_cost if self._draft_measured else None
        n = self.max_k + 1
        verify = t(n)
        passes = (d.a + d.b) * self.max_k if d is not None else 0.0
        kept = self._kept_lines
        if (kept is None or abs(verify - kept[0]) > self.LINES_MOVED * kept[0]
                or abs(passes - kept[1]) > self.LINES_MOVED * kept[0]):
            self._kept_lines, self._kept = (verify, passes), {}
        key = (int(alpha * self.ALPHA_STEPS), top)
        k = self._kept.get(key)
        if k is None:
            k = self._kept[key] = self._best_one(alpha, top)
        return k

    def _best_one(self, alpha: float, top: int) -> int:
        """`_best_batch` for one sequence, in scalars, with the same sums in the same order (the
        tests compare the two): it runs every speculative step, and at batch 1 the lists and the
        closure took 19 µs of a 1.6 ms step (scratch timing, Intel Xeon, demo pair; 12 µs
        against 4 in a loop)."""
        target = self.target_cost
        draft = self.draft_cost if self._draft_measured else None
        draft_a, draft_b = (draft.a, draft.b) if draft is not None else (0.0, 0.0)
        slope = target.slope + (draft_b if draft is not None else 0.0)
        powers = [alpha ** j for j in range(top + 2)]
        falling = [-x for x in powers[1:top + 1]]  # -α^j, j = 1.., ascending

        def rate(k: int) -> float:
            seconds = target(k + 1)
            if draft is not None and k:
                seconds += draft_a * k + draft_b * k
            return (k + 1.0 if alpha >= 1 else (1 - powers[k + 1]) / (1 - alpha)) / max(seconds, 1e-9)

        best_k, best_rate = 0, 0.0
        for k in range(top + 1):
            kept = k
            if k:  # the positions worth their marginal cost at depth k's rate
                j = bisect_right(falling, -slope * rate(k))
                kept = j if j < k else k
            r = rate(kept)
            if r >= best_rate:  # a tie goes deeper
                best_k, best_rate = kept, r
        return best_k

    def _best_batch(self, alphas: list[float], tops: list[int], fused: bool = False) -> list[int]:
        """`_best` for any batch: each depth k for all, each sequence trimmed to the positions
        worth their own marginal cost at k's rate. fused (`plan`): the draft's passes run the
        whole batch to the deepest k, a position costs only its verification, and a sequence
        keeps at least one draft where its room allows. Planned as if each trimmed sequence's
        passes stopped at its own depth, at batch 32 greedy on the demo pair (Intel Xeon, scratch
        traces) a sixth of the sequences drafted nothing, every step with one of them left the
        fused step for the engine's path (32-43 steps of 80 fused), and adaptive depth ran 4-7%
        slower than fixed k = 4."""
        deepest = max(tops, default=0)
        powers = [[a ** j for j in range(deepest + 2)] for a in alphas]
        depths = range(deepest + 1)
        expected = [[k + 1.0 for k in depths] if a >= 1 else [(1 - p[k + 1]) / (1 - a) for k in depths]
                    for a, p in zip(alphas, powers)]
        falling = [[-x for x in p[1:deepest + 1]] for p in powers]  # -α^j, j = 1.., ascending (0 <= α <= 1)
        target, draft = self.target_cost, self.draft_cost if self._draft_measured else None
        num_seqs = len(alphas)

        def rate(ks: list[int]) -> float:
            total = sum(ks)
            seconds = target(total + num_seqs, num_seqs)
            if draft is not None and total:
                seconds += (draft.a + draft.b * num_seqs) * max(ks) if fused else draft.a * max(ks) + draft.b * total
            return sum([e[k] for e, k in zip(expected, ks)]) / max(seconds, 1e-9)

        slope = target.slope + (draft.b if draft is not None and not fused else 0.0)
        floor = 1 if fused else 0
        best_ks, best_rate = [0] * num_seqs, 0.0
        for k in depths:
            ks = [t if t < k else k for t in tops]
            if k:  # each sequence keeps the positions worth their marginal cost at this depth's rate
                worth = -slope * rate(ks)  # negated, as `falling` is: the leading j with α^j >= worth stay
                ks = [j if (j := max(bisect_right(f, worth), min(floor, kk))) < kk else kk
                      for f, kk in zip(falling, ks)]
            r = rate(ks)
            if r >= best_rate:  # a tie goes deeper: what costs no more per token gets measured
                best_ks, best_rate = ks, r
        return best_ks

    @property
    def _draft_measured(self) -> bool:
        """Whether the draft's cost line is more than a guess (`LinearCost(guess=True)`). Until
        a pass is observed the plan counts the draft's passes as free, so the first plan drafts
        and its passes are measured. The engine's guess (2 ms + 0.05 ms a token) overstates a
        pass of the demo draft some thirty times on the AMD EPYC (about 0.06 ms). Taken as a
        measurement, against a target line fit on one short prompt's prefill, it made every depth
        dearer than plain decoding. The plan then drafted nothing, and with no pass observed the
        line never came back: with default options, a 6-token prompt never speculated in four
        48-token requests."""
        return self.draft_cost is not None and not self.draft_cost.is_guess

    def step_cost(self, ks: list[int], fused: bool = False) -> float:
        """Predicted seconds of a step whose sequences verify ks[i] draft tokens each (the
        draft's passes free until one is measured: `_draft_measured`; fused, each pass over every
        sequence): the cost `plan` uses, written out pass by pass."""
        seconds = self.target_cost(sum(ks) + len(ks), len(ks))
        if self._draft_measured:
            for j in range(1, max(ks, default=0) + 1):
                seconds += self.draft_cost(len(ks) if fused else sum(1 for k in ks if k >= j))
        return seconds

    def record(self, req_id: str, k: int, num_accepted: int, sampled: bool = False) -> None:
        trials = num_accepted + (1 if num_accepted < k else 0)
        acc = self._acc.setdefault(req_id, _Acceptance())
        acc.accepted = acc.accepted * self.DECAY + num_accepted
        acc.trials = acc.trials * self.DECAY + trials
        kind = self._kinds.setdefault(sampled, _Acceptance())
        kind.accepted = kind.accepted * self.KIND_DECAY + num_accepted
        kind.trials = kind.trials * self.KIND_DECAY + trials

    def forget(self, req_id: str) -> None:
        self._acc.pop(req_id, None)
