"""Adaptive speculation depth: the step's k follows the batch's recent acceptance, through a
cost model of target and draft step times that knows the batch size.

For a sequence with per-token acceptance rate α, k draft tokens yield on average
E(k) = (1 − α^(k+1)) / (1 − α) tokens per step. A step over B decoding sequences at depths k_i
costs

    cost = T_target(Σ (k_i + 1), B) + Σ_{j=1..max k_i} T_draft(#{i: k_i ≥ j})

with T_target(n, B) the measured time of a step's target side over n tokens of B sequences (the
step's wall time less the draft's proposal: the forward, the verification's sampling and the
step's bookkeeping; `BatchCost`, which also counts the row blocks of AMX tiles) and T_draft(n)
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
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence


TARGET_PRIOR_KEPT = 1e-3  # the target's cost (`BatchCost`): its guess's weight once the slope is measured


class LinearCost:
    """seconds ≈ a + b·n, fit by exponentially weighted least squares over observed passes,
    starting from a weak prior (two pseudo-observations on the prior line): the draft's passes,
    whose rows are one a sequence (the target's steps: `BatchCost`; a line given as the target
    prices every size alike, its `seqs` ignored).

    An observation counts as at most CLIP times the line's prediction, as a step does in the
    gate: a stall of the host (a collection pass, another process on the core) is not a cost of
    the pass. Unclipped, one 384 ms stall of a 5-token verification (the demo target's take
    4-6 ms) moved the target's line to 19 ms + 0.12 ms/token (logged in a batch-1 greedy run).
    On the draft's line such a stall would make every depth look dearer than plain decoding;
    the plan would then draft nothing, and with no draft pass observed the line would not come
    back. Clipped, a run of stalls still walks the line up, each at most CLIP times the last
    prediction: 80 passes observed at 50 ms took the demo draft's from 62 µs to 7.8 ms a pass,
    and at batch 1 greedy the plan drafted nothing after (scratch run). The plan then starts the
    line afresh (`reset`, from `AdaptiveDepth._remeasured`)."""

    CLIP = 3.0
    GUESS_KEPT = 0.05  # a guessed prior's share of its weight once a real pass is observed

    def __init__(self, a: float, b: float, decay: float = 0.97, guess: bool = False, kept: float = GUESS_KEPT):
        """guess: the prior line is a placeholder, not a measurement (a draft model's passes,
        which depend on the model and the host): `is_guess` stays True (`AdaptiveDepth` then
        counts the draft's passes as free, so they get run and measured) until a pass is
        observed, and the prior then keeps `kept` of its weight: a draft's passes all have one
        n per batch size, and the prior keeps enough to pin the slope."""
        self.decay, self.kept = decay, kept
        self._start = (a, b, guess)
        self.reset()
        self.observations = 0  # calls to `observe`: whether the line has been fed since some time

    def reset(self) -> None:
        """Back to the prior line, with nothing observed: a guess prices the draft's passes free
        again until one is measured (`AdaptiveDepth._draft_measured`)."""
        a, b, guess = self._start
        self._s = [0.0] * 5  # the observations' weighted sums of 1, n, n², t, n·t
        self._prior = [0.0] * 5  # the same of the prior line's two points, as first weighed
        self._prior_weight = 1.0  # its weight now: decayed with the observations, times `kept` once a guess steps aside
        self.a, self.b = a, b
        for n in (1, 64):
            for i, v in enumerate((1.0, n, n * n, a + b * n, n * (a + b * n))):
                self._prior[i] += 0.5 * v
        self.is_guess = guess

    def observe(self, n: int, seconds: float, count: int = 1, seqs: int | None = None) -> None:
        """`count` passes over n tokens, each of these seconds: the same fit as that many calls
        (the clip aside, taken once on the line before them), in one (a draft's passes run at
        once are timed together; four calls a step cost about 15 µs, scratch timing). Written
        out term by term: it runs after every step, and with lists and zips it took 10 µs a call
        (scratch timing, Intel Xeon), some 1% of a batch-1 step with two calls."""
        self.observations += 1
        if self.is_guess:  # the guess steps aside
            self._prior_weight, self.is_guess = self._prior_weight * self.kept, False
        predicted = self.a + self.b * n
        if predicted > 0 and seconds > self.CLIP * predicted:
            seconds = self.CLIP * predicted
        if count == 1:
            decay, weight = self.decay, 1.0
        else:
            decay = self.decay ** count
            weight = (1.0 - decay) / (1.0 - self.decay) if self.decay != 1.0 else float(count)  # 1 + d + … + d^(count-1)
        s, p = self._s, self._prior
        wn, wt = weight * n, weight * seconds
        s[0] = s[0] * decay + weight
        s[1] = s[1] * decay + wn
        s[2] = s[2] * decay + wn * n
        s[3] = s[3] * decay + wt
        s[4] = s[4] * decay + wt * n
        self._prior_weight = pw = self._prior_weight * decay
        w, sn, snn, st, snt = s[0] + pw * p[0], s[1] + pw * p[1], s[2] + pw * p[2], s[3] + pw * p[3], s[4] + pw * p[4]
        det = w * snn - sn * sn
        if det > 1e-12:
            b = (w * snt - sn * st) / det
            self.b = max(b, 0.0)
            self.a = max((st - self.b * sn) / w, 0.0)

    def __call__(self, n: int, seqs: int | None = None) -> float:
        return self.a + self.b * n

    @property
    def slope(self) -> float:
        """Seconds one more token adds, on average: what `AdaptiveDepth` weighs a position by."""
        return self.b

    @property
    def least_slope(self) -> float:
        """The least seconds one more token adds (`AdaptiveDepth._all_plain`)."""
        return self.b


class BatchCost:
    """The target's step: seconds ≈ A_s + b·n + c·g(n) over n tokens of s sequences, each batch
    size s with its own intercept A_s and every size sharing the slope b, fit by exponentially
    weighted least squares (a fixed-effects fit: b comes from how one size's steps vary in n,
    never from how sizes differ).

    Each size its own intercept: a step reads each sequence's K/V once for all its rows, and
    samples and books each sequence, so a plain step's rows (one a sequence) cost more than the
    rows a verification adds. On the demo pair (Intel Xeon, scratch traces of every step) a
    plain step of 8 rows took 2.44 ms, and 8 sequences verifying 16, 24, 32 and 40 rows 2.84,
    3.71, 4.46 and 5.16 ms; at batch 32 a plain step took about 6 ms, and the batch's last
    steps, few sequences left, 1.4-3 ms over 1-15 rows. One line through a run's steps read how
    sizes differ as the rows' cost. Through its prefills too (a prompt's rows, without logits,
    cost 64 µs each against a verified row's 100), it read 8 rows 21% dearer and 40 rows 5%
    cheaper than measured, and at batch 8, temperature 1 the plan verified three drafts a
    sequence where one ran 1.22x plain decoding and three 1.12x. Through decode steps alone, it
    took its slope from the batch's last steps (0.15 ms a row at batch 32, where a verified
    row costs 0.1), and the plan decoded plain where fixed k = 4 ran 1.15x faster. Prefills
    are not observed (`Speculator.observe_step`).

    g(n), c: where the target's projections multiply rows in blocks (AMX tiles: 16 rows at a
    time from 7 rows, `kernels/cpu/linear.cpp`), the blocks a pass over n tokens multiplies in
    (`blocks`) and a block's seconds, measured apart (`ModelRunner.row_blocks`): the cost climbs
    in steps that a line smooths over. At batch 8, temperature 1 on the demo pair (Intel Xeon,
    scratch timing) verifying 16 rows cost 2.55 ms, 24 rows 3.63, 32 rows 4.26 and 40 rows
    5.29: about 80 µs a row and 0.4 ms a block. c is not fit with b: a plan's steps sit at few
    sizes (the batch's plain steps and its chosen depth), which cannot tell a block's cost from
    the rows'; fit with them, c came out 0 (scratch trace).

    A size's sums decay with its own steps, so a size not seen for a while keeps what it
    measured. Until one size has steps of two n the slope is a guess, and predictions take
    none (`is_guess`): the plan verifies drafts and so measures a second n. Taken as a prior at
    full weight, the guess's slope (0.5 ms a token) decided: after a 9-token prompt and 0.4 ms
    decode steps a 5-token verification read 2.8 ms, against 0.8 measured, and adaptive depth
    never drafted again (`pdserve generate`, AMD EPYC). Once measured, the guess keeps `kept`
    of its weight. A size never seen takes the intercept of the nearest seen (the guess's a
    before any)."""

    CLIP = LinearCost.CLIP
    BLOCK_ROWS = 16  # rows a block multiplies (`kernels/cpu/linear_amx.h`, kTileRows)
    RESUM = 256  # observations between fresh sums of `_within` (each kept by taking a size's old share out)
    SPREAD = 1e-9  # the centred n² below which, beside the raw n², b is not refit: steps of one n say nothing of it

    def __init__(self, a: float, b: float, decay: float = 0.97, kept: float = TARGET_PRIOR_KEPT,
                 blocks: Callable[[int], int] | None = None, block_seconds: float = 0.0):
        self.decay, self.kept = decay, kept
        self._guess_a, self._guess_b, self.b = a, b, b
        self._blocks_of, self._blocks = blocks, {}
        self.c = block_seconds if blocks is not None else 0.0
        self._sizes: dict[int, list[float]] = {}  # s -> the weighted sums of 1, n, n², t, n·t over its steps
        self._within = [0.0, 0.0]  # Σ over the sizes of their centred sums of n², n·t: what b is fit on
        self._observed = 0  # observations since `_within` was last summed afresh (`RESUM`)
        self._prior_xx = 0.5 * 31.5 ** 2 * 2  # the guess's, as two points at 1 and 64 tokens of weight 1/2
        self._prior_weight = 1.0
        self.is_guess = True

    def blocks(self, n: int) -> int:
        if self._blocks_of is None:
            return 0
        g = self._blocks.get(n)
        if g is None:
            g = self._blocks[n] = int(self._blocks_of(n))
        return g

    def intercept(self, seqs: int) -> float:
        """A_s: this size's, or the nearest measured size's, or the guess's."""
        sums = self._sizes.get(seqs)
        if sums is None:
            if not self._sizes:
                return self._guess_a
            sums = self._sizes[min(self._sizes, key=lambda x: (abs(x - seqs), x))]
        return max((sums[3] - self.rows_slope * sums[1]) / sums[0], 0.0)

    def observe(self, n: int, seconds: float, count: int = 1, seqs: int = 1) -> None:
        """`count` steps over n tokens of `seqs` sequences, each of these seconds, at most CLIP
        times the prediction (`LinearCost.observe`)."""
        t = max(seconds - self.c * self.blocks(n), 0.0)
        sums = self._sizes.get(seqs)
        if sums is None:
            sums = self._sizes[seqs] = [0.0] * 5
        elif (predicted := self.intercept(seqs) + self.rows_slope * n) > 0 and t > self.CLIP * predicted:
            t = self.CLIP * predicted
        # the slope is measured once a size sees a second n (its earlier steps' mean n is not this n)
        if self.is_guess and abs(sums[1] - n * sums[0]) > 0.5 * sums[0]:
            self.is_guess, self._prior_weight = False, self._prior_weight * self.kept
        if count == 1:
            decay, weight = self.decay, 1.0
        else:
            decay = self.decay ** count
            weight = (1.0 - decay) / (1.0 - self.decay) if self.decay != 1.0 else float(count)
        w, sn, snn, st, snt = sums
        within = self._within
        if w > 0:  # this size's share of the centred sums, before the step
            within[0] -= snn - sn * sn / w
            within[1] -= snt - sn * st / w
        wn = weight * n
        sums[0] = w = w * decay + weight
        sums[1] = sn = sn * decay + wn
        sums[2] = snn = snn * decay + wn * n
        sums[3] = st = st * decay + weight * t
        sums[4] = snt = snt * decay + wn * t
        self._observed += 1
        if self._observed < self.RESUM:
            within[0] += snn - sn * sn / w
            within[1] += snt - sn * st / w
        else:  # afresh, so the rounding of the updates does not pile up
            self._observed = 0
            within[0] = sum(x[2] - x[1] * x[1] / x[0] for x in self._sizes.values())
            within[1] = sum(x[4] - x[1] * x[3] / x[0] for x in self._sizes.values())
        self._prior_weight = pw = self._prior_weight * decay
        # Where every size's recent steps sat at one n (a batch of one drafting 4 each step), the
        # centred sums decay towards their rounding error: b stays as last measured.
        xx = within[0] + pw * self._prior_xx
        if xx > self.SPREAD * snn:
            self.b = max((within[1] + pw * self._prior_xx * self._guess_b) / xx, 0.0)

    def __call__(self, n: int, seqs: int = 1) -> float:
        return self.intercept(seqs) + self.rows_slope * n + self.c * self.blocks(n)

    @property
    def rows_slope(self) -> float:
        """b, or 0 while it is a guess."""
        return 0.0 if self.is_guess else self.b

    @property
    def slope(self) -> float:
        """Seconds one more token adds, its share of a block with it: what `AdaptiveDepth`
        weighs a position by."""
        return self.rows_slope + self.c / self.BLOCK_ROWS

    @property
    def least_slope(self) -> float:
        """The least seconds one more token adds: a row within a block already multiplied."""
        return self.rows_slope


def target_line(blocks: tuple[Callable[[int], int], float] | None = None) -> BatchCost:
    """The engine's cost of a step's target side: a guess (5 ms + 0.5 ms a token) until it is
    measured (`BatchCost`). blocks: where the target's projections work in blocks of rows
    (`ModelRunner.row_blocks`), the blocks a pass over n tokens multiplies in and a block's
    seconds; None: none."""
    if blocks is not None:
        return BatchCost(a=5e-3, b=5e-4, blocks=blocks[0], block_seconds=blocks[1])
    return BatchCost(a=5e-3, b=5e-4)


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
        best_ks = [0] * len(seqs) if self._all_plain(alphas) else self._best(alphas, tops, fused)
        if self.draft_cost is not None:
            best_ks = self._remeasured(best_ks, alphas, tops, fused)
        for s, k in zip(seqs, best_ks):
            if k == 0:  # not speculating: forget slowly so the sequence tries again later
                acc = self._acc.setdefault(s.req_id, _Acceptance())
                acc.accepted *= self.DRIFT
                acc.trials *= self.DRIFT
        return best_ks

    def _remeasured(self, ks: list[int], alphas: list[float], tops: list[int], fused: bool) -> list[int]:
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
        if self._all_plain(alphas):
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
