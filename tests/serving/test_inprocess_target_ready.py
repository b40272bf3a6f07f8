"""The rest of a K/V hand-over once the decode worker decodes, in one process (`InProcessSystem`):
a speculating pair's target K/V, then `KVTargetReady`, then the draft's; what a failed draft pass
or a bad chunk after the mark costs (the request's speculation, never the request), and a prefill
call that fails while its request decodes. Over real processes: tests/disagg (test_kv_dist.py)."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from inprocess import PROMPTS, FaultyTransport, InProcessSystem, InterceptingTransport, joined, run, system_tokenizer
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv_copy import crc32c
from pdserve.router.request import RequestFailed
from pdserve.serving.kv_transfer import InProcessTransport, KVData, KVTargetReady


class RecordingTransport(InterceptingTransport):
    """The in-process transport, keeping each stream's message kinds in order (a run of one kind
    once; a data chunk's kind names its group)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.streams: list[list[str]] = []

    async def intercept(self, header, messages):
        kinds = [type(header).__name__]
        self.streams.append(kinds)

        async def recorded():
            async for m in messages:
                kind = type(m).__name__ + (str(m.group) if isinstance(m, KVData) else "")  # KVData0: the target's
                if kinds[-1] != kind:
                    kinds.append(kind)
                yield m

        return recorded()


@pytest.mark.parametrize("target_ready", [True, False])
def test_with_a_draft_its_kv_follow_the_first_token_and_a_failed_draft_pass_costs_at_most_its_speculation(
        text_checkpoint, target_ready):
    """A speculating pair (the model drafting for itself): the prefill worker's draft pass runs
    after the first token (`defer_draft_handoff`), its K/V still reach the decode worker (every
    draft accepted, the offline engine's tokens). With `target_ready` (what a decode worker with
    a draft says) the target's K/V are followed by `KVTargetReady`, before the draft's, and the
    decode worker starts on them. When the draft's pass fails, such a request is still served
    whole (without speculation; the decode side counts the transfer failed). A decode worker
    that does not say so gets the trailer alone, and there the request fails with the prefill
    worker's reason (not the decode side's "truncated"). Every block is freed, and the next
    request is served."""
    draft = dict(draft_model=str(text_checkpoint), num_speculative_tokens=3, spec_adaptive=False)
    # long enough that the draft's K/V land well before the end (the decode worker does not wait for them)
    want = LLM(text_checkpoint).generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    inproc = InProcessTransport()
    recording = RecordingTransport(inproc)

    async def scenario():
        async with InProcessSystem(text_checkpoint, engine_options=draft, inproc=inproc, transport=recording) as system:
            assert system.prefill.engine.defer_draft_handoff
            assert all(w.info.kv_target_ready for w in system.router.pool.workers.values() if w.role == "decode")
            if not target_ready:  # as a decode worker that does not take KVTargetReady says
                for w in system.router.pool.workers.values():
                    w.info.kv_target_ready = False
            got = [await system.generate(p, 64) for p in PROMPTS[:2]]
            stats = system.decode.engine.speculator.stats
            accepted = (stats.num_draft_tokens, stats.num_accepted_tokens)
            runner = system.prefill.engine.draft_runner
            real_execute, calls = runner.execute, []

            def broken_once(*args, **kwargs):
                if not calls:
                    calls.append(1)
                    raise RuntimeError("injected draft failure")
                return real_execute(*args, **kwargs)

            runner.execute = broken_once
            try:
                failed = await system.generate(PROMPTS[2], 64)
            except RequestFailed as e:
                failed = e
            await system.wait_all_free()
            return (got, accepted, failed, system.decode.kv_transfer_failures_total,
                    await system.generate(PROMPTS[3], 4))

    got, (drafted, accepted), failed, failures, after = run(scenario())
    assert [joined(m) for m in got] == [o.token_ids for o in want[:2]]
    assert drafted > 0 and accepted == drafted
    streams = recording.streams
    if target_ready:
        ordered = ["KVHeader", "KVData0", "KVTargetReady", "KVData1", "KVTrailer"]
        assert streams[0] == streams[1] == streams[3] == ordered
        assert streams[2] == ordered[:3]  # the draft's pass failed: its push ended there
        assert joined(failed) == want[2].token_ids and failures == 1
    else:
        assert [s for s in streams if s != ["KVHeader", "KVData0", "KVData1", "KVTrailer"]] == [["KVHeader", "KVData0"]]
        assert isinstance(failed, RequestFailed)
        assert "prefill on" in str(failed) and "injected draft failure" in str(failed)  # the cause, not the decode side's verdict
    assert len(joined(after)) == 4


