"""A speculative step as one native call (`fused_step.FusedSpecStep`, `pdserve::spec_step`): the
same drafts, picks and K/V as the engine's own path (the draft's passes, then the verification
through `execute` and the sampler), the same tokens and acceptance in whole runs, greedy and
sampled by temperature, at fixed and adaptive depth, alone and in batches of mixed depths, under
either verifier (the rejection sampler's: `pdserve::spec_step_rejection`); steps it cannot take
(filtered sampling, penalties, log-probs) take the engine's path; malformed calls are refused with the reason. The sampler's native race for
rows sampled by temperature alone (`pdserve::race_rows`, which the fused step picks with) against
the reference sampler."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams, rng
from pdserve.engine.model_runner import BatchEntry
from pdserve.engine.sampler import Sampler, race_noise
from pdserve.engine.spec_decode.fused_step import FusedSpecStep
from pdserve.kernels import TORCH_OPS, native, sample_ref

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=t, seed=30 + i, max_tokens=24, ignore_eos=True)
           for i, t in enumerate((1.0, 0.0, 0.7, 1.3, 1.0))]  # a greedy request among them
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(3, 40)), [11, 12, 13] * 10, [7, 9], list(range(150, 60, -3))]

pytestmark = pytest.mark.skipif(not (native.load() and torch.ops.pdserve.linear_packed_available()),
                                reason="the native CPU ops with packed projections (AVX2 with FMA) are needed")


@pytest.fixture(scope="module")
def target(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def drafts(checkpoint, target):
    """A draft that agrees with the target at times (a smaller model), and the target itself."""
    return {"small": checkpoint("llama", seed=7, num_hidden_layers=1, hidden_size=32, intermediate_size=64),
            "target": target}


def _counted(llm: LLM, depths: list | None = None) -> list[int]:
    """The fused step's calls on llm, as each call's sequence count (and into `depths`, each
    call's depths)."""
    fused, calls = llm.engine.fused_step, []
    assert isinstance(fused, FusedSpecStep)

    class Counted:
        def __getattr__(self, name):  # covers, prepare, takes: the fused step's own
            return getattr(fused, name)

        def __call__(self, batch):
            calls.append(len(batch))
            if depths is not None:
                depths.append([e.num_new_tokens - 1 for e in batch])
            return fused(batch)
    llm.engine.fused_step = Counted()
    return calls


def _assert_all_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"


@pytest.mark.parametrize("draft", ["small", "target"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_fused_steps_emit_what_the_engine_path_emits(target, drafts, draft, adaptive, sampled):
    """Whole runs, one request and a batch of five (sampled: seeded, at temperatures 0.7-1.3 with a
    greedy request among them): the same tokens as plain decoding and as the same engine with the
    fused step set aside, the same drafts accepted, no block leaked."""
    options = dict(draft_model=drafts[draft], num_speculative_tokens=4, spec_adaptive=adaptive)
    fused, apart = LLM(target, **options), LLM(target, **options)
    apart.engine.fused_step = None
    calls = _counted(fused)
    plain = LLM(target)
    for prompts, params in ((PROMPTS[1:2], SAMPLED[0] if sampled else GREEDY), (PROMPTS, SAMPLED if sampled else GREEDY)):
        expected = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in fused.generate(prompts, params)] == expected
        assert [o.token_ids for o in apart.generate(prompts, params)] == expected
    mine, theirs = fused.engine.speculator.stats, apart.engine.speculator.stats
    if not adaptive:  # (an adaptive gate may keep a poor draft's steps plain, by its timings)
        assert max(calls) == len(PROMPTS)  # the fused step ran, for the batch too
    elif draft == "target":
        assert calls
    if not adaptive:  # the gate's timings differ between the engines: its choices may too
        assert (mine.num_drafts, mine.num_draft_tokens, mine.num_accepted_tokens, mine.accepted_per_pos) == \
            (theirs.num_drafts, theirs.num_draft_tokens, theirs.num_accepted_tokens, theirs.accepted_per_pos)
    if draft == "target":
        assert mine.acceptance_rate > 0.9  # the coupled verifier: the target races the noise its draft raced
    _assert_all_free(fused)


@pytest.mark.parametrize("verifier, sampled, lowest", [("coupled", False, 1), ("coupled", False, 0),
                                                      ("rejection", True, 0)],
                         ids=["depths-1-4", "depths-0-4-at-times", "rejection-sampled-depths-0-4"])
def test_mixed_depths_take_the_fused_step(target, drafts, verifier, sampled, lowest):
    """Sequences planned to different depths: the draft's passes run to the deepest, each
    sequence verifies its own depth's drafts; the same tokens and acceptance as the engine's path.
    With lowest 0, two of the five sequences plan depth 0 at every other step, as one at its
    last token does after drafting: it verifies its input token alone in the fused step (its
    draft still runs, so it stays caught up) and counts no draft. Under the rejection sampler,
    sampled (a sequence at depth 0 draws as plain sampling does)."""
    def mixed(llm: LLM) -> None:  # depths 1-4 by prompt, at most each one's room; some at 0 at times
        spec, planned = llm.engine.speculator, {}

        def plan(seqs, max_model_len, fused=False):
            for s in seqs:
                planned[s.req_id] = planned.get(s.req_id, 0) + 1
            spec._ks = {s.req_id: 0 if s.prompt_token_ids[0] in (3, 7) and planned[s.req_id] % 2 and not lowest
                        else min(1 + (len(s.prompt_token_ids) + s.prompt_token_ids[0]) % 4,
                                 s.params.max_tokens - s.num_output_tokens - 1) for s in seqs}
        spec.plan = plan

    options = dict(draft_model=drafts["small"], num_speculative_tokens=4, spec_adaptive=False, spec_verifier=verifier)
    fused, apart = LLM(target, **options), LLM(target, **options)
    apart.engine.fused_step = None
    mixed(fused)
    mixed(apart)
    depths: list[list[int]] = []
    calls = _counted(fused, depths)
    params = SAMPLED if sampled else GREEDY
    assert [o.token_ids for o in fused.generate(PROMPTS, params)] == [o.token_ids for o in apart.generate(PROMPTS, params)]
    mine, theirs = fused.engine.speculator.stats, apart.engine.speculator.stats
    assert (mine.num_draft_tokens, mine.num_accepted_tokens) == (theirs.num_draft_tokens, theirs.num_accepted_tokens)
    assert len(PROMPTS) in calls
    assert any(0 in ks for ks in depths) == (lowest == 0)
    _assert_all_free(fused)


def test_shallow_sequences_get_the_slots_the_deepest_drafts_write(target, drafts):
    """One sequence at depth 1 beside one at 4: the draft's passes write the shallow one's K/V
    three positions past its verification, across its block's end every 16 tokens. The fused
    step grows its table first (`prepare`) and the step still fuses; without that, each such
    step took the engine's path. The same tokens either way, and after every step no table holds a
    block past its tokens (none kept, none leaked)."""
    def shallow_beside_deep(llm: LLM) -> None:
        spec = llm.engine.speculator

        def plan(seqs, max_model_len, fused=False):
            spec._ks = {s.req_id: min(1 if s.prompt_token_ids[0] == 5 else 4,
                                      s.params.max_tokens - s.num_output_tokens - 1) for s in seqs}
        spec.plan = plan

    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2]]  # depth 1 (its first token is 5), depth 4
    options = dict(draft_model=drafts["target"], num_speculative_tokens=4, spec_adaptive=False)
    runs = {}
    for reserving in (True, False):
        llm = LLM(target, **options)
        shallow_beside_deep(llm)
        calls, fused = _counted(llm), llm.engine.fused_step
        if not reserving:
            fused.prepare = lambda batch, block_manager: fused.covers(batch)  # as before: the scheduler's lookahead only
        bm, tables = llm.engine.block_manager, []
        step = llm.engine.step

        def checked_step():
            outputs = step()
            tables.extend(len(s.block_table) <= bm.blocks_for(s.num_tokens) for s in llm.engine.scheduler.running)
            return outputs
        llm.engine.step = checked_step
        runs[reserving] = ([o.token_ids for o in llm.generate(prompts, params)], calls.count(2))
        assert tables and all(tables)  # no slot past the tokens kept
        _assert_all_free(llm)
    (tokens, fused_steps), (tokens_before, fused_before) = runs[True], runs[False]
    assert tokens == tokens_before == [o.token_ids for o in LLM(target).generate(prompts, params)]
    assert fused_steps > fused_before


