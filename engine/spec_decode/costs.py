"""The cost lines adaptive depth plans on (`depth.AdaptiveDepth`): T_target(n, B), the measured
time of a step's target side over n tokens of B sequences (`BatchCost`: the step's wall time less
the draft's proposal, its row blocks of AMX tiles counted), and T_draft(n), that of one of the
draft's passes over n sequences (`LinearCost`). Each is fit as the engine's steps and the
draft's passes are timed, from a prior that may be a guess until something is measured.
"""
from __future__ import annotations

from collections.abc import Callable


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
