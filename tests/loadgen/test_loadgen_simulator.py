"""The simulator against answers known in closed form: an M/D/1 queue's mean wait, and small
deterministic cases whose timelines are worked out by hand in the comments."""
from __future__ import annotations

import statistics

import pytest

from pdserve.loadgen.costs import CostProfile, SpeculationCost, StepCost, TransferCost, WorkerLimits, chunk_attention
from pdserve.loadgen.simulator import Shape, SimInput, simulate

FREE = StepCost(0.0)


def profile(prefill=FREE, decode=FREE, transfer=None, limits=None, spec=None, overhead=0.0) -> CostProfile:
    return CostProfile("test", "none", prefill, decode, transfer or TransferCost(0, 1.0), limits or WorkerLimits(),
                       spec, overhead)


def times(rec) -> list[tuple[float, int]]:
    return [(round(t, 9), n) for t, n in zip(rec.delta_times_s, rec.delta_tokens)]


def test_md1_mean_wait_matches_the_formula():
    """One prefill worker serving one prompt per step in S seconds, Poisson arrivals at λ:
    M/D/1, mean wait in queue λ·S² / (2(1 − ρ)), ρ = λS."""
    from pdserve.loadgen.arrivals import ArrivalProcess

    service, rate, n = 0.01, 70.0, 40_000
    p = profile(prefill=StepCost(service), limits=WorkerLimits(max_num_batched_tokens=16, max_num_seqs=10**6))
    arrivals = ArrivalProcess(rate).times(n, seed=5)
    result = simulate(p, Shape(1, 1), [SimInput(t, 16, 1) for t in arrivals])
    waits = [r.prefill_start_s - r.arrival_s for r in result.requests]
    rho = rate * service
    expected = rate * service**2 / (2 * (1 - rho))
    assert statistics.fmean(waits) == pytest.approx(expected, rel=0.08)
    ttfts = [r.ttft_s for r in result.records]  # no transfer or decode cost: TTFT = wait + service
    assert statistics.fmean(ttfts) == pytest.approx(expected + service, rel=0.05)


def test_one_request_end_to_end_by_hand():
    # prefill 10 tokens: 0.1 + 0.01·10 = 0.2 s, the first token out then; transfer 0.05 s -> KV at
    # 0.25; decode steps 0.02 + 0.01·1 = 0.03 s -> tokens at 0.28 and 0.31
    p = profile(prefill=StepCost(0.1, per_token_s=0.01), decode=StepCost(0.02, per_seq_s=0.01),
                transfer=TransferCost(0, 1.0, latency_s=0.05))
    (rec,) = simulate(p, Shape(1, 1), [SimInput(0.0, 10, 3)]).records
    assert times(rec) == [(0.2, 1), (0.28, 1), (0.31, 1)]
    assert rec.ttft_s == pytest.approx(0.2) and rec.e2e_s == pytest.approx(0.31) and rec.tpot_s == pytest.approx(0.055)


def test_a_prefill_worker_hands_its_prompts_over_one_at_a_time():
    # A prefilled alone in [0, .1), B in [.1, .2) (it came as A's step had started); each
    # hand-over takes .15 s, and B's waits for A's: KV at .25 and .4, second tokens then (decode free)
    p = profile(prefill=StepCost(0.1), transfer=TransferCost(0, 1.0, latency_s=0.15))
    a, b = simulate(p, Shape(1, 1), [SimInput(0.0, 4, 2), SimInput(0.0, 4, 2)]).records
    assert times(a) == [(0.1, 1), (0.25, 1)] and times(b) == [(0.2, 1), (0.4, 1)]
    # two prefill workers prefill and hand over side by side
    a, b = simulate(p, Shape(2, 1), [SimInput(0.0, 4, 2), SimInput(0.0, 4, 2)]).records
    assert times(a) == [(0.1, 1), (0.25, 1)] and times(b) == [(0.1, 1), (0.25, 1)]