async def corrupt_a_draft_chunk(messages):
    async for m in messages:
        if isinstance(m, KVData) and m.group == 1:
            m = dataclasses.replace(m, data=b"\xff" + m.data[1:])
        yield m


def target_chunk_after_ready(layout):
    """A well-formed target chunk (one token of zeros, its right size and checksum) after the
    mark: it would overwrite a running sequence's cache."""
    zeros = bytes(2 * layout.num_kv_heads * layout.head_dim * 4)  # float32 K and V of one token

    async def fault(messages):
        async for m in messages:
            yield m
            if isinstance(m, KVTargetReady):
                yield KVData(m.num_chunks, 0, 0, 0, 1, zeros, crc32c(zeros))
    return fault


async def ready_before_the_target_is_whole(messages):
    async for m in messages:
        if isinstance(m, KVTargetReady):
            continue  # the real mark goes: a false one came after the first chunk
        yield m
        if isinstance(m, KVData) and m.seq == 0:
            yield KVTargetReady(1, 5)


@pytest.mark.parametrize("fault, served", [(lambda _: corrupt_a_draft_chunk, True), (target_chunk_after_ready, True),
                                           (lambda _: ready_before_the_target_is_whole, False)])
def test_after_target_ready_a_bad_transfer_costs_only_speculation(text_checkpoint, fault, served):
    """Once the decode worker verified the target's K/V (`KVTargetReady`) and decodes, a bad
    draft chunk, or a target chunk after the mark (refused: it would write into a running
    sequence's cache), cost that request only its speculation: it is served whole, with the
    offline engine's tokens, and the decode side counts the transfer failed. A mark before the
    target's K/V are whole fails the transfer and the request, as any bad transfer. Every block
    is freed either way, and the next request is served."""
    draft = dict(draft_model=str(text_checkpoint), num_speculative_tokens=3, spec_adaptive=False)
    want = LLM(text_checkpoint).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))

    async def scenario():
        system = InProcessSystem(text_checkpoint, engine_options=draft)
        system.transport = FaultyTransport(system.inproc, None, len(system_tokenizer(text_checkpoint).encode(PROMPTS[0])))
        async with system:
            system.transport.fault = fault(system.decode.receiver.groups[0][0])
            try:
                got = await system.generate(PROMPTS[0], 32)
            except RequestFailed as e:
                got = e
            await system.wait_all_free()
            return got, system.decode.kv_transfer_failures_total, await system.generate(PROMPTS[1], 4)

    got, failures, after = run(scenario())
    if served:
        assert joined(got) == want[0].token_ids
    else:
        assert isinstance(got, RequestFailed) and got.code == grpc.StatusCode.DATA_LOSS and "KVTargetReady" in str(got)
    assert failures == 1 and len(joined(after)) == 4


def test_a_prefill_that_fails_once_the_decode_worker_decodes_does_not_end_the_request(text_checkpoint):
    """The prefill worker's call fails after the decode worker verified the K/V and began
    streaming tokens (as when it dies right after its push): the request is served whole all the
    same, with no failover, since the decode worker has what it needs. Failover off, so a
    request the router ended would fail."""
    from pdserve.serving.kv_transfer import TransferError, TransferFailure

    want = LLM(text_checkpoint).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))

    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            transport, decoding = system.prefill.transport, []
            real_push = transport.push

            async def push_then_fail(address, messages, timeout_s):
                await real_push(address, messages, timeout_s)
                await asyncio.sleep(0.03)  # the decode worker's first tokens reach the router meanwhile
                decoding.append(bool(system.decode.engine.scheduler.running))  # and it decodes still
                raise TransferError(TransferFailure.UNREACHABLE, "injected: the link failed after the ack")

            transport.push = push_then_fail
            got = await system.generate(PROMPTS[0], 300)
            transport.push = real_push
            await system.wait_all_free()
            return got, decoding, system.router.metrics.failovers._value.get()

    got, decoding, failovers = run(scenario())
    assert decoding == [True]  # the prefill failed while the request decoded
    assert joined(got) == want[0].token_ids and failovers == 0