def test_shallow_sequences_at_the_context_end_take_the_engine_path(checkpoint):
    """Near the end of a model's context (its rotary table), the draft's passes for a shallow
    sequence would write past the table: that step is not fused and no block is reserved past
    it, the requests run to the context's end with the tokens plain decoding gives, and no
    block is left over."""
    short = checkpoint("llama", max_position_embeddings=64)
    llm = LLM(short, draft_model=short, num_speculative_tokens=4, spec_adaptive=False)
    spec = llm.engine.speculator

    def plan(seqs, max_model_len, fused=False):  # depth 1 for the first prompt, 4 for the other, within each room
        spec._ks = {s.req_id: max(0, min(1 if s.prompt_token_ids[0] == 5 else 4, max_model_len - s.num_tokens - 1,
                                         s.params.max_tokens - s.num_output_tokens - 1)) for s in seqs}
    spec.plan = plan
    calls = _counted(llm)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts = [[5] + list(range(60, 110)), PROMPTS[3]]  # the shallow one reaches the end first
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(short).generate(prompts, params)]
    assert all(len(p) + len(o.token_ids) == 64 for p, o in zip(prompts, outs))  # both ran to the end
    assert 2 in calls
    _assert_all_free(llm)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.8, min_p=0.05, seed=3, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0, logprobs=2, max_tokens=16, ignore_eos=True),
], ids=["top-p", "min-p", "penalized", "logprobs"])
def test_steps_the_fused_step_cannot_take_take_the_engine_path(target, drafts, params):
    """A filtered sampled, penalized or log-prob request, alone or beside greedy ones: never a
    fused step while it runs, and the same output as with the fused step set aside."""
    options = dict(draft_model=drafts["small"], num_speculative_tokens=3, spec_adaptive=False)
    fused, apart = LLM(target, **options), LLM(target, **options)
    apart.engine.fused_step = None
    calls = _counted(fused)
    mixed = [params, GREEDY, GREEDY]
    for prompts, ps in ((PROMPTS[:1], params), (PROMPTS[:3], mixed)):
        mine, theirs = fused.generate(prompts, ps), apart.generate(prompts, ps)
        assert [o.token_ids for o in mine] == [o.token_ids for o in theirs]
        assert [o.logprobs for o in mine] == [o.logprobs for o in theirs]
    # the greedy requests of the mixed batch outlive the other (max_tokens 24 against 16): fused then
    assert calls and max(calls) <= 2
    assert fused.engine.speculator.stats.num_draft_tokens > 0
    _assert_all_free(fused)


