"""Speculative decoding: greedy equality, losslessness in distribution, rollback, proposers (the
depth model, its costs and the gate: test_spec_adaptive.py, test_spec_costs.py,
test_spec_gate.py, and the engine obeying the gate: test_spec_gate_in_engine.py; the
verification rules by hand: test_verification_rules.py)."""
from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch
from scipy import stats

from tinymodels import hf_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.ngram import NgramIndex, NgramProposer
from pdserve.kernels import TORCH_OPS
from pdserve.engine.sampler import param_tensors

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(3, 40)), [11, 12, 13] * 10, [7], list(range(150, 60, -3))]


@pytest.fixture(scope="module")
def target(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def useless_draft(checkpoint):
    return checkpoint("llama", seed=7, num_hidden_layers=1, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def baseline(target):
    return [o.token_ids for o in LLM(target).generate(PROMPTS, GREEDY)]


def assert_all_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"


@pytest.mark.parametrize("options", [
    dict(speculative_method="ngram", num_speculative_tokens=3),
    dict(speculative_method="ngram", num_speculative_tokens=5, spec_adaptive=False),
    dict(num_speculative_tokens=4, spec_adaptive=False, draft="target"),  # a perfect draft
    dict(num_speculative_tokens=3, spec_adaptive=False, draft="useless"),  # nearly all rejected
    dict(num_speculative_tokens=3, draft="useless"),
    dict(num_speculative_tokens=3, spec_adaptive=False, draft="useless", spec_verifier="rejection"),
], ids=["ngram", "ngram-fixed-k", "draft-perfect", "draft-useless-fixed-k", "draft-useless-adaptive",
        "draft-useless-rejection"])
def test_greedy_with_speculation_equals_without(target, useless_draft, baseline, options):
    options = dict(options)  # the parametrize dict is shared by reruns: never mutate it
    draft = options.pop("draft", None)
    if draft:
        options["draft_model"] = target if draft == "target" else useless_draft
    llm = LLM(target, **options)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline
    assert_all_free(llm)
    st = llm.engine.speculator.stats
    if options.get("spec_adaptive") is False:  # adaptive depth follows measured timings: no claim
        assert st.num_drafts > 0
    if draft == "target":
        assert st.acceptance_rate == 1.0 and st.mean_accepted_length > 4.0  # k shrinks near max_tokens
    if options.get("spec_adaptive") is False and draft == "useless":
        assert st.acceptance_rate < 0.3


def test_the_rejection_samplers_draft_runs_its_passes_at_once(target, useless_draft):
    """The rejection sampler needs q, the distribution each draft token was drawn from: the
    native passes hand back the logits they picked from (`pdserve::draft_passes_logits`), and
    its draft runs them as one call, as the coupled verifier's does. The same tokens as pass by
    pass (q the sampler's distribution of the same logits, `Sampler.probs`), greedy rows among
    sampled ones; pass by pass again where a request filters (top-p)."""
    if not torch.ops.pdserve.linear_packed_available():
        pytest.skip("the native passes need the packed projections")
    options = dict(draft_model=useless_draft, num_speculative_tokens=4, spec_adaptive=False,
                   spec_verifier="rejection")
    at_once, one_by_one = LLM(target, **options), LLM(target, **options)
    one_by_one.engine.draft_runner.passes = None
    at_once.engine.fused_step = None  # greedy batches' passes too through draft_passes (the fused step: test_fused_step.py)
    runner, calls = at_once.engine.draft_runner, []
    assert runner.passes.native is not None
    original = runner.draft_passes
    runner.draft_passes = lambda *a, **k: calls.append((a[4] is not None, k.get("keep_logits"))) or original(*a, **k)
    sampled = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=3 + i)
               for i, t in enumerate((1.0, 0.0, 0.7, 1.3, 1.0))]
    for prompts, params in ((PROMPTS[:1], sampled[0]), (PROMPTS, sampled)):
        assert [o.token_ids for o in at_once.generate(prompts, params)] == \
            [o.token_ids for o in one_by_one.generate(prompts, params)]
    assert (True, True) in calls  # sampled batches ran their passes at once, keeping the logits
    mine, theirs = at_once.engine.speculator.stats, one_by_one.engine.speculator.stats
    assert mine.num_drafts > 0 and (mine.num_draft_tokens, mine.num_accepted_tokens) == (
        theirs.num_draft_tokens, theirs.num_accepted_tokens)
    calls.clear()
    filtered = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=1)
    at_once.generate(PROMPTS[:2], filtered)
    assert not calls  # top-p: q is the filtered distribution, which the passes do not make
    assert_all_free(at_once)


