"""The engine's disaggregation interface driven by hand, no server: a prefill engine hands each
layer's K/V to its hook and holds the prompt; a decode engine reserves, takes the K/V, activates
and decodes exactly what the offline engine does."""
from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.disagg import kv_cache_groups, read_kv, slot_ids, write_kv
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SequenceStatus

PROMPT = list(range(5, 45))  # 40 tokens: three chunks at a 16-token budget


def engines(path, **options):
    prefill = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32, max_num_batched_tokens=16, **options))
    decode = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32, **options))
    return prefill, decode


def prefill_and_ship(prefill: LLMEngine, decode: LLMEngine, req_id: str, params: SamplingParams,
                     defer: str | None = None):
    """Prefill on one engine, copying every hooked layer chunk into the other's reservation.
    Each call's record ends with whether the chunk's K/V of the last layer were in the cache.
    defer: the draft's pass waits for the step's first tokens (`defer_draft_handoff`), and runs
    at `hand_over_draft` after each step ("after_step", as a prefill worker calls it) or first
    thing in the next step ("next_step")."""
    seq = decode.reserve(req_id, PROMPT, params)
    assert seq is not None and seq.status is SequenceStatus.HELD
    src, dst = kv_cache_groups(prefill), kv_cache_groups(decode)
    calls = []

    def hook(group, layer, chunks):
        last = len(src[group][1]) - 1
        calls.append((group, layer, [(c.token_start, c.num_tokens) for c in chunks],
                      all(read_kv(src[group][1], last, c.slots).any() for c in chunks)))
        for c in chunks:
            kv = read_kv(src[group][1], layer, c.slots)
            write_kv(dst[group][1], layer, slot_ids(seq, decode.block_manager.block_size, c.token_start, c.num_tokens),
                     kv.tobytes())

    prefill.kv_hook = hook
    prefill.defer_draft_handoff = defer is not None
    held = prefill.add_prefill(req_id, PROMPT, params)
    first = None
    while first is None:
        for out in prefill.step():
            assert not out.finished
            first = out.new_token_ids[0]
        calls.append("stepped")
        if defer == "after_step":
            prefill.hand_over_draft()
    if defer == "next_step":
        assert prefill.step() == []  # nothing to schedule: only the last chunk's draft pass
    assert held.status is SequenceStatus.HELD and held.block_table  # handed off, blocks kept
    return first, [c for c in calls if c != "stepped"], calls


@pytest.mark.parametrize("with_draft,streams,defer", [
    (False, True, None), (True, True, None), (False, False, None), (True, False, None),
    (True, False, "after_step"), (True, True, "next_step")])
