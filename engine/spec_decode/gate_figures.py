"""`Figures`: what the speculation gate (`gate.py`) has measured of each mode, per regime.

A regime is a batch-size bucket and whether any request samples (`SpeculationGate.regime`). Per
regime and mode (speculating or plain), a decayed sum of a pure-decode step's wall seconds and
emitted tokens, and its latest steps (a burst and the steps around it, for the gate to compare
at the same contexts); per regime, what a switch to speculation costs and what a draft's
catch-up on fresh prompts costs. The gate decides from these; nothing here decides.
"""
from __future__ import annotations

from collections import deque

Regime = tuple[int, bool]


class Figures:
    DECAY = 0.9  # per observation, for the decayed sums of seconds and tokens
    CLIP = 3.0  # an observed step counts at most this many times its mode's seconds per token

    def __init__(self, keep: int) -> None:
        """keep: how many of a regime's latest steps `recent` holds."""
        self._keep = keep
        self._sums: dict[tuple[int, bool, bool], list] = {}  # (*regime, speculated) -> [seconds, tokens, steps]
        self._switch: dict[Regime, float] = {}  # regime -> seconds a switch to speculation costs
        self._catch_up: dict[Regime, list] = {}  # regime -> [seconds, tokens] of fresh prompts' catch-ups
        # regime -> its latest steps, (speculated, seconds, tokens, the schedule's step, cold)
        self._recent: dict[Regime, deque] = {}
        # prompt tokens per output token of the requests finished lately (`Speculator.forget`)
        self.prompt_per_output = 0.0

    def observe(self, key: Regime, speculated: bool, seconds: float, num_tokens: int, step: int, cold: bool) -> None:
        """A pure-decode step's wall time and the tokens it emitted, at the regime's schedule step
        `step`; a cold one (`SpeculationGate.observe`) joins the latest steps only. A step slower
        than CLIP times its mode's running seconds per token counts as that (a stall of the host,
        a collection pass, another process on the core): unclipped, one such step could make the
        winning mode look the loser, and with the waits doubling, for hundreds of steps; a real
        change still shows within a few steps. A mode's first step has no figure to be clipped
        by, so the second step clips it: a collection pass of 400 ms inside the first step of
        speculation's first burst (before faa571f) made speculation measure 18 ms a token against
        plain's 5 at batch 1 greedy, and the gate kept plain decoding for hundreds of steps."""
        sums = self._sums.setdefault((*key, speculated), [0.0, 0.0, 0])
        if sums[1] > 0:
            if sums[2] == 1 and not cold and sums[0] / sums[1] > self.CLIP * seconds / max(num_tokens, 1):
                sums[0] = self.CLIP * seconds / max(num_tokens, 1) * sums[1]  # the first step, clipped by the second
            seconds = min(seconds, self.CLIP * sums[0] / sums[1] * max(num_tokens, 1))
        if not cold:
            sums[0] = sums[0] * self.DECAY + seconds
            sums[1] = sums[1] * self.DECAY + num_tokens
            sums[2] += 1
        if key not in self._recent:
            self._recent[key] = deque(maxlen=self._keep)
        self._recent[key].append((speculated, seconds, num_tokens, step, cold))

    def seconds_per_token(self, key: Regime, speculated: bool) -> float | None:
        sums = self._sums.get((*key, speculated))
        return sums[0] / sums[1] if sums and sums[1] > 0 else None

    def recent(self, key: Regime) -> list:
        """The regime's latest steps, oldest first (`observe`)."""
        return list(self._recent.get(key, ()))

    def adopt(self, key: Regime, speculated: bool, steps: list) -> None:
        """Steps of one mode (newest first, as `trailing` gives them) become its figure."""
        sums = [0.0, 0.0, 0]
        for _, seconds, tokens, _, _ in steps[::-1]:  # oldest first, decayed as `observe` does
            sums = [sums[0] * self.DECAY + seconds, sums[1] * self.DECAY + tokens, sums[2] + 1]
        self._sums[(*key, speculated)] = sums

    def observe_switch(self, key: Regime, seconds: float) -> None:
        """The seconds a switch to speculation took beyond an ordinary speculative step (a draft
        model catching up on the tokens the plain steps emitted); a running mean per regime."""
        old = self._switch.get(key)
        self._switch[key] = max(seconds, 0.0) if old is None else 0.5 * (old + max(seconds, 0.0))

    def switch(self, key: Regime) -> float | None:
        return self._switch.get(key)

    def switch_anywhere(self, key: Regime) -> float:
        """The regime's switch cost, or while it has none the dearest measured in any regime."""
        return self._switch[key] if key in self._switch else max(self._switch.values(), default=0.0)

    def observe_catch_up(self, key: Regime, seconds: float, num_tokens: int) -> None:
        """A draft model's catch-up on fresh prompts while speculating: seconds beyond an
        ordinary pass, and the prompt tokens caught up on. A cost of speculating that no
        measured step shows: it runs in the first proposal after a prefill, within the steps the
        gate leaves out (`Speculator.WARMUP_STEPS`). On the demo pair (Intel Xeon, batches 8 and
        32, greedy and temperature 1, scratch trace) it was 8-9 µs a prompt token: spread over
        prompts of 64-128 tokens and 128-token outputs, 6-7 µs an output token, 2-3% of plain
        decoding's 0.25 ms a token at batch 32, where speculation and plain decoding cost within
        a few percent of each other. With prompts ten times the output it is ten times that."""
        sums = self._catch_up.setdefault(key, [0.0, 0.0])
        sums[0] = sums[0] * self.DECAY + seconds
        sums[1] = sums[1] * self.DECAY + num_tokens

    def catch_up_per_token(self, key: Regime) -> float:
        """Speculation's catch-up on fresh prompts spread over the requests' tokens: seconds per
        prompt token caught up on, times prompt tokens per output token (`prompt_per_output`,
        from the requests finished lately; a prompt partly found in the prefix cache is caught
        up on only past it, so this overstates the cost where many are). 0 until measured."""
        sums = self._catch_up.get(key)
        return sums[0] / sums[1] * self.prompt_per_output if sums and sums[1] > 0 else 0.0


def trailing(recent: list, speculated: bool, end: int, limit: int, cold: bool = False) -> tuple[list, int]:
    """The last `limit` (at most) steps of one mode's run of steps ending at recent[end - 1],
    newest first, its cold ones left out unless `cold`; and the index in `recent` where that
    run starts."""
    start = end
    while start and recent[start - 1][0] == speculated:
        start -= 1
    steps = [recent[i] for i in range(end - 1, start - 1, -1) if cold or not recent[i][4]]
    return steps[:limit], start


def per_token(steps: list) -> float:
    """Seconds per token over steps (`Figures.recent`'s)."""
    return sum(x[1] for x in steps) / max(sum(x[2] for x in steps), 1)
