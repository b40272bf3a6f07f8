"""Router, prefill worker and decode worker in one process, the K/V through the in-process
transport: admission, queueing, transfer verification, cancellation, one failed transfer among
good ones, a failing engine step. The same paths over real processes and gRPC are in tests/disagg."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from inprocess import PROMPTS, FaultyTransport, InProcessSystem, InterceptingTransport, joined, run, system_tokenizer
from pdserve.engine import LLM, SamplingParams
from pdserve.router.request import RequestFailed
from pdserve.serving.kv_transfer import KVData, KVTrailer
from pdserve.v1 import generation_pb2 as gen



async def corrupt(messages):
    async for m in messages:
        if isinstance(m, KVData) and m.seq == 1:
            m = dataclasses.replace(m, data=b"\xff" + m.data[1:])
        yield m


async def drop_trailer(messages):
    async for m in messages:
        if not isinstance(m, KVTrailer):
            yield m


def test_greedy_output_equals_the_offline_engine(text_checkpoint):
    want = LLM(text_checkpoint).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))

    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            got = await asyncio.gather(*(system.generate(p, 12) for p in PROMPTS))
            await system.wait_all_free()
            return got

    for msgs, out in zip(run(scenario()), want):
        assert joined(msgs) == out.token_ids
        assert "".join(m.text for m in msgs) == out.text
        assert msgs[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("fault, status, words", [(corrupt, grpc.StatusCode.DATA_LOSS, "checksum"),
                                                   (drop_trailer, grpc.StatusCode.DATA_LOSS, "truncated")])
def test_one_bad_transfer_fails_only_its_request(text_checkpoint, fault, status, words):
    """The faulty stream's request fails with the decode side's verdict; the others finish, and
    every block is free afterwards on both workers, which keep serving."""
    async def scenario():
        system = InProcessSystem(text_checkpoint)
        victim_len = len(system_tokenizer(text_checkpoint).encode(PROMPTS[0]))
        system.transport = FaultyTransport(system.inproc, fault, victim_len)
        async with system:
            results = await asyncio.gather(*(system.generate(p, 8) for p in PROMPTS), return_exceptions=True)
            await system.wait_all_free()
            after = await system.generate(PROMPTS[1], 4)
            return results, after, system.decode.kv_transfer_failures_total

    results, after, failures = run(scenario())
    assert isinstance(results[0], RequestFailed) and results[0].code == status and words in str(results[0])
    assert all(len(joined(r)) == 8 for r in results[1:])
    assert len(joined(after)) == 4 and failures == 1


def test_a_failed_transfer_fails_over_and_the_stream_continues_identically(text_checkpoint):
    """With failover on, the corrupt transfer's request is admitted again and completes with
    exactly the tokens of an undisturbed run, sampled too (seeded)."""
    prompt, params = PROMPTS[0], dict(temperature=0.9, seed=11)

    async def scenario(times: int):
        system = InProcessSystem(text_checkpoint, max_failovers=2)
        system.transport = FaultyTransport(system.inproc, corrupt, len(system_tokenizer(text_checkpoint).encode(prompt)),
                                           times)
        async with system:
            msgs = await system.generate(prompt, 10, **params)
            await system.wait_all_free()
            return msgs, system.router.metrics.failovers._value.get()

    (clean, n0), (recovered, n1) = run(scenario(0)), run(scenario(1))
    assert (n0, n1) == (0, 1)
    assert joined(recovered) == joined(clean) and len(joined(clean)) == 10
    assert "".join(m.text for m in recovered) == "".join(m.text for m in clean)



def test_cancelled_request_frees_its_blocks_on_both_workers(text_checkpoint):
    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            req = system.router.validator.parse(_request(PROMPTS[0], 200))
            stream = system.router.generate(req)
            first = await anext(stream)
            held = await system.held_blocks()
            await stream.aclose()  # the client went away
            await system.wait_all_free()
            return first, held, system.decode.kv_transfer_failures_total

    first, held, failures = run(scenario())
    assert first.token_ids and held["decode-0"] > 0
    assert failures == 0  # a cancellation is not a transfer failure


def test_full_decode_worker_queues_then_admits_or_refuses(text_checkpoint):
    """8 KV blocks of 16 tokens: two 57-token prompts fill the decode worker's reservations. With a
    queue, the later ones wait and complete once blocks free; without one, they are refused at once."""
    async def scenario(max_queued: int):
        async with InProcessSystem(text_checkpoint, num_kv_blocks=8, max_queued_requests=max_queued,
                                   queue_timeout_s=20) as system:
            prompt = list(range(3, 60))  # 57 tokens: a reservation takes 4 of the 8 blocks
            results = await asyncio.gather(*(system.generate(prompt, 40) for _ in range(4)), return_exceptions=True)
            await system.wait_all_free()
            return results

    queued = run(scenario(8))
    assert all(not isinstance(r, Exception) and len(joined(r)) == 40 for r in queued), queued
    refused = run(scenario(0))
    codes = [r.code for r in refused if isinstance(r, RequestFailed)]
    assert codes and set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert any(not isinstance(r, Exception) for r in refused)


def test_a_failing_engine_step_fails_its_requests_not_the_worker(text_checkpoint):
    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            engine = system.decode.engine
            real_step, calls = engine.step, []

            def broken_once():
                if not calls:
                    calls.append(1)
                    raise RuntimeError("injected failure")
                return real_step()

            engine.step = broken_once
            with pytest.raises(RequestFailed) as err:
                await system.generate(PROMPTS[0], 8)
            await system.wait_all_free()
            return err.value, await system.generate(PROMPTS[1], 4)

    err, after = run(scenario())
    assert err.code == grpc.StatusCode.INTERNAL and "injected failure" in str(err)
    assert len(joined(after)) == 4


def test_a_prefill_step_that_fails_after_holding_a_prompt_fails_its_push_at_once(text_checkpoint):
    """The prefill worker's step samples a prompt's first token, holds it, then fails: that
    request fails at once with the step's error, well inside the transfer timeout its push would
    otherwise have waited out, every block is freed, and the next request is served."""
    async def scenario():
        async with InProcessSystem(text_checkpoint, kv_transfer_timeout_s=60.0) as system:
            engine = system.prefill.engine
            real_hand_off, calls = engine._hand_off, []

            def hand_off_then_fail_once(seq, tok):
                out = real_hand_off(seq, tok)
                if not calls:
                    calls.append(1)
                    raise RuntimeError("injected failure after the hand-off")
                return out

            engine._hand_off = hand_off_then_fail_once
            with pytest.raises(RequestFailed) as err:
                await asyncio.wait_for(system.generate(PROMPTS[0], 8), 20)
            await system.wait_all_free()
            return err.value, await system.generate(PROMPTS[1], 4)

    err, after = run(scenario())
    assert "injected failure after the hand-off" in str(err)
    assert len(joined(after)) == 4


def _request(prompt: str, max_tokens: int):
    from pdserve.v1 import generation_pb2 as gen

    return gen.GenerateRequest(prompt=prompt, sampling_params=gen.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                                ignore_eos=True))


def test_a_burst_spreads_over_the_decode_workers(text_checkpoint):
    """Six concurrent requests land on both decode workers: the router counts what it has just
    sent, not only the stats it polled before the burst."""
    async def scenario():
        async with InProcessSystem(text_checkpoint, num_decode=2) as system:
            await asyncio.gather(*(system.generate(p, 16) for p in PROMPTS[:3] * 2))
            return [d.num_requests_total for d in system.decodes]

    assert sorted(run(scenario())) == [3, 3]


class HoldingTransport(InterceptingTransport):
    """Streams of prompts of one length held back until released."""

    def __init__(self, inner, num_tokens: int):
        super().__init__(inner)
        self.num_tokens, self.release = num_tokens, asyncio.Event()

    async def intercept(self, header, messages):
        if header.num_tokens == self.num_tokens:
            await self.release.wait()
        return messages


def test_shared_prefix_requests_go_where_the_prefix_is_cached(text_checkpoint):
    """Two prefill workers. While a blocker keeps the first busy, a prompt with a long prefix is
    prefilled on the second; later prompts sharing that prefix go to the second too, though both
    are idle and the first comes first, and its prefix cache serves most of each of them."""
    prefix = "import os\nimport sys\n" * 12
    blocker = list(range(3, 40))

    async def scenario():
        # the decode worker never prefills them itself, though it holds the prefix too
        system = InProcessSystem(text_checkpoint, num_prefill=2, local_prefill_tokens=0)
        system.transport = hold = HoldingTransport(system.inproc, len(blocker))
        async with system:
            blocked = asyncio.create_task(system.generate(blocker, 2))
            while not system.prefills[0].requests:  # the blocker is on the first prefill worker
                await asyncio.sleep(0.01)
            await system.generate(prefix + "x = 1", 2)
            hold.release.set()
            await blocked
            for i in range(4):
                await system.generate(prefix + f"y = {i}", 2)
            return [(p.num_requests_total, p.engine.scheduler.num_prefix_hit_tokens) for p in system.prefills]

    (n0, hits0), (n1, hits1) = run(scenario())
    assert (n0, n1) == (1, 5)
    assert hits1 >= 4 * 4 * 16 and hits0 == 0  # four later prompts, each several cached 16-token blocks


def test_drain_lets_requests_in_flight_finish(text_checkpoint):
    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            task = asyncio.create_task(system.generate(PROMPTS[0], 30))
            while not system.router.flights:
                await asyncio.sleep(0.01)
            await system.router.drain(30)
            with pytest.raises(RequestFailed) as err:  # refused from now on
                system.router.check_accepting()
            return await task, err.value

    msgs, refusal = run(scenario())
    assert len(joined(msgs)) == 30 and refusal.code == grpc.StatusCode.UNAVAILABLE


class GatedTransport(InterceptingTransport):
    """Holds every stream after its header until `gate` is set: the K/V are 'still in transit'."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.held = 0

    async def intercept(self, header, messages):
        self.held += 1

        async def rest():
            await self.gate.wait()
            async for m in messages:
                yield m

        return rest()