def test_prefilled_kv_decodes_exactly_like_the_offline_engine(checkpoint, with_draft, streams, defer):
    """streams: the hook runs inside the pass as each layer lands (`kv_hook_streams`), or for each
    layer once the pass is done. defer: the draft's pass after each step (`prefill_and_ship`)."""
    path = checkpoint("llama", seed=1)
    options = dict(draft_model=str(path), num_speculative_tokens=2, spec_adaptive=False) if with_draft else {}
    prefill, decode = engines(path, **options)
    prefill.kv_hook_streams = streams
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    first, calls, timeline = prefill_and_ship(prefill, decode, "r", params, defer)
    # each step's draft layers come after the step returned its outputs when deferred, inside it if not
    for step in [i for i, c in enumerate(timeline) if c == "stepped"]:
        chunk = [c for c in timeline[:step] if c != "stepped" and c[0] == 0][-1][2]  # the step's tokens
        draft_at = [i for i, c in enumerate(timeline) if c != "stepped" and c[0] == 1 and c[2] == chunk]
        assert not with_draft or (len(draft_at) == len(prefill.draft_runner.kv_caches)
                                  and all((i > step) == (defer is not None) for i in draft_at))
    layers = prefill.model_config.num_layers
    assert [c[2] for c in calls if c[:2] == (0, 0)] == [[(0, 16)], [(16, 16)], [(32, 8)]]  # layer by layer, per chunk
    assert [c[1] for c in calls if c[0] == 0] == list(range(layers)) * 3  # in order, each chunk
    # streamed, the first layer's call comes before the last layer's K/V exist; else after the pass
    assert [c[3] for c in calls if c[:2] == (0, 0)] == [not streams] * 3
    assert {c[0] for c in calls} == ({0, 1} if with_draft else {0}) and len(calls) >= 3 * layers

    out = decode.activate("r", first)
    tokens = list(out.new_token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    want = LLM(str(path), **options).generate([PROMPT], params)[0].token_ids
    assert tokens == want
    prefill.release("r")
    for e in (prefill, decode):
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks and not e.scheduler.held


@pytest.mark.parametrize("landed", [True, False])
def test_a_sequence_decodes_on_the_targets_kv_while_the_drafts_arrive(checkpoint, landed):
    """Activated with `draft_pending` (the target's K/V verified, the draft's still coming), a
    sequence decodes plainly, no draft pass touching it, and its blocks stay pinned even once
    it is gone; when the draft's K/V land it speculates, catching up on the tokens decoded
    meanwhile; when they do not, it never does. Its tokens are the offline engine's either way."""
    path = checkpoint("llama", seed=1)
    options = dict(draft_model=str(path), num_speculative_tokens=2, spec_adaptive=False)
    prefill, decode = engines(path, **options)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first, _, _ = prefill_and_ship(prefill, decode, "r", params)
    blocks = list(decode.scheduler.held["r"].block_table)
    tokens = list(decode.activate("r", first, draft_pending=blocks).new_token_ids)
    stats = decode.speculator.stats
    for _ in range(3):
        tokens += decode.step()[0].new_token_ids
    assert len(tokens) == 4 and stats.num_drafts == 0  # plain steps, no draft pass
    decode.draft_kv_landed("r", ok=landed)
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    assert tokens == LLM(str(path), **options).generate([PROMPT], params)[0].token_ids
    assert (stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens) if landed else \
        stats.num_drafts == 0
    prefill.release("r")
    for e in (prefill, decode):
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks

    # pinned: a sequence that ends while its draft's K/V arrive leaves its blocks allocated until they land
    first, _, _ = prefill_and_ship(prefill, decode, "s", params)
    blocks = list(decode.scheduler.held["s"].block_table)
    decode.activate("s", first, draft_pending=blocks)
    decode.step()
    decode.abort("s")
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks - len(blocks)
    decode.draft_kv_landed("s", ok=True)
    decode.draft_kv_landed("s", ok=True)  # once only
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
    prefill.release("s")


def deferring_prefill(checkpoint) -> tuple[LLMEngine, list]:
    """A prefill engine with a draft whose pass waits for `hand_over_draft`, and the record of
    its hook's calls: (group, the chunks' request ids)."""
    path = checkpoint("llama", seed=1)
    prefill = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32, draft_model=str(path),
                                     num_speculative_tokens=2, spec_adaptive=False))
    calls = []
    prefill.kv_hook = lambda group, layer, chunks: calls.append((group, [c.seq.req_id for c in chunks]))
    prefill.defer_draft_handoff = True
    return prefill, calls


def test_a_deferred_draft_pass_leaves_out_a_request_that_ended(checkpoint):
    """A prompt whose request ends between its step and the draft's pass (its blocks freed, maybe
    another's by then) gets no draft pass and no draft layers; one still held gets both."""
    prefill, calls = deferring_prefill(checkpoint)
    params = SamplingParams(max_tokens=4)
    prefill.add_prefill("gone", PROMPT, params)
    prefill.add_prefill("kept", PROMPT[:20], params)
    assert len(prefill.step()) == 2  # both prompts in one step: two first tokens
    assert {g for g, _ in calls} == {0}
    prefill.abort("gone")
    prefill.hand_over_draft()
    assert [ids for g, ids in calls if g == 1] == [["kept"]] * len(prefill.draft_runner.kv_caches)
    prefill.hand_over_draft()  # once only
    assert len([1 for g, _ in calls if g == 1]) == len(prefill.draft_runner.kv_caches)
    prefill.release("kept")
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks


def test_a_failed_steps_draft_pass_is_dropped(checkpoint):
    """After a failed step (`abort_unfinished`), its draft pass does not run at the next step,
    where its layers would reach the hook among that step's: not even for a prompt it held."""
    prefill, calls = deferring_prefill(checkpoint)
    prefill.add_prefill("held", PROMPT[:20], SamplingParams(max_tokens=4))
    assert len(prefill.step()) == 1 and prefill.draft_handoff_pending
    assert prefill.abort_unfinished() == [] and not prefill.draft_handoff_pending  # held, not aborted
    prefill.add_prefill("next", PROMPT[:12], SamplingParams(max_tokens=4))
    prefill.step()
    prefill.hand_over_draft()
    assert [ids for g, ids in calls if g == 1] == [["next"]] * len(prefill.draft_runner.kv_caches)


