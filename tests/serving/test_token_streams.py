"""The router's token stream on a decode worker (router/token_streams.py,
decode_worker/token_streams.py): every request's tokens of a step in one message. The whole path
in this process (`inprocess.InProcessSystem`: real servicers, engines and grpc.aio servers on
loopback, a real `Router`): the tokens are the offline engine's, a batch carries several
requests, a request's failure, cancellation or its stream's end costs that request alone (or, with
failover, nothing) and frees its blocks, and the worker's drain ends the stream."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from inprocess import PROMPTS, InProcessSystem, joined, run
from pdserve.engine import LLM, SamplingParams
from pdserve.router.request import RequestFailed
from pdserve.router.token_streams import StreamedCall
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import worker_pb2, worker_pb2_grpc

NUM_TOKENS = 16


def offline(checkpoint, prompts, **params) -> list[list[int]]:
    sp = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **{"temperature": 0, **params})
    return [o.token_ids for o in LLM(checkpoint).generate(prompts, sp)]


async def generate_all(system: InProcessSystem, prompts, **params) -> list[list[int]]:
    results = await asyncio.gather(*(system.generate(p, max_tokens=NUM_TOKENS, **params) for p in prompts))
    return [joined(msgs) for msgs in results]


@pytest.mark.parametrize("token_streams", [True, False])
def test_concurrent_requests_get_the_offline_engines_tokens(text_checkpoint, token_streams):
    greedy, sampled = offline(text_checkpoint, PROMPTS), offline(text_checkpoint, PROMPTS, temperature=1.0, seed=7)

    async def scenario():
        async with InProcessSystem(text_checkpoint, token_streams=token_streams) as system:
            got_greedy = await generate_all(system, PROMPTS)
            got_sampled = await generate_all(system, PROMPTS, temperature=1.0, seed=7)
            await system.wait_all_free()
            return got_greedy, got_sampled, system.decode.extra_stats(), len(system.decode.token_streams)

    got_greedy, got_sampled, stats, num_open = run(scenario())
    assert got_greedy == greedy and got_sampled == sampled
    total = 2 * len(PROMPTS) * NUM_TOKENS
    assert stats["stream_tokens_total"] == total
    if token_streams:  # one stream, open until the system stops; its batches carried several requests
        assert num_open == 1
        assert stats["stream_messages_total"] < total // 2, stats
    else:  # a message per output on its request's own call, or merged into its next one (a loaded host)
        assert num_open == 0 and stats["stream_messages_total"] + stats["stream_merged_outputs_total"] == total, stats


def test_the_router_reads_its_tokens_from_the_stream(text_checkpoint):
    """The attempt's call is a `StreamedCall`, which read the request's last delta."""
    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            calls, real_reserve = [], system.router.calls._reserve

            async def reserve(*args, **kwargs):
                got = await real_reserve(*args, **kwargs)
                calls.append(got[0])
                return got

            system.router.calls._reserve = reserve
            msgs = await system.generate(PROMPTS[0], max_tokens=NUM_TOKENS)
            return calls, msgs

    calls, msgs = run(scenario())
    assert len(calls) == 1 and isinstance(calls[0], StreamedCall) and calls[0].finished
    assert len(joined(msgs)) == NUM_TOKENS


def test_a_cancelled_request_frees_its_blocks_and_leaves_the_stream_serving(text_checkpoint):
    want = offline(text_checkpoint, PROMPTS[1:2])[0]

    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            req = system.router.validator.parse(gen.GenerateRequest(prompt=PROMPTS[0], sampling_params=gen.SamplingParams(
                temperature=0, ignore_eos=True, max_tokens=400)))
            gen_iter = system.router.generate(req)
            first = await anext(gen_iter)
            await gen_iter.aclose()  # the client went away
            await system.wait_all_free()
            after = await system.generate(PROMPTS[1], max_tokens=NUM_TOKENS)
            await system.wait_all_free()
            return first, after, len(system.decode.token_streams), len(system.decode.live)

    first, after, num_open, num_live = run(scenario())
    assert first.token_ids and joined(after) == want
    assert num_open == 1 and num_live == 0


def test_a_closed_stream_fails_its_requests_over_with_their_tokens(text_checkpoint):
    """The router's stream on one decode worker ends mid-request: the worker ends the request
    (its blocks freed), and the router continues it on the other worker, token-identical."""
    greedy = LLM(text_checkpoint).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=40,
                                                                       ignore_eos=True))[0].token_ids

    async def scenario():
        async with InProcessSystem(text_checkpoint, num_decode=2, max_failovers=1) as system:
            req = system.router.validator.parse(gen.GenerateRequest(prompt=PROMPTS[0], sampling_params=gen.SamplingParams(
                temperature=0, ignore_eos=True, max_tokens=40)))
            msgs = []
            async for resp in system.router.generate(req):
                if not msgs:  # close the stream the first tokens came on
                    used = [s for s in system.router.calls.token_streams.values() if s.mailboxes]
                    assert len(used) == 1
                    used[0].close()
                msgs.append(resp)
            await system.wait_all_free()
            return msgs, system.router.metrics.failovers._value.get()

    msgs, failovers = run(scenario())
    assert joined(msgs) == greedy and failovers == 1


def test_a_closed_stream_without_failover_fails_the_request_saying_why(text_checkpoint):
    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            req = system.router.validator.parse(gen.GenerateRequest(prompt=PROMPTS[0], sampling_params=gen.SamplingParams(
                temperature=0, ignore_eos=True, max_tokens=200)))
            with pytest.raises(RequestFailed) as err:
                async for _ in system.router.generate(req):
                    for s in system.router.calls.token_streams.values():
                        s.close()
            await system.wait_all_free()
            # the next request opens a new stream
            after = await system.generate(PROMPTS[1], max_tokens=4)
            return err.value, after, len(system.decode.token_streams)

    err, after, num_open = run(scenario())
    assert err.code == grpc.StatusCode.CANCELLED and "closed its token stream" in str(err), err
    assert len(joined(after)) == 4 and num_open == 1


def test_bad_token_stream_calls_are_refused_naming_the_problem(text_checkpoint):
    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            address = system.router.pool.of_role("decode")[0].address
            async with grpc.aio.insecure_channel(address) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                codes = {}
                try:
                    await stub.TokenStream(worker_pb2.TokenStreamRequest()).read()
                except grpc.aio.AioRpcError as e:
                    codes["empty id"] = (e.code(), e.details())
                stream = stub.TokenStream(worker_pb2.TokenStreamRequest(stream_id="s1"))
                await stream.initial_metadata()
                try:
                    await stub.TokenStream(worker_pb2.TokenStreamRequest(stream_id="s1")).read()
                except grpc.aio.AioRpcError as e:
                    codes["twice"] = (e.code(), e.details())
                work = worker_pb2.WorkRequest(req_id="r1", prompt_token_ids=[5, 6, 7], token_stream="nope",
                                              sampling_params=gen.SamplingParams(max_tokens=2, seed=1))
                try:
                    await stub.PrefillAndDecode(work).read()
                except grpc.aio.AioRpcError as e:
                    codes["unknown"] = (e.code(), e.details())
                stream.cancel()
            await system.wait_all_free()
            return codes

    codes = run(scenario())
    assert codes["empty id"][0] == grpc.StatusCode.INVALID_ARGUMENT and "stream_id" in codes["empty id"][1]
    assert codes["twice"][0] == grpc.StatusCode.ALREADY_EXISTS and "s1" in codes["twice"][1]
    assert codes["unknown"][0] == grpc.StatusCode.FAILED_PRECONDITION and "nope" in codes["unknown"][1]


def test_a_drained_worker_ends_its_token_streams(text_checkpoint):
    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            await system.generate(PROMPTS[0], max_tokens=4)
            stream = next(iter(system.router.calls.token_streams.values()))
            assert not stream._task.done()
            assert await system.decode.drain(5) == 0
            await asyncio.wait_for(asyncio.shield(stream._task), 5)
            return len(system.decode.token_streams)

    assert run(scenario()) == 0


def test_deltas_waiting_for_a_request_are_read_as_one_message():
    from pdserve.router.token_streams import Mailbox

    def delta(ids, steps, reason=0):
        d = worker_pb2.TokenDelta(token_ids=ids, num_steps=steps, finish_reason=reason)
        d.logprobs.extend(gen.TokenLogprobs(logprob=-float(i)) for i in ids)
        return d

    box = Mailbox()
    for item in (delta([1], 1), delta([2, 3], 1), delta([4], 1, gen.LENGTH), delta([9], 1)):
        box.put_nowait(item)
    first = box.items.popleft()
    assert box.merge_deltas(first) == 2  # up to the last delta of the request, not past it
    assert list(first.token_ids) == [1, 2, 3, 4] and first.num_steps == 3 and first.finish_reason == gen.LENGTH
    assert [lp.logprob for lp in first.logprobs] == [-1, -2, -3, -4]
    box2 = Mailbox()
    for item in (delta([1], 1), "the call ended", delta([2], 1)):
        box2.put_nowait(item)
    first = box2.items.popleft()
    assert box2.merge_deltas(first) == 0 and list(first.token_ids) == [1]  # not past another event


class _FailedCall:
    """A grpc.aio call that has already failed with `error` (what the router's StreamedCall
    watches): grpc's own object, not one of ours."""

    def __init__(self, error: grpc.aio.AioRpcError):
        self.error = error

    async def read(self):
        raise self.error

    def cancel(self) -> bool:
        return False