def test_the_first_token_reaches_the_client_before_the_transfer_ends(text_checkpoint):
    """The prefill worker's first token goes out while its K/V are held in transit; the stream
    then continues without repeating it, equal to the offline engine's. A first token that ends
    the request (max_tokens 1) is the whole answer, with how it ended, and no K/V are waited for."""
    prompt = PROMPTS[0]
    want = LLM(text_checkpoint).generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]

    async def scenario():
        system = InProcessSystem(text_checkpoint)
        system.transport = gated = GatedTransport(system.inproc)
        async with system:
            req = system.router.validator.parse(gen_request(prompt, 6))
            stream = system.router.generate(req)
            first = await asyncio.wait_for(anext(stream), 30)
            assert gated.held == 1 and not gated.gate.is_set()  # the transfer has not ended
            gated.gate.set()
            rest = [m async for m in stream]
            gated.gate.clear()
            single = system.router.generate(system.router.validator.parse(gen_request(prompt, 1)))
            # the whole answer while the K/V are still held: nothing waits for the decode worker
            only = await asyncio.wait_for(collect(single), 30)
            assert gated.held == 2 and not gated.gate.is_set()
            # the held push was cut after ABANDON_WAIT_S (1 s), the reservation with it, well
            # before its transfer timeout (10 s here), which until then was what freed them
            await system.wait_all_free(timeout_s=5.0)
            return first, rest, only

    first, rest, only = run(scenario())
    assert list(first.token_ids) == want.token_ids[:1] and not first.finish_reason
    assert joined([first, *rest]) == want.token_ids
    assert "".join(m.text for m in [first, *rest]) == want.text
    assert len(only) == 1 and list(only[0].token_ids) == want.token_ids[:1] and only[0].finish_reason == gen.LENGTH


