"""`pdserve.client` against the real router R of the shared cluster: streaming equals the whole
completion, sync equals asyncio, deadlines, cancellation frees the blocks, typed errors.
Uses only R's public address and `cluster.wait_all_free()`."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient, Client, DeadlineExceededError, FinishReason, InvalidArgumentError

GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)
LONG = dict(temperature=0, max_tokens=400, ignore_eos=True)  # far longer than any deadline below


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.address("R"), timeout=60) as c:
        yield c


def test_streaming_equals_non_streaming(client, cluster):
    for prompt in ("def fibonacci(n):", [5, 6, 7, 8, 9, 10]):
        deltas = list(client.generate(prompt, **GREEDY))
        whole = client.complete(prompt, **GREEDY)
        assert "".join(d.text for d in deltas) == whole.text
        assert [t for d in deltas for t in d.token_ids] == whole.token_ids and len(whole.token_ids) == 24
        assert deltas[-1].finish_reason is whole.finish_reason is FinishReason.LENGTH
        assert deltas[-1].usage == whole.usage and whole.usage.completion_tokens == 24
        assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
    cluster.wait_all_free()


def test_async_client_equals_sync_client(client, cluster):
    prompts = ["The quick brown fox", "import os", [3] * 12]

    async def run():
        async with AsyncClient(cluster.address("R"), timeout=60) as ac:
            return await asyncio.gather(*(ac.complete(p, **GREEDY) for p in prompts))

    for prompt, got in zip(prompts, asyncio.run(run())):
        want = client.complete(prompt, **GREEDY)
        assert (got.token_ids, got.text, got.usage) == (want.token_ids, want.text, want.usage)
    cluster.wait_all_free()


def test_a_deadline_ends_the_call_with_deadline_exceeded(client, cluster):
    with pytest.raises(DeadlineExceededError) as err:
        client.complete("def f(x):", timeout=0.02, **LONG)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    async def run():
        async with AsyncClient(cluster.address("R")) as ac:
            await ac.complete("def f(x):", timeout=0.02, **LONG)

    with pytest.raises(DeadlineExceededError):
        asyncio.run(run())
    cluster.wait_all_free()


def test_closing_a_stream_cancels_the_request_and_frees_its_blocks(client, cluster):
    stream = client.generate("def f(x):", **LONG)
    first = next(stream)
    assert first.token_ids and first.finish_reason is None
    stream.close()
    assert list(stream) == []  # nothing more after closing
    cluster.wait_all_free()


def test_breaking_out_of_a_with_block_cancels_too(client, cluster):
    with client.generate([4, 5, 6], **LONG) as stream:
        for i, _ in enumerate(stream):
            if i == 2:
                break
    cluster.wait_all_free()


def test_cancelling_the_task_cancels_the_request(cluster):
    async def run():
        async with AsyncClient(cluster.address("R")) as ac:
            started = asyncio.Event()

            async def consume():
                async for _ in ac.generate("def g(y):", **LONG):
                    started.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())
    cluster.wait_all_free()


def test_bad_input_is_an_invalid_argument_error_naming_the_field(client):
    with pytest.raises(InvalidArgumentError, match="top_p") as err:
        client.complete("x", top_p=7.0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.attempts == 1
