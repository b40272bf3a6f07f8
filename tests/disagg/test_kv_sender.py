"""`KVSender` between a real engine-side thread and a real asyncio loop: what the push sees, and
how often the engine thread wakes the loop to hand K/V over."""
from __future__ import annotations

import asyncio
import threading

import numpy as np

from pdserve.prefill_worker.kv_sender import KVSender
from pdserve.serving.kv_transfer import KVData, KVHeader, KVTrailer

HEADER = KVHeader("ticket", 10, "float32", ())
LAYERS = 4


def layer_kv(num_tokens: int, layer: int) -> np.ndarray:  # [2, num_tokens, num_kv_heads=2, head_dim=8]
    return np.full((2, num_tokens, 2, 8), layer, dtype=np.float32)


async def on_engine_thread(fn) -> None:
    engine = threading.Thread(target=fn)
    engine.start()
    await asyncio.to_thread(engine.join)
    await asyncio.sleep(0.05)  # every hand-over the engine thread posted has run


async def run(num_tokens: int, max_chunk_bytes: int):
    """The engine thread sends every layer, then ends the prompt, and the loop finishes; returns
    (messages the push could read before the prompt's end, every message in order, the sender)."""
    loop = asyncio.get_running_loop()
    sender = KVSender(loop, HEADER, max_chunk_bytes)
    await on_engine_thread(lambda: [sender.send(0, layer, 0, layer_kv(num_tokens, layer)) for layer in range(LAYERS)])
    before_end = sender._queue.qsize()
    await on_engine_thread(sender.end_of_prompt)
    sender.finish(7)
    return before_end, [m async for m in sender.messages()], sender


def test_a_short_prompt_goes_in_one_batch_after_the_first_token():
    per_layer = 2 * 5 * 2 * 8 * 4  # 640 bytes a layer, well under the chunk size
    before, msgs, sender = asyncio.run(run(5, 4096))
    assert sender.num_handoffs == 1  # the prompt's end
    assert before == 1  # the header only: nothing woke the loop during the forward
    assert isinstance(msgs[0], KVHeader) and isinstance(msgs[-1], KVTrailer)
    data = msgs[1:-1]
    assert [d.seq for d in data] == list(range(LAYERS)) and [d.layer for d in data] == list(range(LAYERS))
    assert all(len(d.data) == per_layer and np.frombuffer(d.data, np.float32)[0] == d.layer for d in data)
    assert msgs[-1].num_chunks == LAYERS and msgs[-1].first_token_id == 7
    assert sender.num_bytes == LAYERS * per_layer


def test_a_long_prompt_streams_layer_by_layer():
    # 128 bytes a token; chunks of 4,096 bytes are 32 tokens: a 100-token layer is 32+32+32+4
    before, msgs, sender = asyncio.run(run(100, 4096))
    data = [m for m in msgs if isinstance(m, KVData)]
    assert [d.seq for d in data] == list(range(4 * LAYERS))
    assert [(d.layer, d.token_start, d.num_tokens) for d in data[:4]] == [(0, 0, 32), (0, 32, 32), (0, 64, 32),
                                                                          (0, 96, 4)]
    # every full chunk is handed over as it is made (a 4-token tail rides with the next one);
    # only the last layer's tail waits for the first token
    assert sender.num_handoffs == 3 * LAYERS + 1
    assert before == 1 + 4 * LAYERS - 1
    assert msgs[-1].num_chunks == 4 * LAYERS


def test_the_trailer_waits_for_both_the_last_k_v_and_the_first_token():
    """Whichever comes first (the engine thread's end of the prompt or the loop's first token),
    the trailer is last and counts every chunk."""
    async def go(token_first: bool):
        sender = KVSender(asyncio.get_running_loop(), HEADER, 1 << 20)
        await on_engine_thread(lambda: sender.send(0, 0, 0, layer_kv(5, 0)))
        if token_first:
            sender.finish(7, [(7, -0.5)])
            assert sender._queue.qsize() == 1  # nothing ends before the engine thread is done
        await on_engine_thread(lambda: (sender.send(0, 1, 0, layer_kv(5, 1)), sender.end_of_prompt()))
        if not token_first:
            assert sender._queue.qsize() == 3  # header and both layers; no trailer without the token
            sender.finish(7, [(7, -0.5)])
        return [m async for m in sender.messages()]

    for token_first in (True, False):
        msgs = asyncio.run(go(token_first))
        assert [type(m) for m in msgs] == [KVHeader, KVData, KVData, KVTrailer]
        assert msgs[-1].num_chunks == 2 and msgs[-1].first_token_id == 7 and msgs[-1].first_token_logprobs == ((7, -0.5),)


def test_a_failed_stream_ends_at_once_and_ignores_what_comes_later():
    async def go():
        sender = KVSender(asyncio.get_running_loop(), HEADER, 1 << 20)
        sender.fail("engine step failed")
        await on_engine_thread(lambda: (sender.send(0, 0, 0, layer_kv(5, 0)), sender.end_of_prompt()))
        sender.finish(7)
        return [m async for m in sender.messages()], sender._queue.qsize()

    msgs, left = asyncio.run(go())
    assert [type(m) for m in msgs] == [KVHeader] and left == 0


def test_an_abandoned_stream_ends_with_a_trailer_that_says_so():
    """The request ended: the stream ends at once with an abandoned trailer (its chunk count one
    past what was sent, so a decode worker that predates the flag fails the transfer rather than
    activating it), and the first token that comes later adds nothing."""
    async def go():
        sender = KVSender(asyncio.get_running_loop(), HEADER, 1 << 20)
        await on_engine_thread(lambda: (sender.send(0, 0, 0, layer_kv(5, 0)), sender._hand_over()))
        sender.abandon()
        await on_engine_thread(sender.end_of_prompt)
        sender.finish(7)
        return [m async for m in sender.messages()], sender._queue.qsize(), sender.abandoned

    msgs, left, abandoned = asyncio.run(go())
    assert [type(m) for m in msgs] == [KVHeader, KVData, KVTrailer] and left == 0 and abandoned
    assert msgs[-1].abandoned and msgs[-1].num_chunks == 2