def test_on_one_core_the_first_token_goes_out_before_the_kv_are_copied(text_checkpoint, monkeypatch):
    """A prefill worker on one core waits, after a step, until that step's first tokens were sent
    before it checksums and copies their K/V into the transfer's messages (the two would share the
    core). Each prompt's last hand-over finds its first token already sent; the output is the
    offline engine's."""
    from pdserve.prefill_worker import kv_sender, server

    monkeypatch.setattr(server, "FIRST_TOKEN_WAIT_S", 30.0)  # a missed signal fails below, not a slow test
    seen = []
    send_rows = kv_sender.KVSender.send_rows

    def recording(self, *args):
        seen.append(self.first_sent.is_set())
        return send_rows(self, *args)

    monkeypatch.setattr(kv_sender.KVSender, "send_rows", recording)
    want = LLM(text_checkpoint).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))

    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            system.prefill._one_core = True
            got = await asyncio.gather(*(system.generate(p, 6) for p in PROMPTS))
            await system.wait_all_free()
            return got

    for msgs, out in zip(run(scenario()), want):
        assert joined(msgs) == out.token_ids
    assert seen and all(seen)  # every prompt here is one step: each hand-over after its first token


async def collect(stream) -> list:
    return [m async for m in stream]


def gen_request(prompt: str, max_tokens: int):
    return gen.GenerateRequest(prompt=prompt, sampling_params=gen.SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=max_tokens))