def test_a_prefill_worker_samples_before_the_draft_pass_by_hand():
    # With a draft: the target's pass 0.1 s, with the draft's 0.14 (its pass runs after the first
    # tokens, `LLMEngine.defer_draft_handoff`, and the target's K/V go meanwhile). A's first token
    # at .1, its hand-over (.15) from then: KV at .25; B's step [.14, .28), its token at .24, its
    # hand-over after A's: KV at .40. Decode free, every draft rejected: one token a step.
    spec = SpeculationCost(1, 0.0, 0.0, step=FREE, prefill=StepCost(0.14))
    p = profile(prefill=StepCost(0.1), transfer=TransferCost(0, 1.0, latency_s=0.15), spec=spec)
    a, b = simulate(p, Shape(1, 1, speculate=True), [SimInput(0.0, 4, 2), SimInput(0.0, 4, 2)]).records
    assert times(a) == [(0.1, 1), (0.25, 1)] and times(b) == [(0.24, 1), (0.4, 1)]
    # colocated, the draft catches up in the worker's first speculative step: counted in its prefill
    (c,) = simulate(p, Shape(0, 1, speculate=True), [SimInput(0.0, 4, 1)]).records
    assert times(c) == [(0.14, 1)]


def test_a_request_decodes_plainly_until_its_drafts_kv_land_by_hand():
    # The target's pass 0.1 s, with the draft's 0.14; transfers free: A's first token and its
    # target's K/V at .1, its draft's K/V at .14. Decode steps 0.02 s, every draft accepted at
    # k = 1: the steps begun at .1 and .12 decode plainly (tokens at .12, .14), the one begun at
    # .14 speculates (two at .16).
    spec = SpeculationCost(1, 0.999999, 0.0, step=StepCost(0.02), prefill=StepCost(0.14))
    p = profile(prefill=StepCost(0.1), decode=StepCost(0.02), spec=spec)
    (a,) = simulate(p, Shape(1, 1, speculate=True), [SimInput(0.0, 4, 5)]).records
    assert times(a) == [(0.1, 1), (0.12, 1), (0.14, 1), (0.16, 2)]


def test_chunked_prefill_under_a_token_budget_by_hand():
    # budget 8, prompts of 10; step costs 0.1 + 0.01/token.
    # [0, .18): A 8 tokens (B arrives at .05, waits);  [.18, .36): A 2 + B 6 -> A done;  [.36, .50): B 4 -> B done
    # decode free, transfer free: A's tokens at .36, B's at .50 (two each: the second in a zero-cost step)
    p = profile(prefill=StepCost(0.1, per_token_s=0.01), limits=WorkerLimits(max_num_batched_tokens=8))
    result = simulate(p, Shape(1, 1), [SimInput(0.0, 10, 2), SimInput(0.05, 10, 2)])
    a, b = result.requests
    assert (a.prefill_start_s, a.prefill_end_s) == (0.0, pytest.approx(0.36))
    assert (b.prefill_start_s, b.prefill_end_s) == (pytest.approx(0.18), pytest.approx(0.50))
    assert times(result.records[0]) == [(0.36, 1), (0.36, 1)]
    assert times(result.records[1]) == [(0.5, 1), (0.5, 1)]


def test_attention_cost_counts_query_key_pairs():
    assert chunk_attention(0, 4) == 10  # 1 + 2 + 3 + 4
    assert chunk_attention(6, 2) == 2 * 6 + 3
    # one decode step at context 10 + 1 generated: attention 11
    p = profile(decode=StepCost(0.0, per_context_token_s=0.001))
    (rec,) = simulate(p, Shape(1, 1), [SimInput(0.0, 10, 2)]).records
    assert times(rec) == [(0.0, 1), (0.011, 1)]


def test_a_kv_arriving_mid_step_joins_at_the_next_boundary():
    # A: KV at 0 (free prefill), decode steps 0.1 s: A tokens at 0, .1, .2, .3
    # B arrives at .15 with free prefill/transfer: its first token goes out at once, its KV waits
    # for the boundary at .2, then it shares the steps ending .3 and .4
    p = profile(decode=StepCost(0.1))
    result = simulate(p, Shape(1, 1), [SimInput(0.0, 4, 4), SimInput(0.15, 4, 3)])
    assert times(result.records[0]) == [(0.0, 1), (0.1, 1), (0.2, 1), (0.3, 1)]
    assert times(result.records[1]) == [(0.15, 1), (0.3, 1), (0.4, 1)]