@pytest.mark.parametrize("path", ["native", "graphs-off", "graphs-compile"])
def test_draft_passes_run_at_once(target, useless_draft, baseline, path):
    """A batch drafting to one depth, greedy or sampling by temperature alone, runs the draft's
    passes as one call (`ModelRunner.draft_passes`): all of them, the catch-up on the last two
    tokens first, once the draft has seen all but one or two tokens (every proposal after a
    verification); those after its catch-up pass when the catch-up is longer (a fresh prompt).
    The same output as pass by pass; by default one native call (`native_forward.NativePasses`), and
    with the projections unpacked (`cpu_linear="torch"`) the model's own passes: eager, the same
    drafts as pass by pass, or compiled, one graph per kind of pass for every batch size and
    context. Pass by pass again where a request filters (top-p)."""
    graph_capture = "off" if path == "graphs-off" else "compile"
    options = dict(draft_model=useless_draft, num_speculative_tokens=4, spec_adaptive=False,
                   graph_capture=graph_capture, cpu_linear="auto" if path == "native" else "torch")
    at_once, one_by_one = LLM(target, **options), LLM(target, **options)
    one_by_one.engine.draft_runner.passes = None
    at_once.engine.fused_step = None  # greedy batches' passes too through draft_passes (the fused step: test_fused_step.py)
    runner, calls = at_once.engine.draft_runner, []
    assert (runner.passes.native is not None) == (path == "native" and torch.ops.pdserve.linear_packed_available())
    if runner.passes.native is not None:
        native_calls = []
        native_call = runner.passes.native.__call__
        runner.passes.native = lambda *a, **k: native_calls.append(a[1]) or native_call(*a, **k)
    original = runner.draft_passes
    runner.draft_passes = lambda *a, **k: calls.append((a[3], a[4] is not None, a[6] is not None)) or original(*a, **k)
    sampled = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=3 + i)
               for i, t in enumerate((1.0, 0.0, 0.7, 1.3, 1.0))]  # a greedy row among sampled ones
    for prompts, params in ((PROMPTS[:1], GREEDY), (PROMPTS, GREEDY), (PROMPTS[:1], sampled[0]), (PROMPTS, sampled)):
        assert [o.token_ids for o in at_once.generate(prompts, params)] == \
            [o.token_ids for o in one_by_one.generate(prompts, params)]
    # k = 4: after a fresh prompt's catch-up, three passes; after a verification, all four; fewer near max_tokens
    assert {n for n, _, catch_up in calls if not catch_up} <= {1, 2, 3}
    assert {n for n, _, catch_up in calls if catch_up} >= {4}
    assert {(kind, catch_up) for _, kind, catch_up in calls} == {(False, False), (True, False), (False, True),
                                                                 (True, True)}  # greedy and sampled batches
    assert_all_free(at_once)
    mine, theirs = copy.copy(at_once.engine.speculator.stats), one_by_one.engine.speculator.stats
    assert [o.token_ids for o in at_once.generate(PROMPTS, GREEDY)] == baseline
    if path == "native":
        assert 0 < len(native_calls) <= len(calls) and not runner.passes.is_broken  # a call declined: no pass
    elif path == "graphs-off":  # the same ops on the same rows: the same acceptance
        assert (mine.num_draft_tokens, mine.num_accepted_tokens) == (theirs.num_draft_tokens, theirs.num_accepted_tokens)
    else:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        assert not runner.passes.is_broken
        for kind in runner.passes.KINDS:
            assert runner.passes.calls_straight(kind), kind  # the tokens above came from graphs called straight
            code = runner.passes.compiled(kind)._torchdynamo_orig_callable.__code__
            assert len(_debug_get_cache_entry_list(code)) == 1, kind
    # a request that filters by top-p drafts pass by pass
    calls.clear()
    at_once.generate(PROMPTS[:2], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=3))
    assert not calls