def test_with_no_healthy_prefill_worker_the_decode_worker_prefills_itself(text_checkpoint):
    """The only prefill worker goes away mid-traffic: the request in its hands fails over and is
    served colocated by the decode worker, as are new ones (counted), with the offline engine's
    tokens; once a prefill worker is healthy again, requests are disaggregated again."""
    want = LLM(text_checkpoint).generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))

    async def scenario():
        async with InProcessSystem(text_checkpoint, max_failovers=1) as system:
            prefill_server = system.servers[0]
            await prefill_server.stop(grace=0.1)  # its address now refuses connections
            first = await system.generate(PROMPTS[0], 6)  # prefill refused -> marked down -> colocated
            second = await system.generate(PROMPTS[1], 6)  # colocated at once
            fallbacks = system.router.metrics.prefill_fallbacks._value.get()
            prefilled = system.prefill.num_requests_total
            await system.wait_all_free()
            (prefill,) = system.router.pool.of_role("prefill")
            prefill.healthy = True  # as a health check would find a restarted one; it is not: the
            assert not system.router.pool.prefill_down()  # pool then pairs again and stops falling back
            return first, second, fallbacks, prefilled

    first, second, fallbacks, prefilled = run(scenario())
    assert joined(first) == want[0].token_ids and joined(second) == want[1].token_ids
    assert fallbacks == 2 and prefilled == 0


def test_a_worker_whose_stats_fail_stays_in_service(text_checkpoint):
    """A decode worker that says SERVING but whose GetStats raises inside (here a counter out of
    its field's range, the kind of bug the soak found) keeps serving, and its stats count again
    once they answer. (A worker that cannot be reached is still taken out: test_worker_health.)"""
    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            pool = system.router.pool
            (w,) = pool.of_role("decode")
            system.decode.kv_transfer_bytes_total = -1  # uint64 field: GetStats now fails with UNKNOWN
            await pool.check(w)
            kept = (w.healthy, w.stats_failing)
            served = joined(await system.generate("def fibonacci(n):", 6))
            system.decode.kv_transfer_bytes_total = 0
            await pool.check(w)
            recovered = (w.healthy, w.stats_failing)
            return kept, served, recovered

    kept, served, recovered = run(scenario())
    assert kept == (True, True)
    assert len(served) == 6
    assert recovered == (True, False)


def test_a_reservation_whose_kv_never_comes_expires_and_frees_its_blocks(text_checkpoint):
    """A decode worker's reservation (the Decode call's first event, its ticket) for a push that
    never comes: the stream ends DEADLINE_EXCEEDED after kv_transfer_timeout_s, naming what it
    waited for, the expiry is counted, the blocks are freed, and the worker serves the next request."""
    from pdserve.v1 import worker_pb2 as wk
    from pdserve.v1 import worker_pb2_grpc

    async def scenario():
        async with InProcessSystem(text_checkpoint, kv_transfer_timeout_s=0.5) as system:
            async with grpc.aio.insecure_channel(system.decode.advertised_address) as channel:
                stream = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(wk.WorkRequest(
                    req_id="never-pushed", prompt_token_ids=list(range(3, 40)),
                    sampling_params=gen.SamplingParams(temperature=0, max_tokens=3)), timeout=30)
                first = await stream.read()
                held = await system.held_blocks()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stream.read()
            await system.wait_all_free()
            return first, held, err.value, system.decode.num_reservations_expired, await system.generate(PROMPTS[0], 4)

    first, held, err, expired, after = run(scenario())
    assert first.WhichOneof("event") == "admitted" and held["decode-0"] > 0
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no verified KV transfer within 0.5 s" in err.details()
    assert expired == 1
    assert sum(len(m.token_ids) for m in after) == 4
