"""The engine and the speculation gate: it obeys the gate's verdicts step by step, and tells
the gate what it measures (steps, switches, a draft's catch-ups). The gate's own logic, fed by
hand: test_spec_gate.py."""
from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.spec_decode.speculator import Speculator
from test_spec_decode import GREEDY, PROMPTS, assert_all_free, baseline, target, useless_draft  # noqa: F401 (fixtures)


def test_gate_leaves_out_the_step_where_the_draft_catches_up_on_plain_steps(target, useless_draft):
    """The first speculative step after plain ones pays for the draft catching up on every token
    they emitted: the gate must not count it as the cost of speculating. Later speculative
    steps count, and so do plain ones, and so do steps where a sequence that sat out the last
    speculative step (depth 0) catches up: that is part of speculating. The first
    WARMUP_STEPS decode steps after the prefill count in neither mode."""
    llm = LLM(target, draft_model=useless_draft, num_speculative_tokens=3)
    spec = llm.engine.speculator
    verdicts = iter(([False] * 5 + [True] * 6) * 100)
    settled_flags = []
    spec.gate.allow = lambda batch_size, sampled, settled=True: settled_flags.append(settled) or next(verdicts)
    calls: dict[str, int] = {}

    def plan(seqs, rooms, fused=False):  # no timings; the second request sits out every other step
        ks = []
        for seq, room in zip(seqs, rooms):
            calls[seq.req_id] = n = calls.get(seq.req_id, 0) + 1
            ks.append(0 if seq.req_id == second and n % 2 else max(0, min(3, room)))
        return ks

    spec.depth.plan = plan
    observed, real_observe = [], spec.gate.observe
    spec.gate.observe = lambda *args: observed.append(args[1]) or real_observe(*args)
    steps, real_step = [], llm.engine.step

    def step():
        before = len(observed)
        out = real_step()
        steps.append((spec._speculated, llm.engine._shape.is_decode_only, len(observed) > before,
                      settled_flags[-1]))
        return out

    llm.engine.step = step
    llm.engine.add_request("first", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    second = "second"
    llm.engine.add_request(second, list(range(50, 70)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    while llm.engine.has_unfinished():
        llm.engine.step()
    warm = [seen for s, d, seen, settled in steps if d and not settled]
    assert len(warm) == spec.WARMUP_STEPS and not any(warm)  # after the one prefill, then never again
    decode = [(i, s, seen) for i, (s, d, seen, settled) in enumerate(steps) if d and settled and i > 0]
    switching = [seen for i, s, seen in decode if s and not steps[i - 1][0]]
    speculating = [seen for i, s, seen in decode if s and steps[i - 1][0]]
    plain = [seen for i, s, seen in decode if not s]
    assert switching and not any(switching)
    assert speculating and all(speculating)
    assert plain and all(plain)
    assert spec.gate.seconds_per_token(2, True) is not None and spec.gate.seconds_per_token(2, False) is not None
    assert_all_free(llm)


def test_engine_speculates_only_on_steps_the_gate_allows(target, useless_draft, baseline):
    """The gate's own decisions are tested above from hand-fed timings; here its verdict is
    fixed (no wall-clock in a test) to check the engine obeys it, step by step."""
    llm = LLM(target, draft_model=useless_draft, num_speculative_tokens=3)
    verdicts = iter([True, False] * 1000)
    allowed = []
    llm.engine.speculator.gate.allow = lambda batch_size, sampled, settled=True: allowed.append(next(verdicts)) or allowed[-1]
    llm.engine.speculator.depth.plan = lambda seqs, rooms, fused=False: [max(0, min(3, r)) for r in rooms]  # no timings
    drafts_before = []
    orig_propose = llm.engine.speculator.propose

    def propose(seqs, ks):
        drafts_before.append(allowed[-1])
        return orig_propose(seqs, ks)

    llm.engine.speculator.propose = propose
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline
    assert drafts_before and all(drafts_before)  # proposals only on allowed steps
    assert llm.engine.speculator.stats.num_drafts > 0
    assert_all_free(llm)


def test_the_gate_hears_of_the_drafts_catch_up_on_fresh_prompts(target, useless_draft):
    """The draft's first pass over a fresh prompt (prompt and first token) reaches the gate as
    a catch-up of that many tokens, and each finished request's lengths its prompt tokens per
    output token; steady passes (one or two tokens behind) are not catch-ups."""
    llm = LLM(target, draft_model=useless_draft, num_speculative_tokens=3)
    spec = llm.engine.speculator
    # speculating from the first step (a regime with no verdict runs plain until the gate
    # measures, and a first proposal after plain steps is a switch, priced apart)
    spec.gate.allow = lambda batch_size, sampled, settled=True: True
    heard, real = [], spec.gate.observe_catch_up
    spec.gate.observe_catch_up = lambda *args: heard.append(args) or real(*args)
    llm.generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert [(b, sampled) for b, _, _, sampled in heard] == [(1, False)] and heard[0][1] > 0
    assert 38 <= heard[0][2] <= 40  # the prompt and the tokens of any plain steps before the first proposal
    assert spec.gate.prompt_per_output == pytest.approx(37 / 30)
    assert spec.gate.catch_up_per_token(1) == pytest.approx(heard[0][1] / heard[0][2] * 37 / 30)
    llm.generate([list(range(3, 13))], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert spec.gate.prompt_per_output == pytest.approx((37 * 0.9 + 10) / (30 * 0.9 + 20))
    assert_all_free(llm)


def test_a_new_regimes_first_switch_to_speculation_is_priced(target, useless_draft):
    """Where the cost model says plain decoding wins, a new regime decodes plain until the gate
    measures, so its first burst of speculation opens with a switch: the draft catches up on
    the plain steps' tokens. That switch is priced (`observe_switch`) once the burst's next step
    has measured speculation's seconds per token there, and the gate then spaces its exploring
    by it."""
    llm = LLM(target, draft_model=useless_draft, num_speculative_tokens=2)
    spec = llm.engine.speculator
    spec.gate._predict = lambda batch_size, sampled: False  # the model's verdict, not its timings
    spec.depth.plan = lambda seqs, rooms, fused=False: [max(0, min(2, r)) for r in rooms]  # every allowed step drafts
    proposed = []
    real_propose = spec.propose
    spec.propose = lambda seqs, ks: proposed.append(spec._decode_run) or real_propose(seqs, ks)
    llm.generate([list(range(3, 20))], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert proposed and min(proposed) >= Speculator.WARMUP_STEPS  # nothing drafted before the gate measured
    switch = spec.gate.figures.switch(spec.gate.regime(1, False))
    assert switch is not None and switch >= 0.0
    assert_all_free(llm)