def test_mixed_depths_draft_at_once_to_the_deepest(target, useless_draft):
    """Sequences planned to different depths (adaptive depth trims each) run the draft's passes
    as one call to the deepest, each keeping its own depth's tokens: the same drafts, tokens and
    acceptance as drafting pass by pass, and no block leaked."""
    def mixed(llm: LLM) -> None:  # PROMPTS' depths 4, 1, 2, 1, 1 (by prompt), at most each one's room
        spec = llm.engine.speculator

        def plan(seqs, max_model_len, fused=False):
            spec._ks = {s.req_id: min(1 + (len(s.prompt_token_ids) + s.prompt_token_ids[0]) % 4,
                                      s.params.max_tokens - s.num_output_tokens - 1) for s in seqs}
        spec.plan = plan

    options = dict(draft_model=useless_draft, num_speculative_tokens=4, spec_adaptive=False)
    at_once, one_by_one = LLM(target, **options), LLM(target, **options)
    one_by_one.engine.draft_runner.passes = None
    mixed(at_once)
    mixed(one_by_one)
    at_once.engine.fused_step = None  # the passes through draft_passes (fused: test_fused_step.py)
    runner, calls = at_once.engine.draft_runner, []
    original = runner.draft_passes
    runner.draft_passes = lambda *a, **k: calls.append((a[3], a[6] is not None)) or original(*a, **k)
    for params in (GREEDY, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=9)):
        assert [o.token_ids for o in at_once.generate(PROMPTS, params)] == \
            [o.token_ids for o in one_by_one.generate(PROMPTS, params)]
    mine, theirs = at_once.engine.speculator.stats, one_by_one.engine.speculator.stats
    assert (mine.num_draft_tokens, mine.num_accepted_tokens) == (theirs.num_draft_tokens, theirs.num_accepted_tokens)
    assert any(catch_up and n == 4 for n, catch_up in calls)  # after verifications: all to the deepest at once
    assert_all_free(at_once)