@pytest.mark.parametrize("draft", ["small", "target"])
def test_the_rejection_samplers_steps_fuse_and_emit_what_its_engine_path_emits(target, drafts, draft):
    """Under the rejection sampler a sampled step fuses too (`pdserve::spec_step_rejection`: the
    draft's passes race the draft stream's noise and keep their logits, the rule runs natively).
    The same tokens and acceptance as the same engine with the fused step set aside (its draft's
    passes at once, then `execute`, `Sampler.probs` and `pdserve::rejection_rows`), one request and
    a batch of five with a greedy one among them; a greedy batch fuses as under the coupled
    verifier. With the target as its own draft nearly every draft is accepted (p = q to float
    rounding)."""
    options = dict(draft_model=drafts[draft], num_speculative_tokens=4, spec_adaptive=False,
                   spec_verifier="rejection")
    fused, apart = LLM(target, **options), LLM(target, **options)
    apart.engine.fused_step = None
    calls = _counted(fused)
    for prompts, params in ((PROMPTS[1:2], SAMPLED[0]), (PROMPTS, SAMPLED), (PROMPTS[:2], GREEDY)):
        assert [o.token_ids for o in fused.generate(prompts, params)] == \
            [o.token_ids for o in apart.generate(prompts, params)]
    assert max(calls) == len(PROMPTS)
    mine, theirs = fused.engine.speculator.stats, apart.engine.speculator.stats
    assert mine.num_draft_tokens > 0 and (mine.num_drafts, mine.num_draft_tokens, mine.num_accepted_tokens,
                                          mine.accepted_per_pos) == (theirs.num_drafts, theirs.num_draft_tokens,
                                                                     theirs.num_accepted_tokens, theirs.accepted_per_pos)
    if draft == "target":
        assert mine.acceptance_rate > 0.95
    _assert_all_free(fused)