def _failure(sent: str | None) -> grpc.aio.AioRpcError:
    from pdserve.serving.convert import STREAM_TOKENS_METADATA

    trailing = grpc.aio.Metadata(*([(STREAM_TOKENS_METADATA, sent)] if sent is not None else []))
    return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), trailing, details="engine step failed")


@pytest.mark.parametrize("sent, read_before_failing", [("3", [1, 2, 3]), (None, []), ("x", [])])
def test_a_failure_that_overtakes_its_tokens_waits_for_those_the_stream_carried(sent, read_before_failing):
    """The call's failure comes before the stream's last deltas (two HTTP/2 streams): the
    request reads the tokens the trailing metadata says the stream carried, then fails; without
    that count (an older worker, or a malformed value) it fails at once."""
    from pdserve.router.token_streams import Mailbox, WorkerTokenStream

    async def scenario():
        box = Mailbox()
        call = StreamedCall(_FailedCall(_failure(sent)), WorkerTokenStream(None, ()), "r", box)
        await asyncio.sleep(0.05)  # the failure is in the mailbox first
        box.put_nowait(worker_pb2.TokenDelta(token_ids=[1], num_steps=1))
        asyncio.get_running_loop().call_later(0.05, box.put_nowait, worker_pb2.TokenDelta(token_ids=[2, 3], num_steps=2))
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                got += (await call.read()).tokens.token_ids
        return got, err.value

    got, err = run(scenario())
    assert got == read_before_failing and err.code() == grpc.StatusCode.INTERNAL and err.details() == "engine step failed"


def test_a_failure_whose_tokens_never_come_stands_after_the_wait(monkeypatch):
    from pdserve.router import token_streams
    from pdserve.router.token_streams import Mailbox, WorkerTokenStream

    monkeypatch.setattr(token_streams, "FINAL_DELTA_WAIT_S", 0.2)

    async def scenario():
        box = Mailbox()
        call = StreamedCall(_FailedCall(_failure("5")), WorkerTokenStream(None, ()), "r", box)
        box.put_nowait(worker_pb2.TokenDelta(token_ids=[1, 2], num_steps=1))
        first = await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        return list(first.tokens.token_ids), err.value

    first, err = run(scenario())
    assert first == [1, 2] and err.code() == grpc.StatusCode.INTERNAL