def test_sampled_draft_passes_race_the_noise_of_the_tokens_they_pick(target):
    """The target as its own draft, at temperature 1 under the coupled verifier: a draft token is
    accepted when it is the token the target draws with the same (seed, position) noise, so with
    the passes at once nearly every draft is accepted only if each pass races the noise of the
    position it picks for. The output is the target's own sampled output."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=11)
    plain = [o.token_ids for o in LLM(target).generate(PROMPTS, params)]
    llm = LLM(target, draft_model=target, num_speculative_tokens=4, spec_adaptive=False)
    llm.engine.fused_step = None  # the passes through draft_passes (fused: test_fused_step.py)
    calls = []
    original = llm.engine.draft_runner.draft_passes
    llm.engine.draft_runner.draft_passes = lambda *a, **k: calls.append((a[4] is not None, a[6] is not None)) or original(*a, **k)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == plain
    st = llm.engine.speculator.stats
    assert (True, True) in calls and st.num_draft_tokens > 50  # sampled passes, catch-ups among them
    assert st.acceptance_rate > 0.9, st.acceptance_rate  # rounding apart, the draft is the target
    assert_all_free(llm)


def test_draft_passes_at_once_decline_past_the_block_table(target):
    llm = LLM(target, draft_model=target, num_speculative_tokens=2, block_size=16)
    seq = llm.engine.make_sequence("r", list(range(3, 18)), GREEDY)
    assert llm.engine.block_manager.allocate(seq, 15)  # one block: positions 0-15
    try:
        runner = llm.engine.draft_runner
        assert runner.draft_passes([seq], [5], [15], 2) is None  # position 16 has no slot yet
        assert len(runner.draft_passes([seq], [5], [14], 2)[0]) == 2
        assert runner.draft_passes([seq], [5], [15], 2, previous_ids=[4]) is None  # a catch-up: the same
        assert len(runner.draft_passes([seq], [5], [14], 2, previous_ids=[4])[0]) == 2
    finally:
        llm.engine.block_manager.free(seq)


def test_chunked_prefill_and_preemption_with_speculation(target, useless_draft, baseline):
    llm = LLM(target, draft_model=target, num_speculative_tokens=3, max_num_batched_tokens=16, num_kv_blocks=16)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline
    assert_all_free(llm)


def test_a_cached_prefix_spares_the_draft_its_prefill_too(target, baseline):
    """A prompt whose blocks are cached holds the draft's K/V in them too (the draft shares the
    target's block tables): the draft starts after them. With the target as its own draft every
    draft is accepted, so a run where the adopted draft K/V were wrong would show it; wiping the
    draft cache between two warm runs does."""
    llm = LLM(target, draft_model=target, num_speculative_tokens=4, spec_adaptive=False)
    drafted: list[int] = []
    execute = llm.engine.draft_runner.execute

    def counting(batch, *args, **kwargs):
        drafted.append(sum(e.num_new_tokens for e in batch))
        return execute(batch, *args, **kwargs)

    llm.engine.draft_runner.execute = counting
    runs = {}
    for run in ("cold", "warm", "wiped"):
        if run == "wiped":
            for k, v in llm.engine.draft_runner.kv_caches:
                k.zero_()
                v.zero_()
        drafted.clear()
        stats = llm.engine.speculator.stats
        before = (stats.num_draft_tokens, stats.num_accepted_tokens)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == baseline
        runs[run] = (sum(drafted), (stats.num_accepted_tokens - before[1]) / (stats.num_draft_tokens - before[0]))
        assert_all_free(llm)
    cached = 16 * sum((len(p) - 1) // 16 for p in PROMPTS)  # prompt tokens in full blocks, the last token's aside
    assert cached == 64 and runs["warm"][0] == runs["cold"][0] - cached, runs
    assert runs["cold"][1] == runs["warm"][1] == 1.0
    assert runs["wiped"][1] < 1.0  # the warm runs read the draft K/V the cold run left in the cached blocks


# ---- losslessness ------------------------------------------------------------------------
VOCAB = 24
PROMPT = [3, 9, 4]


@pytest.fixture(scope="module")
def small_pair(checkpoint):
    t = checkpoint("llama", seed=11, vocab_size=VOCAB)
    d = checkpoint("llama", seed=12, vocab_size=VOCAB, num_hidden_layers=1)
    return t, d


def exact_distributions(path, params: SamplingParams, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """P(2nd token) and P(3rd token) after `prompt` from the target alone, after the sampling filters."""
    model = hf_model(path)

    def processed(ids: torch.Tensor) -> torch.Tensor:  # [n, len] -> [n, vocab] next-token probs
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
        return TORCH_OPS.filter_probs(logits, *param_tensors([params] * len(ids), logits.device)).double()

    p1 = processed(torch.tensor([prompt]))[0]
    firsts = torch.tensor([prompt + [a] for a in range(VOCAB)])
    p2_given = processed(firsts)  # [V, V]
    p2 = p1 @ p2_given
    pairs = torch.tensor([prompt + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)])
    p3_given = processed(pairs).view(VOCAB, VOCAB, VOCAB)
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    return p2, p3


def assert_matches(samples: torch.Tensor, exact: torch.Tensor, n: int) -> None:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    kept = exact > 1e-9
    assert counts[~kept].sum() == 0, "a token outside the filtered support was emitted"
    expected = exact[kept] / exact[kept].sum() * n
    big = expected >= 5  # chi-square needs expected counts >= 5: pool the rest into one cell
    obs = torch.cat([counts[kept][big], counts[kept][~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
        exp = exp / exp.sum() * obs.sum()
    # significance 1e-3: a correct sampler fails one run in a thousand
    assert stats.chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
    k = int(kept.sum())  # Bretagnolle-Huber-Carol: P(TV >= eps) <= 2^k exp(-2 n eps^2), delta = 1e-3
    eps = math.sqrt((k * math.log(2) + math.log(1e3)) / (2 * n))
    assert 0.5 * float((counts / n - exact).abs().sum()) < eps


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=5, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.7, max_tokens=3, ignore_eos=True),
], ids=["t1", "topk5", "topp0.7"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("verifier", ["coupled", "rejection"])
def test_speculation_is_lossless_in_distribution(small_pair, params, method, verifier):
    target, draft = small_pair
    options = dict(num_speculative_tokens=2, spec_adaptive=False, max_num_seqs=256, max_num_batched_tokens=4096,
                   spec_verifier=verifier)
    if method == "draft":
        options["draft_model"] = draft
    else:
        options["speculative_method"] = "ngram"
    llm = LLM(target, **options)
    rules = []  # the rejection sampler's rule: natively (`pdserve::rejection_rows`) or in torch (`verify_batch`)
    if verifier == "rejection":
        verifier_ = llm.engine.speculator.verifier
        for name in ("_verify_native", "_verify_torch"):
            rule = getattr(verifier_, name)
            setattr(verifier_, name, lambda *a, _rule=rule, _name=name: rules.append(_name) or _rule(*a))
        if llm.engine.fused_step is not None:
            step = llm.engine.fused_step._rejection_step
            llm.engine.fused_step._rejection_step = lambda *a: rules.append("fused") or step(*a)
    n = 3000
    seeded = [SamplingParams(**{**{f: getattr(params, f) for f in ("temperature", "top_k", "top_p", "max_tokens",
                                                                     "ignore_eos")}, "seed": s}) for s in range(n)]
    # every token occurs in the n-gram prompt, so each step finds a lookup to propose from
    prompt = PROMPT + list(range(VOCAB)) + PROMPT if method == "ngram" else PROMPT
    outs = llm.generate([prompt] * n, seeded)
    st = llm.engine.speculator.stats
    if verifier == "rejection":  # the native rule where the rows race natively, the torch one where they filter
        native_rule = params.filters_by_temperature_only and llm.engine.sampler.races_natively
        assert rules and set(rules) <= ({"fused", "_verify_native"} if native_rule else {"_verify_torch"})
    # the test needs both outcomes in numbers (n-gram drafts are accepted with probability p(x) only)
    assert st.num_accepted_tokens >= 20 and st.acceptance_rate < 0.95
    p2, p3 = exact_distributions(target, params, prompt)
    assert_matches(torch.tensor([o.token_ids[1] for o in outs]), p2, n)
    assert_matches(torch.tensor([o.token_ids[2] for o in outs]), p3, n)
    assert_all_free(llm)


# ---- rollback, proposers -----------------------------------------------------------------
def test_no_blocks_leak_over_many_steps_with_random_acceptance(target, useless_draft):
    llm = LLM(target, draft_model=useless_draft, num_speculative_tokens=4, spec_adaptive=False, num_kv_blocks=40)
    eng = llm.engine
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100 + 5 * i, ignore_eos=True) for i in range(12)]
    seqs = [eng.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], sp) for i, sp in enumerate(params)]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        running = eng.scheduler.running
        eng.block_manager.check_invariants(running)
        for seq in running:
            assert seq.num_draft_computed_tokens <= seq.num_computed_tokens <= seq.num_tokens
            assert len(seq.block_table) <= eng.block_manager.blocks_for(seq.num_tokens + 4)
    assert steps > 50 and any(s.num_preemptions for s in seqs)
    assert_all_free(llm)
    st = eng.speculator.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    assert st.accepted_per_pos == sorted(st.accepted_per_pos, reverse=True)


def test_seeded_requests_reproducible_with_speculation(target, useless_draft):
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=20, ignore_eos=True)
    llm = LLM(target, draft_model=useless_draft, num_speculative_tokens=3, spec_adaptive=False)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    again = llm.generate([PROMPTS[1]], params)[0].token_ids
    other = SamplingParams(temperature=0.5, seed=1, max_tokens=30, ignore_eos=True)
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [other, params, other])[1].token_ids
    assert alone == again == batch


@pytest.mark.parametrize("draft", ["target", "useless"])
def test_coupled_seeded_sampling_equals_plain_decoding(target, useless_draft, draft):
    """With the coupled verifier, a seeded sampled stream is the plain (unspeculated) stream token
    for token, at adaptive depth and in a batch: what lets a failover continue a stream on a
    worker that speculates differently, and a prefill worker's first token match."""
    params = [SamplingParams(temperature=t, top_p=0.95, seed=40 + i, max_tokens=24, ignore_eos=True)
              for i, t in enumerate((0.7, 1.0, 1.3))]
    plain = [o.token_ids for o in LLM(target).generate(PROMPTS[:3], params)]
    spec = LLM(target, draft_model=target if draft == "target" else useless_draft, num_speculative_tokens=4,
               spec_adaptive=True, spec_verifier="coupled")
    assert [o.token_ids for o in spec.generate(PROMPTS[:3], params)] == plain
    assert spec.engine.speculator.stats.num_draft_tokens > 0  # it did speculate