def test_colocated_step_pays_decode_plus_prefill_marginal():
    # A (prompt 4, 3 tokens) arrives at 0: prefill alone 0.1 + 0.01·4 = .14 -> first token at .14.
    # B (prompt 4) arrives at .05: waits for the step boundary at .14, then shares a step with
    # A's decode: 0.05 (decode) + 0.01·4 (prefill marginal, no second fixed cost) = .09 -> .23,
    # where A gets its 2nd token and B its 1st; then both decode: .28 (A done), .33 (B 2nd)
    p = profile(prefill=StepCost(0.1, per_token_s=0.01), decode=StepCost(0.05))
    result = simulate(p, Shape(0, 1), [SimInput(0.0, 4, 3), SimInput(0.05, 4, 2)])
    assert times(result.records[0]) == [(0.14, 1), (0.23, 1), (0.28, 1)]
    assert times(result.records[1]) == [(0.23, 1), (0.28, 1)]


def test_speculation_with_no_acceptance_costs_more_per_token():
    # derived step: decode 0.02 · (verify 1.5 + k 2 · ratio 0.25) = 0.04 s, one token per step
    spec = SpeculationCost(2, acceptance_rate=0.0, draft_cost_ratio=0.25, verify_cost_ratio=1.5)
    p = profile(decode=StepCost(0.02), spec=spec)
    (rec,) = simulate(p, Shape(1, 1, speculate=True), [SimInput(0.0, 5, 3)]).records
    assert times(rec) == [(0.0, 1), (0.04, 1), (0.08, 1)]


def test_speculation_emits_the_expected_tokens_per_step():
    spec = SpeculationCost(4, acceptance_rate=0.6, draft_cost_ratio=0.1, step=StepCost(0.01))
    p = profile(decode=StepCost(0.01), spec=spec)
    result = simulate(p, Shape(1, 1, speculate=True), [SimInput(0.0, 5, 4000)], seed=3)
    (rec,) = result.records
    per_step = rec.delta_tokens[1:-1]  # the first is the prefill's token; the last may be cut short
    assert max(per_step) == 5 and min(per_step) == 1
    assert statistics.fmean(per_step) == pytest.approx(spec.mean_tokens_per_step, rel=0.05)


def test_kv_capacity_makes_requests_wait_and_oversized_ones_fail():
    # capacity 20 tokens: A (10 + 5) runs; B (10 + 5) waits until A is done; C (30) never fits
    p = profile(decode=StepCost(0.1), limits=WorkerLimits(kv_capacity_tokens=20))
    result = simulate(p, Shape(1, 1), [SimInput(0.0, 10, 5), SimInput(0.0, 10, 5), SimInput(0.0, 25, 5)])
    a, b, c = result.records
    assert a.e2e_s == pytest.approx(0.4) and b.ttft_s == pytest.approx(0.4) and b.e2e_s == pytest.approx(0.8)
    assert c.status == "RESOURCE_EXHAUSTED" and not c.is_ok


def test_a_request_ended_by_its_first_token_frees_its_reservation_at_once():
    # capacity 12 tokens: A (10 + 1) is done when the prefill worker samples its token at .1, and
    # its decode reservation goes then, not when its KV would have arrived (transfer 1 s): B is
    # admitted at .1 and prefilled by .2
    p = profile(prefill=StepCost(0.1), transfer=TransferCost(0, 1.0, latency_s=1.0),
                limits=WorkerLimits(kv_capacity_tokens=12))
    a, b = simulate(p, Shape(1, 1), [SimInput(0.0, 10, 1), SimInput(0.0, 10, 1)]).records
    assert times(a) == [(0.1, 1)] and times(b) == [(0.2, 1)]


def test_request_overhead_delays_everything():
    p = profile(overhead=0.03)
    (rec,) = simulate(p, Shape(0, 1), [SimInput(1.0, 5, 1)]).records
    assert rec.ttft_s == pytest.approx(0.03)


def test_the_same_seed_gives_the_same_simulation():
    spec = SpeculationCost(3, 0.7, 0.2)
    p = profile(prefill=StepCost(0.01, per_token_s=1e-4), decode=StepCost(0.01, per_seq_s=1e-3), spec=spec)
    inputs = [SimInput(0.02 * i, 20 + i, 30) for i in range(30)]
    a = simulate(p, Shape(1, 2, True), inputs, seed=1).records
    b = simulate(p, Shape(1, 2, True), inputs, seed=1).records
    assert [r.to_json() for r in a] == [r.to_json() for r in b]
