"""Through the router, against the offline engine: greedy equality, streaming, colocated mode,
many concurrent streams."""
from __future__ import annotations


from pdserve.engine import LLM, SamplingParams
from procs import generate_all, joined
from pdserve.v1 import generation_pb2 as gen

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Héllo wörld ✓", "return n if n < 2 else",
           "lazy dog. " * 12, "x", "你好 fibonacci(n - 1) + fibonacci(n - 2)", "The"]


def greedy(max_tokens: int, **kw) -> gen.SamplingParams:
    return gen.SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def _check_equal(cluster, router, offline, params_kw: dict):
    requests = [gen.GenerateRequest(request_id=f"r{i}", prompt=p, sampling_params=greedy(**params_kw))
                for i, p in enumerate(PROMPTS)]
    got = generate_all(cluster, router, requests)
    want = offline.generate(PROMPTS, SamplingParams(temperature=0, **params_kw))
    for req, msgs, out in zip(requests, got, want):
        ids, text = joined(msgs)
        assert (ids, text) == (out.token_ids, out.text), req.prompt
        last = msgs[-1]
        assert gen.FinishReason.Name(last.finish_reason).lower() == out.finish_reason.value
        assert last.usage.prompt_tokens == len(out.prompt_token_ids)
        assert last.usage.completion_tokens == len(out.token_ids)
        assert all(m.request_id == req.request_id for m in msgs)
        assert all(m.finish_reason == gen.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    return got


def test_greedy_colocated_matches_offline(cluster, offline):
    _check_equal(cluster, "R2", offline, dict(max_tokens=24, ignore_eos=True))
    cluster.wait_all_free()


def test_eos_and_stop_strings_match_offline(cluster, offline):
    """Without ignore_eos, and with a stop string cut from the offline text, both modes agree."""
    plain = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    stop = plain.text[5:7]
    assert stop
    for router in ("R", "R2"):
        _check_equal(cluster, router, offline, dict(max_tokens=24, stop=[stop]))
        _check_equal(cluster, router, offline, dict(max_tokens=40))


def test_greedy_disaggregated_with_speculation_matches_offline(cluster, offline):
    """D speculates (see conftest: the model drafting for itself at fixed depth, so every draft is
    accepted); the output equals the offline engine's and deltas carry several tokens. D decodes
    plainly until the draft's K/V land (`KVTargetReady`), so the outputs are long enough to
    outlast that on a loaded machine."""
    before = cluster.stats("D")
    got = _check_equal(cluster, "R", offline, dict(max_tokens=48, ignore_eos=True))
    after = cluster.stats("D")
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert drafted > 0 and after.spec_num_accepted_tokens - before.spec_num_accepted_tokens == drafted
    assert max(len(m.token_ids) for msgs in got for m in msgs) > 1
    # every message says the engine steps its tokens came from; a verification step gives several
    steps = [(len(m.token_ids), m.num_steps) for msgs in got for m in msgs if m.token_ids]
    assert all(1 <= s <= n for n, s in steps) and any(n > s for n, s in steps), steps
    cluster.wait_all_free()


def test_stream_first_message_before_decoding_ends(cluster):
    stream = cluster.generation("R").Generate(
        gen.GenerateRequest(token_ids=gen.TokenIds(ids=[5, 6, 7]), sampling_params=greedy(40, ignore_eos=True)),
        timeout=60)
    msgs = list(stream)
    # the first token travels alone (in the KV trailer), ahead of every decode step's delta
    assert len(msgs[0].token_ids) == 1 and msgs[0].finish_reason == gen.FINISH_REASON_UNSPECIFIED
    assert len(msgs) >= 2  # the rest in one message or more (a stream behind its engine merges them)
    ids, _ = joined(msgs)
    assert len(ids) == 40 and msgs[-1].finish_reason == gen.LENGTH
    assert msgs[-1].usage.completion_tokens == 40 and msgs[-1].usage.prompt_tokens == 3


def test_seeded_sampling_is_reproducible_across_modes(cluster, offline, serving_model):
    """A seeded request gives the offline engine's tokens under the same speculative setup: R's
    decode worker speculates at fixed depth (see conftest), R2's does not."""
    params = dict(temperature=0.8, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    req = gen.GenerateRequest(prompt=PROMPTS[0], sampling_params=gen.SamplingParams(**params))
    (a,), (b,) = generate_all(cluster, "R", [req]), generate_all(cluster, "R2", [req])
    # the engine gets the float32 values the proto carries
    sp = SamplingParams(**{**params, "temperature": gen.SamplingParams(temperature=0.8).temperature,
                           "top_p": gen.SamplingParams(top_p=0.9).top_p})
    plain = offline.generate(PROMPTS[0], sp)[0]
    spec = LLM(str(serving_model), draft_model=str(serving_model), num_speculative_tokens=3,
               spec_adaptive=False).generate(PROMPTS[0], sp)[0]
    assert joined(b)[0] == plain.token_ids
    assert joined(a)[0] == spec.token_ids


def test_200_concurrent_streams_all_complete(cluster):
    requests = [gen.GenerateRequest(request_id=f"many-{i}", token_ids=gen.TokenIds(ids=[3 + i % 50, 7, 9 + i % 7]),
                                    sampling_params=greedy(4, ignore_eos=True)) for i in range(200)]
    got = generate_all(cluster, "R", requests)
    for req, msgs in zip(requests, got):
        ids, _ = joined(msgs)
        assert len(ids) == 4 and msgs[-1].finish_reason == gen.LENGTH, req.request_id
        assert msgs[-1].usage.completion_tokens == 4 and msgs[0].request_id == req.request_id
    cluster.wait_all_free()


def test_a_first_token_that_ends_the_request_is_the_whole_answer_from_the_prefill_worker(cluster, offline):
    """max_tokens 1, or a first token that is a stop token: the prefill worker says how the
    request ends, the router answers at once, no K/V are pushed for it and nothing counts as a
    failed transfer; both workers free everything."""
    before = {name: cluster.stats(name) for name in ("P", "D")}
    _check_equal(cluster, "R", offline, dict(max_tokens=1, ignore_eos=True))
    firsts = [out.token_ids[0] for out in offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1,
                                                                                   ignore_eos=True))]
    for prompt, first in zip(PROMPTS[:3], firsts):
        (msgs,) = generate_all(cluster, "R", [gen.GenerateRequest(request_id="stop-first", prompt=prompt,
                                                                  sampling_params=greedy(8, stop_token_ids=[first]))])
        assert joined(msgs)[0] == [first] and msgs[-1].finish_reason == gen.STOP
    after = {name: cluster.stats(name) for name in ("P", "D")}
    for name in ("P", "D"):
        assert after[name].kv_transfer_failures_total == before[name].kv_transfer_failures_total, name
    cluster.wait_all_free()