def test_coupled_verifier_takes_the_noise_the_draft_raced(target):
    """The draft's passes race the exponentials of the positions they draft, which the coupled
    verifier draws again: it takes the draft's rows and hashes only each sequence's last row
    (the tokens stay plain sampling's, as above)."""
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=20, ignore_eos=True) for i in range(3)]
    plain = [o.token_ids for o in LLM(target).generate(PROMPTS[:3], params)]
    llm = LLM(target, draft_model=target, num_speculative_tokens=3, spec_adaptive=False)
    spec, hashed, verifying = llm.engine.speculator, [], []
    hash_fn, verify = spec.verifier.sampler.hash_fn, spec.verify

    def counting_hash(keys, codes):
        if verifying:
            hashed.append(len(keys))
        return hash_fn(keys, codes)

    def marked_verify(seqs, proposals, rows):
        verifying.append(True)
        try:
            return verify(seqs, proposals, rows)
        finally:
            verifying.pop()

    spec.verifier.sampler.hash_fn, spec.verify = counting_hash, marked_verify
    before = spec.stats.num_drafts
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], params)] == plain
    verified_rows = spec.stats.num_draft_tokens + (spec.stats.num_drafts - before)
    assert hashed and sum(hashed) < verified_rows / 2  # most verified rows were the draft's