def _prefilled_pair(target, draft):
    """An engine on the pair, and three sequences (next positions mid-block, at a block's start,
    early) whose prompts are in both caches but their last token, with a second-to-last token new
    to the draft (as after a verification that accepted everything), and blocks for four drafts."""
    llm = LLM(target, draft_model=draft, num_speculative_tokens=4, spec_adaptive=False, block_size=16)
    eng = llm.engine
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for i, n in enumerate((37, 17, 6)):
        ids = torch.randint(0, eng.runner.cfg.vocab_size, (n,), generator=gen).tolist()
        seq = eng.make_sequence(f"s{i}", ids, GREEDY)
        assert eng.block_manager.allocate(seq, n + 4)
        seqs.append(seq)
    with torch.inference_mode():
        for runner in (eng.runner, eng.draft_runner):
            runner.execute([BatchEntry(s, s.num_tokens - 1, 1, start=0) for s in seqs])
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
        s.num_draft_computed_tokens = s.num_tokens - 2
    return llm, seqs


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_fused_call_gives_the_engine_paths_drafts_picks_and_kv(target, drafts, sampled):
    """Three sequences at depths 4, 1 and 3 (sampled: at temperatures 1.0, 0 and 0.6), through the
    fused call and, from the same caches, through the engine's path: the draft's passes to the
    deepest, then the verification's forward and the sampler's picks with plain sampling's noise."""
    llm, seqs = _prefilled_pair(target, drafts["small"])
    eng = llm.engine
    if sampled:
        for seq, t in zip(seqs, (1.0, 0.0, 0.6)):
            seq.params = SamplingParams(temperature=t, max_tokens=24, ignore_eos=True)
    runners = (eng.runner, eng.draft_runner)
    saved = [[(k.clone(), v.clone()) for k, v in r.kv_caches] for r in runners]
    ks = [4, 1, 3]
    batch = [BatchEntry(s, k + 1, k + 1) for s, k in zip(seqs, ks)]
    assert eng.fused_step.covers(batch)
    positions = [s.num_tokens - 1 for s in seqs]
    drafts_, picks, draft_s, target_s = eng.fused_step.picks(batch)
    assert [len(d) for d in drafts_] == ks and [len(p) for p in picks] == [k + 1 for k in ks]
    assert draft_s > 0 and target_s > 0
    assert all(s.num_draft_computed_tokens == s.num_tokens + 3 for s in seqs)  # to the deepest: 4 passes
    fused_kv = [[(k.clone(), v.clone()) for k, v in r.kv_caches] for r in runners]
    for r, cache in zip(runners, saved):  # the engine's path from the same caches
        for (k, v), (k0, v0) in zip(r.kv_caches, cache):
            k.copy_(k0), v.copy_(v0)
    params, seeds = [s.params for s in seqs], [s.seed for s in seqs]
    sampling = ()
    if sampled:  # the noise of the tokens each pass picks, as the draft proposer draws it
        races = race_noise(params * 4, seeds * 4, [s.num_tokens + j for j in range(4) for s in seqs],
                           eng.runner.cfg.vocab_size, rng.SAMPLE_STREAM, torch.device("cpu"), eng.sampler.hash_fn)
        sampling = ([float(p.temperature) for p in params], races.view(4, len(seqs), -1))
    with torch.inference_mode():
        theirs = eng.draft_runner.draft_passes(seqs, [s.token_ids[-1] for s in seqs], positions, 4, *sampling,
                                               previous_ids=[s.token_ids[-2] for s in seqs])
        assert [t[:k] for t, k in zip(theirs, ks)] == drafts_
        entries = [BatchEntry(s, k + 1, k + 1, extra_token_ids=d) for s, k, d in zip(seqs, ks, drafts_)]
        logits = eng.runner.execute(entries)
    rows = [(s, s.num_tokens + j) for s, k in zip(seqs, ks) for j in range(k + 1)]
    expected = eng.sampler.sample(logits, [s.params for s, _ in rows], [s.seed for s, _ in rows], [p for _, p in rows])
    assert expected == [p for row in picks for p in row]
    if not sampled:
        assert logits.argmax(-1).tolist() == expected
    for mine, r in zip(fused_kv, runners):
        for (k1, v1), (k2, v2) in zip(mine, r.kv_caches):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    for s in seqs:
        eng.block_manager.free(s)