def test_a_prompt_held_by_a_step_that_then_failed_is_aborted_with_it(checkpoint):
    """A step that holds a prompt and then fails returns no outputs, so that prompt's first token
    never reaches its caller: `abort_unfinished` ends it with the running ones, where a held
    prompt of an earlier step (its token delivered) stays."""
    path = checkpoint("llama", seed=1)
    prefill = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32))
    params = SamplingParams(max_tokens=4)
    prefill.add_prefill("earlier", PROMPT[:12], params)
    assert len(prefill.step()) == 1
    prefill.add_prefill("held", PROMPT[:20], params)
    prefill.add_prefill("waiting", PROMPT, params)
    real_hand_off = prefill._hand_off

    def hand_off_then_fail(seq, tok):
        real_hand_off(seq, tok)
        raise RuntimeError("injected failure after the hand-off")

    prefill._hand_off = hand_off_then_fail
    with pytest.raises(RuntimeError, match="injected"):
        prefill.step()
    assert sorted(prefill.abort_unfinished()) == ["held", "waiting"]
    assert prefill.scheduler.num_seqs == 1  # "earlier", still held for its push
    prefill.release("earlier")
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks


def test_reservations_count_against_the_pool_and_abort_frees_them(checkpoint):
    path = checkpoint("llama", seed=1)
    decode = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=6, max_num_seqs=8))
    params = SamplingParams(max_tokens=4)
    a = decode.reserve("a", PROMPT, params)  # 41 tokens: 3 blocks
    b = decode.reserve("b", PROMPT, params)
    assert a is not None and b is not None and decode.block_manager.num_free_blocks == 0
    assert decode.reserve("c", PROMPT, params) is None  # whole or nothing: no block taken
    assert decode.abort("a").finished
    assert decode.block_manager.num_free_blocks == 3 and "a" not in decode.scheduler.held
    assert decode.abort("a") is None  # idempotent
    with pytest.raises(ValueError, match="already in use"):
        decode.reserve("b", PROMPT, params)


def test_max_num_seqs_counts_held_sequences(checkpoint):
    path = checkpoint("llama", seed=1)
    decode = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64, max_num_seqs=2))
    assert decode.reserve("a", PROMPT[:4], SamplingParams()) and decode.reserve("b", PROMPT[:4], SamplingParams())
    assert decode.reserve("c", PROMPT[:4], SamplingParams()) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_and_place_move_what_read_and_write_move(dtype):
    """The tensor path (`gather_kv` / `place_kv`, a device-to-device transfer's) takes and puts
    the same values as the bytes path (`read_kv` / `write_kv`)."""
    import torch

    from pdserve.engine.disagg import gather_kv, place_kv

    def cache():
        return [tuple(torch.randn(8, 4, 2, 16).to(getattr(torch, dtype)) for _ in range(2)) for _ in range(2)]

    src, by_bytes = cache(), cache()
    by_tensor = [tuple(t.clone() for t in kv) for kv in by_bytes]
    slots, dst = torch.tensor([3, 4, 5, 17, 30]), torch.tensor([9, 10, 11, 12, 2])
    for layer in range(2):
        kv = gather_kv(src, layer, slots)
        assert kv.dtype == src[layer][0].dtype and kv.shape == (2, 5, 2, 16)
        assert kv.contiguous().view(torch.uint8).numpy().tobytes() == read_kv(src, layer, slots).tobytes()
        write_kv(by_bytes, layer, dst, read_kv(src, layer, slots).tobytes())
        place_kv(by_tensor, layer, dst, kv)
    assert all(torch.equal(a, b) for pa, pb in zip(by_bytes, by_tensor) for a, b in zip(pa, pb))
    assert torch.equal(by_tensor[1][0].view(-1, 2, 16)[9], src[1][0].view(-1, 2, 16)[3])