def test_ngram_proposes_what_followed_the_latest_match():
    ng = NgramProposer(1, 3)
    assert ng.propose_one([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]
    assert ng.propose_one([4, 5, 6], 3) == []


def test_ngram_proposes_several_periods_of_a_repeating_tail():
    ng = NgramProposer(1, 3)
    # the latest match of the tail is one period back: the copy runs on through its own output
    assert ng.propose_one([8, 1, 8], 4) == [1, 8, 1, 8]
    assert ng.propose_one([7, 1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]
    assert ng.propose_one([5, 5, 5], 4) == [5, 5, 5, 5]
    assert ng.propose_one([9, 4, 1, 2, 4, 1, 2, 4], 3) == [1, 2, 4]  # enough text after the match: as before


@pytest.mark.parametrize("ngram_min,ngram_max,vocab", [(1, 4, 3), (1, 3, 6), (2, 4, 4), (3, 3, 2)])
def test_ngram_index_proposes_what_the_scan_does(ngram_min, ngram_max, vocab):
    """A sequence grown a token, or several (an accepted draft; steps it was not proposed for),
    at a time, proposed from at every length by its index and by the readable scan: the same
    tokens. Prompts and growths past `NgramIndex.FEW` take the index's other path. Small
    vocabularies make matches of every length, and none, common."""
    gen = random.Random(ngram_min * 100 + ngram_max * 10 + vocab)
    ng = NgramProposer(ngram_min, ngram_max)
    for prompt_len in (1, 2, 7, NgramIndex.FEW + 2, 30):
        seq = Sequence("r", [gen.randrange(vocab) for _ in range(prompt_len)], SamplingParams(), seed=0)
        while seq.num_tokens < 90:
            for k in (1, 3, 6):
                assert ng.propose_indexed(seq, k) == ng.propose_one(seq.token_ids, k), (seq.token_ids, k)
            grow = gen.choice((1, 1, 1, 3, NgramIndex.FEW, NgramIndex.FEW + 1, 2 * NgramIndex.FEW + 3))
            seq.output_token_ids.extend(gen.randrange(vocab) for _ in range(grow))
    assert isinstance(seq.proposer_state, NgramIndex)


def test_ngram_index_starts_again_on_a_shorter_sequence():
    ng = NgramProposer(1, 3)
    seq = Sequence("r", [1, 2, 3, 1, 2], SamplingParams(), seed=0)
    assert ng.propose_indexed(seq, 2) == [3, 1]
    seq.prompt_token_ids = [4, 5, 4]  # not how the engine changes a sequence, but the index must not lie
    assert ng.propose_indexed(seq, 2) == ng.propose_one([4, 5, 4], 2) == [5, 4]


def test_draft_must_share_the_vocabulary(target, checkpoint):
    other = checkpoint("llama", seed=3, vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size 100 differs"):
        LLM(target, draft_model=other, num_speculative_tokens=2)