def test_the_fused_call_refuses_malformed_calls(target, drafts):
    llm, seqs = _prefilled_pair(target, drafts["small"])
    eng = llm.engine
    draft, fused = eng.draft_runner.passes.native, eng.fused_step
    state = torch.tensor([[*s.token_ids[-2:], s.num_tokens - 1] + s.block_table for s in seqs[:1]])

    def call(state, depths, *sampling):
        return torch.ops.pdserve.spec_step(state, depths, draft.weights, draft.caches, draft.cos, draft.sin,
                                           *draft.shape, fused.weights, *fused.target, *(sampling or (None, None)))
    with pytest.raises(RuntimeError, match="depth -1 of sequence 0 is negative"):
        call(state, torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="no sequence has a draft to verify"):
        call(state, torch.tensor([0]))
    with pytest.raises(RuntimeError, match=r"depths must be int64 \[1\]"):
        call(state, torch.tensor([2, 2]))
    with pytest.raises(RuntimeError, match="state must be int64"):
        call(state[:, :3], torch.tensor([2]))
    with pytest.raises(RuntimeError, match="outside its blocks"):  # one block: positions up to 15
        call(torch.tensor([[1, 2, 14, seqs[0].block_table[0]]]), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="weights and .* caches do not make a model"):
        torch.ops.pdserve.spec_step(state, torch.tensor([2]), draft.weights, draft.caches, draft.cos, draft.sin,
                                    *draft.shape, fused.weights[:-1], *fused.target, None, None)
    vocab = eng.runner.cfg.vocab_size
    with pytest.raises(RuntimeError, match="temperature and noise come together"):
        call(state, torch.tensor([2]), torch.ones(1), None)
    with pytest.raises(RuntimeError, match=r"noise must be float32 \[3, 1, "):  # a row for every draft and the bonus
        call(state, torch.tensor([2]), torch.ones(1), torch.ones(2, 1, vocab))

    def rejection(state, depths, noise, seeds=torch.tensor([1]), codes=rng.vocab_codes(vocab)):
        return torch.ops.pdserve.spec_step_rejection(state, depths, draft.weights, draft.caches, draft.cos, draft.sin,
                                                     *draft.shape, fused.weights, *fused.target, torch.ones(1), noise,
                                                     seeds, codes)
    noise = torch.ones(2, 1, vocab)  # the draft's passes' rows alone: the rule draws the rest
    with pytest.raises(RuntimeError, match="spec_step_rejection: depth -1 of sequence 0 is negative"):
        rejection(state, torch.tensor([-1]), noise)
    with pytest.raises(RuntimeError, match="spec_step_rejection: state must be int64"):
        rejection(state[:, :3], torch.tensor([2]), noise)
    with pytest.raises(RuntimeError, match=r"spec_step_rejection: noise must be float32 \[2, 1, "):
        rejection(state, torch.tensor([2]), torch.ones(3, 1, vocab))
    with pytest.raises(RuntimeError, match=r"seeds must be int64 \[1\]"):
        rejection(state, torch.tensor([2]), noise, seeds=torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="codes must be int32"):
        rejection(state, torch.tensor([2]), noise, codes=rng.vocab_codes(vocab + 1))
    for s in seqs:
        eng.block_manager.free(s)


def test_no_fused_step_without_a_native_draft_or_target(target, drafts):
    assert LLM(target, draft_model=drafts["small"], cpu_linear="torch").engine.fused_step is None
    assert LLM(target, speculative_method="ngram", num_speculative_tokens=3).engine.fused_step is None
    assert LLM(target).engine.fused_step is None


def test_the_native_race_picks_what_the_reference_sampler_picks():
    """Rows sampled by temperature alone (and greedy ones) race natively on the CPU
    (`pdserve::race_rows`, the fused step's pick): the reference sampler's tokens, and a row's
    token the same whatever else its batch holds (a top-p row beside it goes the reference way)."""
    sampler = Sampler(TORCH_OPS, torch.device("cpu"))
    assert sampler.races_natively
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 512, generator=gen) * 3
    temps = [0.0, 0.5, 1.0, 1.7] * 16
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate(temps)]
    positions = list(range(100, 164))
    noise = race_noise(params, [p.seed for p in params], positions, 512, rng.SAMPLE_STREAM, torch.device("cpu"))
    mine = sampler.sample(logits, params, [p.seed for p in params], positions)
    t = torch.tensor(temps)
    reference = sample_ref(logits, t, torch.zeros(64, dtype=torch.int64), torch.ones(64), torch.zeros(64), noise)
    assert mine == reference.tolist()
    assert len(set(mine[1::4])) > 10  # sampled rows, not all argmaxes
    filtered = SamplingParams(temperature=1.0, top_p=0.5, seed=99)
    mixed = sampler.sample(logits[[1, 0, 2]], [params[1], filtered, params[2]], [1, 99, 2], [101, 0, 102])
    assert [mixed[0], mixed[2]] == mine[1:3]
    with pytest.raises(RuntimeError, match="race_rows: logits and noise must be float32"):
        torch.ops.pdserve.race_rows(logits, t[:3], noise)
    # a large vocabulary's rows go to several threads (two here): the same picks
    big = torch.randn(8, 1 << 17, generator=gen) * 3
    t8, noise8 = torch.tensor(temps[:8]), torch.empty(8, 1 << 17).exponential_(generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.ops.pdserve.race_rows(big, t8, noise8).tolist() == \
            sample_ref(big, t8, torch.zeros(8, dtype=torch.int64), torch.ones(8), torch.zeros(8), noise8).tolist()
    finally:
        torch.set_num_threads(threads)
