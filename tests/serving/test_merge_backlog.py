"""A decode worker's stream that falls behind its engine sends what waits as one delta (the
newest output carries every token of those before it), and a failure queued behind such outputs
still ends the stream after their tokens went out. The whole path in this process
(`inprocess.InProcessSystem`): blocking the event loop, as a busy serving loop does, while the
decode worker's engine thread keeps stepping makes the backlog."""
from __future__ import annotations

import time

import grpc
import pytest

from inprocess import PROMPTS, InProcessSystem, joined, run
from pdserve.decode_worker.server import DecodeRequest
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.disagg import DecodeState
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import FinishReason
from pdserve.router.request import RequestFailed
from pdserve.serving.engine_thread import EngineStepFailed
from pdserve.v1 import generation_pb2 as gen

NUM_TOKENS = 24
STALL_S = 0.3  # the loop blocked: the engine thread steps many times meanwhile


def request(system: InProcessSystem, prompt: str):
    return system.router.validator.parse(gen.GenerateRequest(prompt=prompt, sampling_params=gen.SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=NUM_TOKENS)))


async def stalled_stream(system: InProcessSystem, prompt: str) -> list:
    """The request's responses, the event loop blocked for STALL_S once the first came."""
    msgs = []
    async for resp in system.router.generate(request(system, prompt)):
        if not msgs:
            time.sleep(STALL_S)  # blocking on purpose: the loop, not the engine, falls behind
        msgs.append(resp)
    return msgs


@pytest.mark.parametrize("merge, token_streams", [(True, True), (True, False), (False, False)],
                         ids=["token-stream", "own-call", "own-call-unmerged"])
def test_a_stream_behind_its_engine_sends_the_backlog_as_one_delta(text_checkpoint, merge, token_streams):
    want = LLM(text_checkpoint).generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                                      ignore_eos=True))[0]

    async def scenario():
        # unmerged, each output is a client message only on the request's own call: a router
        # reading a token stream merges what waits for a request itself (router/token_streams.py)
        async with InProcessSystem(text_checkpoint, merge_backlog=merge, token_streams=token_streams) as system:
            msgs = await stalled_stream(system, PROMPTS[0])
            await system.wait_all_free()
            return msgs, system.decode.extra_stats()

    msgs, stats = run(scenario())
    sizes = [len(m.token_ids) for m in msgs if m.token_ids]
    assert joined(msgs) == want.token_ids
    # each message says the engine steps its tokens came from: one token a step, no speculation here
    assert [m.num_steps for m in msgs if m.token_ids] == sizes
    assert stats["stream_tokens_total"] == NUM_TOKENS  # what the worker counts (its metrics)
    if merge:  # what piled up during the stall went as one message
        assert max(sizes) > 1 and len(sizes) < NUM_TOKENS, sizes
        assert stats["stream_messages_total"] < NUM_TOKENS and stats["stream_merged_outputs_total"] > 0, stats
        assert stats["stream_messages_total"] + stats["stream_merged_outputs_total"] == NUM_TOKENS, stats
    else:  # one message per engine output: a token each, however far behind
        assert sizes == [1] * NUM_TOKENS, sizes
        assert stats["stream_messages_total"] == NUM_TOKENS and stats["stream_merged_outputs_total"] == 0, stats


@pytest.mark.parametrize("token_streams", [True, False], ids=["token-stream", "own-call"])
def test_a_failure_behind_merged_outputs_ends_the_stream_after_their_tokens(text_checkpoint, token_streams):
    want = LLM(text_checkpoint).generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                                      ignore_eos=True))[0]

    async def scenario():
        async with InProcessSystem(text_checkpoint, token_streams=token_streams) as system:
            engine = system.decode.engine
            real_step = engine.step

            def fails_while_the_loop_is_blocked():
                outputs = real_step()
                if any(not o.finished and len(o.token_ids) >= 8 for o in outputs):  # 7 or more tokens queued
                    raise RuntimeError("injected failure")
                return outputs

            msgs = []
            with pytest.raises(RequestFailed) as err:
                async for resp in system.router.generate(request(system, PROMPTS[0])):
                    if not msgs:
                        engine.step = fails_while_the_loop_is_blocked
                        time.sleep(STALL_S)
                    msgs.append(resp)
            engine.step = real_step
            await system.wait_all_free()
            return msgs, err.value

    msgs, err = run(scenario())
    assert err.code == grpc.StatusCode.INTERNAL and "injected failure" in str(err)
    got = joined(msgs)
    # the outputs before the failure went out, merged, before it: a prefix of the greedy tokens
    assert len(got) >= 7 and got == want.token_ids[:len(got)], got
    assert max(len(m.token_ids) for m in msgs) > 1


def _out(n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [1], list(range(n)), "", finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None)


def test_an_own_call_keeps_one_waiting_output_and_a_failure_after_it():
    """The decode worker's sink for a request on its own call, merging: however many outputs the
    engine gives while the call writes, one waits (the newest, in the first one's place), and a
    failure that came after them is taken after it. Unmerged, every output waits its turn."""
    def drain(r: DecodeRequest) -> list:
        taken = []
        while not r.events.empty():
            taken.append(r.take(r.events.get_nowait()))
        return taken

    merged = DecodeRequest("r", DecodeState.RUNNING)
    failure = EngineStepFailed("boom")
    for item in (_out(1), _out(2), _out(3), failure):
        merged.deliver(item)
    assert merged.events.qsize() == 2 and merged.num_merged == 2
    out, fail = drain(merged)
    assert out.token_ids == [0, 1, 2] and fail is failure and merged.waiting is None
    merged.deliver(_out(4))  # once taken, the next output waits again
    assert [o.token_ids for o in drain(merged)] == [[0, 1, 2, 3]]
    plain = DecodeRequest("r", DecodeState.RUNNING, merge=False)
    for item in (_out(1), _out(2), _out(3, finished=True)):
        plain.deliver(item)
    assert [len(o.token_ids) for o in drain(plain)] == [1, 2, 3] and plain.num_merged == 0
