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


async def run(num_tokens: int, max_chunk_bytes: int):
    """The engine thread sends every layer, then the loop finishes; returns (messages the push
    could read before `finish`, every message in order, the sender)."""
    loop = asyncio.get_running_loop()
    sender = KVSender(loop, HEADER, max_chunk_bytes)
    engine = threading.Thread(target=lambda: [sender.send(0, layer, 0, layer_kv(num_tokens, layer))
                                              for layer in range(LAYERS)])
    engine.start()
    await asyncio.to_thread(engine.join)
    await asyncio.sleep(0.05)  # every hand-over the engine thread posted has run
    before_finish = sender._queue.qsize()
    sender.finish(7)
    return before_finish, [m async for m in sender.messages()], sender


def test_a_short_prompt_goes_in_one_batch_after_the_first_token():
    per_layer = 2 * 5 * 2 * 8 * 4  # 640 bytes a layer, well under the chunk size
    before, msgs, sender = asyncio.run(run(5, 4096))
    assert sender.num_handoffs == 0
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
    assert sender.num_handoffs == 3 * LAYERS
    assert before == 1 + 4 * LAYERS - 1
    assert msgs[-1].num_chunks == 4 * LAYERS