@pytest.mark.parametrize("with_draft", [False, True])
@pytest.mark.parametrize("cap", ["reservation", "engine"])
def test_a_local_tail_is_prefilled_in_capped_chunks_beside_a_decoding_request(checkpoint, with_draft, cap):
    """A decode worker's local prefill, capped by the reservation (`chunk_tokens`, the decode
    worker's `local_prefill_chunk_tokens`) or by the engine (`prefill_chunk_tokens`, every prompt):
    the tail of a reservation that adopted cached blocks runs 8 prompt tokens a step while another
    request decodes, that request gets a token every step, and both emit what the offline engine does."""
    path = checkpoint()
    options = {"draft_model": str(path), "num_speculative_tokens": 2} if with_draft else {}
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64, **options,
                                    **({"prefill_chunk_tokens": 8} if cap == "engine" else {})))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    other_prompt = list(range(50, 60))
    # a few tokens: a draft catches up over the prompt at its first proposal, and blocks without
    # the draft's K/V are not adopted
    engine.add_request("cached", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("other", other_prompt, long := SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    while "cached" in engine._requests:
        engine.step()
    prompt = PROMPT + list(range(100, 120))  # 60 tokens: 32 cached (two whole blocks), a tail of 28
    seq = engine.reserve("turn", prompt, greedy, local_tail=32, chunk_tokens=8 if cap == "reservation" else None)
    assert seq is not None and seq.status is SequenceStatus.RUNNING and seq.num_cached_tokens == 32
    computed, tokens = [], {"other": [], "turn": []}
    while engine.has_unfinished():
        decoding = seq.num_computed_tokens < len(prompt)
        outputs = engine.step()
        for out in outputs:
            tokens[out.req_id] = out.token_ids
        if decoding:
            computed.append(seq.num_computed_tokens)
            assert "other" in {out.req_id for out in outputs if out.new_token_ids}  # never a step without its token
    assert computed[:4] == [40, 48, 56, 60]
    offline = LLM(model=str(path), num_kv_blocks=64)
    assert tokens["other"] == offline.generate([other_prompt], long)[0].token_ids
    assert tokens["turn"] == offline.generate([prompt], greedy)[0].token_ids


def test_a_local_tail_adopts_blocks_without_the_drafts_kv_and_the_draft_catches_up(checkpoint):
    """A request that ended before its draft ran (here: one token) leaves blocks holding the
    target's K/V only. A push would need the draft's too, so a reservation for one does not adopt
    them; a tail prefilled here does, and its draft catches up over them before proposing: the
    tokens are the offline engine's and the step after the prefill speculates."""
    path = checkpoint()
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64, draft_model=str(path),
                                    num_speculative_tokens=2, spec_adaptive=False))
    engine.add_request("cached", PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    prompt = PROMPT + list(range(100, 110))  # 50 tokens: 32 in two cached blocks, without the draft's K/V
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    pushed = engine.reserve("push", prompt, greedy)
    assert pushed.status is SequenceStatus.HELD and pushed.num_cached_tokens == 0  # the push would carry it all
    engine.abort("push")
    seq = engine.reserve("turn", prompt, greedy, local_tail=32)
    assert seq.status is SequenceStatus.RUNNING and seq.num_cached_tokens == 32 and seq.num_draft_computed_tokens == 0
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == LLM(model=str(path), num_kv_blocks=64).generate([prompt], greedy)[0].token_ids
    assert engine.speculator.stats.num_drafts > 0  # it speculated, its draft caught up
    again = engine.reserve("next", prompt + tokens[:-1] + [7], greedy)  # its blocks now hold the draft's K/V
    assert again.num_cached_tokens >= 48


def test_a_local_tail_aborted_between_its_chunks_frees_its_blocks(checkpoint):
    """Cancelled after its first chunk (no token yet): every block it took is free again, and the
    cached blocks it adopted stay cached for the next turn."""
    path = checkpoint()
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64))
    engine.add_request("cached", PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    engine.add_request("other", list(range(50, 60)), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    while "cached" in engine._requests:
        engine.step()
    free = engine.block_manager.num_free_blocks
    seq = engine.reserve("turn", PROMPT + list(range(100, 130)), SamplingParams(temperature=0, max_tokens=4),
                         local_tail=64, chunk_tokens=8)
    assert seq.status is SequenceStatus.RUNNING and seq.num_cached_tokens == 32
    engine.step()
    assert seq.num_computed_tokens == 40 and not seq.output_token_ids
    engine.abort("turn")
    assert engine.block_manager.num_free_blocks == free
    assert len(engine.block_manager.match_prefix(seq)) == 2  # the two adopted blocks, still cached
