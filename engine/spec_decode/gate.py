"""`SpeculationGate`: speculate only where it measurably pays, per batch size and kind.

The depth model (`depth.py`) picks each step's depths from predicted costs; this gate checks the
prediction against what happens. For each regime — a batch-size bucket (1, 2–3, 4–7, 8–15, …),
and whether any request in the batch samples (acceptance differs most between greedy and sampled
requests: on the demo pair α ≈ 1.0 greedy against 0.5 at temperature 1, and one record for both
carried the sampled batches' verdict over to greedy ones) — it keeps a decayed sum of wall
seconds and of emitted tokens over recent pure-decode steps, with and without speculation, and
lets a step speculate only while that is the cheaper mode per token. A new regime starts from
the verdict of a decided neighbouring bucket; with none, each mode first runs a short burst to
be measured, and the steps it cannot measure before them follow the cost model
(`AdaptiveDepth.verdict`, once the kind's acceptance and both cost lines are measured).
Afterwards the losing mode runs one burst after a waiting period, so a change in acceptance or
load is noticed, and the burst is judged against the running mode's steps right after it, at
the same contexts (`_burst_wins`): a step's cost grows with its contexts over a run, so figures
of different ages do not compare. The first verdict is speculation's only when it measures
cheaper by more than KEEP_MARGIN, and once decided, the verdict moves only when the other mode
does: at parity plain decoding, and then the running mode, stays. A burst that measures far
dearer than the running mode (`FAR_BEHIND`) ends early (`_burst_lost`). The period starts at
PERIOD steps and doubles, up to MAX_PERIOD, each time a burst leaves the same mode winning; it
starts again at PERIOD when the winner changes, and when most of the batch's requests are new
since the period started (`renew`: acceptance belongs to requests). Exploring is not free: a
draft model that sat out the plain steps must catch up on every token they emitted before its
first proposal, and the burst itself runs the losing mode. With a burst every 64 steps, a
128-token run at batch 32, temperature 1 on the demo pair (where plain decoding wins) took 7%
longer than plain decoding. So the gate also learns what switching to speculation costs (the
first speculative step's time beyond an ordinary one: the catch-up), and while plain decoding
wins, bursts of speculation come no more often than keeps that cost under EXPLORE_SHARE of the
plain steps between them (at batch 32 the demo draft's catch-up after a 128-token run took
about 0.24 s, some 14 plain steps, so its bursts come at most every ~700 steps), and it turns to
speculation only when speculation wins by enough to repay the switch within PERIOD steps. A
burst that comes due while the batch's requests are old waits, MAX_PERIOD steps at most, until most of
them are new (`renew`): the catch-up then covers little more than their prompts. The draft's
catch-up on each fresh prompt is a cost of speculating as well, spread over the requests' tokens
(`observe_catch_up`). This is what keeps speculation from being slower than plain decoding at
batch sizes where verification is not free (a compute-bound CPU, large batches), whatever the
model says.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.spec_decode.gate_figures import Figures, per_token, trailing


@dataclass(slots=True)
class _Schedule:
    """When a regime measures its losing mode next."""

    steps: int = 0  # allow() calls so far
    speculate: bool = True  # the winner at the last decision
    period: int = 0  # steps between exploring bursts now
    next_burst: int = 0  # the step at which the next exploring burst starts
    renewed: int = -(1 << 30)  # the step of the last `renew` (most of the batch new)
    due: int | None = None  # the step since which a burst of speculation waits for a cheap switch
    measured: int = 0  # the step at which the last exploring burst ended (0: none since the opening)
    far_behind: bool = False  # it ended early, far behind the running mode (`_burst_lost`)
    # how much dearer per token the losing mode measured than the winner at its last burst, at
    # the same contexts (`_burst_wins`, `_burst_lost`; below 0 where it lost on KEEP_MARGIN
    # alone); None from the losing mode's next measured step until its burst is judged
    lost_by: float | None = None
    last_spec: int = -(1 << 30)  # the last step allowed to speculate (plain steps right after it are cold)

    @property
    def confirmed(self) -> bool:
        """Whether an exploring burst has been judged since the opening (`renew`)."""
        return self.measured > 0


class SpeculationGate:
    BURST = 4  # steps a mode runs when it is measured
    PERIOD = 64  # steps before the losing mode's first exploring burst
    MAX_PERIOD = 1024  # the period doubles up to this while the winner stays the same
    DECAY, CLIP = Figures.DECAY, Figures.CLIP  # how the measured figures decay and clip a stalled step
    EXPLORE_SHARE = 0.02  # switching to speculation to explore it costs at most this share of the plain steps between
    RENEW_MARGIN = 0.1  # new requests bring the next burst forward only while the loser lost by less than this
    KEEP_MARGIN = 0.05  # how much cheaper the other mode must measure to move a verdict (speculation: to win the first)
    FRESH = BURST  # steps after a `renew` in which a switch to speculation is cheap (see `_waits`)
    MIN_BURST = 2  # measured steps a burst runs at least
    FAR_BEHIND = 0.5  # a burst that measures this much dearer per token than the running mode ends early
    REMEASURE_AFTER = 2 * BURST  # steps after a burst before speculation's drift may bring the next forward
    COLD = 4  # plain steps right after speculative ones that are not compared: `observe`
    OPENING = 2 * BURST + COLD  # a new regime's opening: a burst of speculation, then one of plain decoding

    def __init__(self, predict: Callable[[int, bool], bool | None] | None = None) -> None:
        """predict(batch_size, sampled): the cost model's verdict for a regime, or None while it
        cannot tell (`AdaptiveDepth.verdict`): the mode of a new regime's unmeasured steps."""
        self._predict = predict
        self._schedules: dict[tuple[int, bool], _Schedule] = {}
        # what each mode measured: a burst (COLD steps longer for plain) and the running mode's steps after it
        self.figures = Figures(keep=2 * self.BURST + self.COLD)

    @property
    def prompt_per_output(self) -> float:
        """Prompt tokens per output token of the requests finished lately (`Speculator.forget`)."""
        return self.figures.prompt_per_output

    @prompt_per_output.setter
    def prompt_per_output(self, value: float) -> None:
        self.figures.prompt_per_output = value

    @staticmethod
    def regime(batch_size: int, sampled: bool) -> tuple[int, bool]:
        return max(batch_size, 1).bit_length(), sampled

    def allow(self, batch_size: int, sampled: bool = False, settled: bool = True) -> bool:
        """Whether this step may speculate: a burst of each mode first, then the cheaper one,
        with a burst of the other after each period. An unsettled step (one the caller will not
        measure: caches still warming after a prefill) gets the current verdict and does not
        count towards the schedule, so no burst is spent on steps that are not measured."""
        key = self.regime(batch_size, sampled)
        st = self._schedules.get(key)
        if st is None:
            st = self._schedules[key] = self._borrowed(key)
        if not settled:
            return st.speculate if st.period else self._predicted(batch_size, sampled)
        st.steps = st.steps + 1
        if speculate := self._settled(st, batch_size, sampled):
            st.last_spec = st.steps
        return speculate

    def _settled(self, st: _Schedule, batch_size: int, sampled: bool) -> bool:
        """`allow` for a settled step, the schedule's st.steps-th."""
        n = st.steps
        if n <= self.OPENING:
            if n <= self.BURST + self.MIN_BURST or not self._burst_lost(st, batch_size, sampled, self.BURST + 1):
                return n <= self.BURST
            st.steps = n = self.OPENING + 1  # plain decoding lost its first burst by far: decide now
        if st.period and n < st.next_burst and (not st.speculate or n - st.measured < self.REMEASURE_AFTER
                                                or (n - st.measured) % self.BURST):
            # nothing can move the verdict before the burst (most steps; no costs needed): while
            # speculating, its drift is checked every BURST steps, not every step (the check cost
            # 8 µs, 0.5% of a batch-1 greedy step on the demo pair, scratch timing)
            return st.speculate
        costs = self._costs(st, batch_size, sampled)
        if costs is None:
            if st.period:  # a borrowed verdict: kept until its burst of the other mode measures both
                if n == st.next_burst:
                    st.next_burst, st.due = (n + 1, st.due) if self._waits(st, n, batch_size, sampled) else (n, None)
                return st.speculate if n < st.next_burst else not st.speculate
            return self.seconds_per_token(batch_size, True, sampled) is None
        spec_cost, plain = costs
        if st.period == 0:  # the first decision, on the two bursts just measured, a few steps apart
            # Speculation must win it by KEEP_MARGIN too: what it costs outside its measured steps
            # is not all priced (the draft's pass over each prompt is, but not the ragged end of a
            # batch whose requests finish steps apart), and at batch 32, temperature 1 on the demo
            # pair (Intel Xeon, scratch traces), where the opening bursts measured within 2% of
            # each other, speculating cost 1.8 s a 128-token run against plain decoding's 1.4-1.6.
            winner = spec_cost * (1 + self.KEEP_MARGIN) < plain
            st.lost_by = self._lost_by(costs, winner)
            return self._decide(st, winner, n, batch_size, sampled)
        moves = self._challenger_wins(st, costs)
        if n < st.next_burst:
            if not (moves and st.speculate and n - st.measured >= self.REMEASURE_AFTER):
                return st.speculate
            # Speculation now measures dearer than plain decoding did when last measured: its
            # acceptance may have fallen, and plain decoding is measured again now. Not the other
            # way round: plain steps get dearer as contexts grow, which says nothing of
            # speculation, and brought forward on that, at batch 8, temperature 1 on the demo pair
            # each 128-token run spent a burst of speculation (and its draft's catch-up) late
            # in the run.
            st.next_burst = n
        if n == st.next_burst and self._waits(st, n, batch_size, sampled):
            st.next_burst = n + 1
            return st.speculate
        st.due = None
        # a burst of plain decoding, and plain decoding's steps after a burst of speculation,
        # run COLD steps more: the first after speculative steps are not compared (`observe`)
        ended = st.next_burst + self.BURST + (self.COLD if st.speculate else 0)
        if n < ended:  # exploring
            if not self._burst_lost(st, batch_size, sampled, st.next_burst):
                return not st.speculate
            # the burst lost by far: it ends now, and the running mode needs no steps to compare
            st.measured = n
            return self._keep(st, n, batch_size, sampled)
        if n < ended + self.BURST + (0 if st.speculate else self.COLD):  # the running mode again, to compare with
            return st.speculate
        st.measured, st.far_behind = n, False
        if self._burst_wins(st, batch_size, sampled, moves):  # the burst just ended, and the other mode was cheaper
            return self._decide(st, not st.speculate, n, batch_size, sampled)
        return self._keep(st, ended, batch_size, sampled)

    def _keep(self, st: _Schedule, ended: int, batch_size: int, sampled: bool) -> bool:
        """The burst that ended at step `ended` left the same winner: the period doubles."""
        st.period = max(min(2 * st.period, self.MAX_PERIOD), self._first_period(batch_size, sampled, st.speculate))
        st.next_burst = ended + st.period
        return st.speculate

    def _burst_lost(self, st: _Schedule, batch_size: int, sampled: bool, start: int) -> bool:
        """Whether the burst running since step `start` (the mode not running) has,
        over at least MIN_BURST measured steps, cost more than FAR_BEHIND more per token than the
        running mode's steps right before it. Then it ends: a few more steps will not turn a gap
        that wide, and each costs that much more. At batch 1, greedy, on the demo pair (Intel Xeon)
        a plain step costs about three times speculation's seconds a token, and a whole burst of
        plain decoding made the 128-token run that held it some 10% slower (51 ms against 46 in a
        scratch trace); in an A/B of eight interleaved repeats, adaptive speculation's worst run
        went from 2.49 to 2.62x plain decoding and its median from 2.60 to 2.63x (batches 8 and 32
        within the host's noise). Where the mode's last burst ended so too (`far_behind`), one
        measured step that confirms it is enough: two plain steps in a 128-token batch-1 greedy
        run cost about 3% of it, and a stall of the host would have to fall on that one step, and
        the mode have caught up since its last burst, for the verdict to stay wrong a period."""
        key = self.regime(batch_size, sampled)
        recent = self.figures.recent(key)
        burst, start_at = trailing(recent, not st.speculate, len(recent), self.BURST, cold=True)
        before, _ = trailing(recent, st.speculate, start_at, self.BURST)
        burst = [x for x in burst if x[3] >= start]  # not an earlier burst's, where this one's steps went unmeasured
        if len(burst) < (1 if st.far_behind else self.MIN_BURST) or not before:
            return False
        spec, plain = self._compared(st, batch_size, sampled, burst, before)
        running, other = (spec, plain) if st.speculate else (plain, spec)
        if other <= running * (1 + self.FAR_BEHIND):
            return False
        self.figures.adopt(key, not st.speculate, burst)
        st.far_behind, st.lost_by = True, self._lost_by((spec, plain), st.speculate)
        return True

    def _predicted(self, batch_size: int, sampled: bool) -> bool:
        """An unmeasured step's mode in a regime with no verdict yet: the cost model's where it
        has one, else speculation (which measures the kind's acceptance). At batch 32,
        temperature 1 on the demo pair, speculating on the steps right after the prefill, where
        the model already said plain decoding wins, cost some 2% of the first 128-token run. The
        model's verdict stops there: taken as the regime's first verdict, kept for PERIOD steps,
        one made from a young model (the target's line fit on a few steps) kept batch 1, greedy,
        plain for 64 steps where speculating runs 2.5 times as fast."""
        verdict = self._predict(batch_size, sampled) if self._predict else None
        return verdict is not False

    def _waits(self, st: _Schedule, n: int, batch_size: int, sampled: bool) -> bool:
        """Whether a burst of speculation (plain decoding running, switching costing a draft's
        catch-up: measured in this regime, or in any while this one has no figure) waits for
        the batch to be mostly new (`renew`), for at most MAX_PERIOD steps, the longest the
        schedule ever waits (a period did not do: at batch 32, temperature 1, where a period is
        a run or less, a burst that had waited one came 90 steps into a 128-token run, its first
        step 42-47 ms against 18-19 ms for a burst at a run's start; scratch trace, Intel Xeon).
        The catch-up covers every token the draft has not seen: late in the requests' lives
        their whole contexts, right after new ones arrive little more than their prompts, which
        a cached prefix may already hold (`BlockManager`'s has_draft). At batch 8, temperature 1
        on the demo pair (Intel Xeon, scratch trace), a burst at the end of a 128-token run took
        19 ms for its first step, 6% of the run, where one 13 steps into a run took 6 ms. This
        holds for the first burst of a borrowed verdict, too, and whatever speculation's last
        figure says: at batch 32, temperature 1 (scratch trace), bursts that came 70-90 steps
        into a 128-token run took 73-80 ms for their first steps against plain's 6, some 6% of
        the run each, where plain decoding won again."""
        key = self.regime(batch_size, sampled)
        switch = self.figures.switch_anywhere(key)
        if st.speculate or not switch:
            return False
        if n - st.renewed <= self.FRESH:
            return False
        st.due = n if st.due is None else st.due
        return n - st.due < self.MAX_PERIOD

    @staticmethod
    def _lost_by(costs: tuple[float, float], speculation_wins: bool) -> float:
        """How much dearer a token the losing mode is than the winner, as a share of the winner's
        (below 0 where it lost on KEEP_MARGIN alone)."""
        spec, plain = costs
        return (plain / spec if speculation_wins else spec / plain) - 1

    @staticmethod
    def _gap(costs: tuple[float, float]) -> float:
        """How much dearer the losing mode is than the winning one, as a share of the winner."""
        return max(costs) / max(min(costs), 1e-12) - 1

    def _challenger_wins(self, st: _Schedule, costs: tuple[float, float]) -> bool:
        """Whether the mode not running measures cheaper than the running one by more than
        KEEP_MARGIN. Where the two are within it (at parity), the running mode stays and is not
        measured against the other early: with no margin, at batch 8, temperature 1 on the demo
        pair (AMD EPYC, where speculating and plain decoding cost about the same per token), each
        mode measured dearer than the other's last figure every few steps on the host's noise
        alone, so a run alternated eight or so speculative steps with four-step plain bursts, and
        each return to speculation made the draft catch up on the tokens the burst emitted."""
        spec, plain = costs
        running, other = (spec, plain) if st.speculate else (plain, spec)
        return other * (1 + self.KEEP_MARGIN) < running

    def _burst_wins(self, st: _Schedule, batch_size: int, sampled: bool, moves: bool) -> bool:
        """BURST steps after an exploring burst: whether the mode it measured beat the running
        one, by KEEP_MARGIN, in the running mode's steps since (at the same contexts, within a
        few tokens). Afterwards the burst alone is the other mode's figure. The running mode's
        decayed figure mixes steps of many ages, and the other mode's came from its last burst:
        compared so, at batch 8, temperature 1 on the demo pair (Intel Xeon, scratch traces of
        128-token runs), speculation measured just after new requests came in was compared with
        plain steps from the previous requests' longer contexts, and two runs in five turned to
        speculating (0.90x and 0.92x plain); judged on the steps after the burst, none of six did.
        The running mode's steps before the burst would not do either: a burst of
        speculation waits for new requests (`_waits`), and the steps before it are then the
        previous requests' last. Without steps of both measured (a prefill between), the
        decayed figures decide (`moves`)."""
        key = self.regime(batch_size, sampled)
        recent, other = self.figures.recent(key), not st.speculate
        after, start_at = trailing(recent, st.speculate, len(recent), self.BURST)
        burst, _ = trailing(recent, other, start_at, self.BURST)
        if not burst or not after:
            return moves
        self.figures.adopt(key, other, burst)
        costs = self._compared(st, batch_size, sampled, burst, after)
        wins = self._challenger_wins(st, costs)
        st.lost_by = self._lost_by(costs, st.speculate != wins)
        return wins

    def _compared(self, st: _Schedule, batch_size: int, sampled: bool, burst: list, running: list) -> tuple[float, float]:
        """(speculating, plain) seconds per token, priced (`_priced`), of a burst's measured steps
        and the running mode's."""
        burst_cost, running_cost = per_token(burst), per_token(running)
        spec, plain = (burst_cost, running_cost) if burst[0][0] else (running_cost, burst_cost)
        return self._priced(st, batch_size, sampled, spec, plain)

    def _borrowed(self, key: tuple[int, bool]) -> _Schedule:
        """A regime's first schedule. When a batch-size bucket next to it, of the same kind, has
        decided (the smaller one if both have), this one starts from its verdict, with its
        own burst of the other mode after PERIOD steps, instead of a burst of each mode now. A
        batch moves between neighbouring buckets as it fills and drains: at batch 32,
        temperature 1 on the demo pair, where plain decoding wins, the last steps of a run (31
        sequences and fewer, as some finish a step earlier) and the first of the next (still
        filling) fell in the 16–31 bucket, each time new, and speculated: a burst, and before
        it the draft's catch-up on every token the plain steps emitted, cost about 6% of a
        128-token run."""
        bucket, sampled = key
        decided = [(abs(b - bucket), b) for (b, s), st in self._schedules.items()
                   if s == sampled and st.period and abs(b - bucket) == 1]
        if not decided:
            return _Schedule()
        speculate = self._schedules[(min(decided)[1], sampled)].speculate
        steps = self.OPENING  # as if both bursts had run
        return _Schedule(steps=steps, speculate=speculate, period=self.PERIOD, next_burst=steps + self.PERIOD)

    def _costs(self, st: _Schedule, batch_size: int, sampled: bool) -> tuple[float, float] | None:
        """Seconds per token (speculating, plain) as the verdict compares them, once both are
        measured: from plain decoding, speculation must win by enough to repay the switch
        within PERIOD steps."""
        spec = self.seconds_per_token(batch_size, True, sampled)
        plain = self.seconds_per_token(batch_size, False, sampled)
        if spec is None or plain is None:
            return None
        return self._priced(st, batch_size, sampled, spec, plain)

    def _priced(self, st: _Schedule, batch_size: int, sampled: bool, spec: float, plain: float) -> tuple[float, float]:
        """(speculating, plain) seconds per token with speculation's costs outside its steps: a
        draft's catch-up on fresh prompts, and from plain decoding the switch, repaid over PERIOD."""
        switch = 0.0 if st.speculate else self.figures.switch(self.regime(batch_size, sampled)) or 0.0
        return spec + self.catch_up_per_token(batch_size, sampled) + switch / (self.PERIOD * max(batch_size, 1)), plain

    def _decide(self, st: _Schedule, winner: bool, n: int, batch_size: int, sampled: bool) -> bool:
        """A new winner (or the first): its first period starts now."""
        st.far_behind = st.far_behind and winner == st.speculate  # a burst far behind: of the mode still losing
        st.speculate, st.period = winner, self._first_period(batch_size, sampled, winner)
        st.next_burst = n + st.period
        return winner

    def _first_period(self, batch_size: int, sampled: bool, speculating: bool) -> int:
        """PERIOD, or while plain decoding wins, the steps of it that pay for one switch to
        speculation at EXPLORE_SHARE."""
        switch = self.figures.switch(self.regime(batch_size, sampled))
        plain = self.seconds_per_token(batch_size, False, sampled)
        if speculating or not switch or not plain:
            return self.PERIOD
        return max(self.PERIOD, math.ceil(switch / (self.EXPLORE_SHARE * plain * max(batch_size, 1))))

    def renew(self, batch_size: int, sampled: bool = False) -> None:
        """Most of the batch is new requests: the losing mode is measured again within PERIOD
        (or the longer wait that a switch to speculation's cost asks for), unless it lost by
        RENEW_MARGIN or more. New requests rarely move acceptance that far (at temperature 1 it
        is mostly the model pair's), and on the demo pair at batch 8, temperature 1, where
        speculation costs about 30% more per token, the burst and the draft's catch-up that each
        new batch brought cost 3–5% of a 128-token run; the doubling waits still come round.
        How far it lost is its last burst's verdict, at the same contexts as the winner's steps
        (`lost_by`), not the decayed figures: those are of different ages, the loser's from its
        burst early in a run, the winner's from the end of the run before, whose contexts are
        longer. At batch 32, temperature 1 (Intel Xeon, scratch trace), bursts that lost by
        14–27% at the same contexts read 0.5–17% from the decayed figures when the next batch
        came, so every new batch or every other brought a burst and its draft's catch-up on 32
        prompts back (a 128-token run with one took about 4% longer than one without).

        A verdict no burst has checked since the opening (`confirmed`) rests on four steps of
        each mode, and the host's noise can turn it: at batch 8, temperature 1 on the demo pair
        (Intel Xeon, a noisy hour of `benchmarks/spec_decode.py`) the opening made plain decoding
        the verdict where speculating ran 1.2x as fast, and with the draft's catch-up spacing its
        bursts, the gate kept plain decoding through five 128-token runs. So new requests bring
        the first burst after the opening forward to now, whatever the opening measured, while
        the batch is fresh and a switch costs the draft little more than the prompts."""
        st = self._schedules.get(self.regime(batch_size, sampled))
        if st is None or not st.period:
            return
        st.renewed = st.steps
        if not st.confirmed:
            st.next_burst = min(st.next_burst, st.steps + 1)
            return
        gap = st.lost_by
        if gap is None:
            costs = self._costs(st, batch_size, sampled)
            gap = None if costs is None else self._gap(costs)
        if gap is None or gap < self.RENEW_MARGIN:
            st.period = self._first_period(batch_size, sampled, st.speculate)
            st.next_burst = min(st.next_burst, st.steps + st.period)

    def observe_switch(self, batch_size: int, seconds: float, sampled: bool = False) -> None:
        """The seconds a switch to speculation took beyond an ordinary speculative step (`Figures`)."""
        self.figures.observe_switch(self.regime(batch_size, sampled), seconds)

    def observe_catch_up(self, batch_size: int, seconds: float, num_tokens: int, sampled: bool = False) -> None:
        """A draft model's catch-up on fresh prompts while speculating (`Figures.observe_catch_up`)."""
        self.figures.observe_catch_up(self.regime(batch_size, sampled), seconds, num_tokens)

    def catch_up_per_token(self, batch_size: int, sampled: bool = False) -> float:
        return self.figures.catch_up_per_token(self.regime(batch_size, sampled))

    def observe(self, batch_size: int, speculated: bool, seconds: float, num_tokens: int, sampled: bool = False) -> None:
        """A pure-decode step's wall time and the tokens it emitted (`Figures.observe`).

        The first COLD plain steps after a speculative one are cold: kept (`Figures.recent`) only to end
        a burst far behind (`_burst_lost`), neither compared nor in the figures. Speculation's
        working set (the draft's weights and caches, the verification's wider activations) pushes
        the target's out of the caches, and plain steps run slow until it is back: at batch 32,
        temperature 1 on the demo pair (Intel Xeon, scratch timing, medians of five runs), the
        plain steps right after speculative ones took 36, 34, 29 and 21% longer than plain
        decoding's at the same contexts, 5-8% the next four, within the noise after (at batches
        1 and 8, whose caches fit, no difference). Compared so, plain decoding's four-step bursts
        measured level with speculation, which costs 15-30% more a token there, and a gate that
        had speculation won it from the opening bursts kept it for eight runs out of eight
        (speculating, a 128-token run took 1.79-1.85 s against plain decoding's 1.41-1.61 in one
        process, alternating); and plain steps right after a burst of speculation made that
        burst look cheaper than it was."""
        key = self.regime(batch_size, sampled)
        st = self._schedules.get(key)
        if st is not None and speculated != st.speculate:
            st.lost_by = None  # the losing mode measured anew: its burst's verdict sets it again
        cold = not speculated and st is not None and st.steps - st.last_spec <= self.COLD
        self.figures.observe(key, speculated, seconds, num_tokens, st.steps if st else 0, cold)

    def seconds_per_token(self, batch_size: int, speculated: bool, sampled: bool = False) -> float | None:
        return self.figures.seconds_per_token(self.regime(batch_size, sampled), speculated)
