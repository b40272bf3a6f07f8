"""`ClientStream`'s text is the same whether a worker's tokens come one a message or merged
(a decode worker merges a stream's backlog, `stream_interval` groups steps): with no stop
string a merged delta is decoded at once, with one token by token, and both must add up to
what one decode of every token gives, characters split over tokens included."""
from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.request import RouterRequest
from pdserve.router.stream import ClientStream
from pdserve.v1 import generation_pb2 as gen_pb2

TEXT = "naïve café — 東京 🙂🚀 déjà vu, Ünïcödé ✓ end"


def _texts(tokenizer: Tokenizer, ids: list[int], sizes: list[int], stop: list[str]) -> tuple[str, list[int]]:
    req = RouterRequest("r", "c", tokenizer.encode("prompt:"), SamplingParams(max_tokens=len(ids), stop=stop))
    stream, text, sent, i = ClientStream(req, tokenizer), [], [], 0
    while i < len(ids) and not stream.finished:
        n = sizes[len(text) % len(sizes)]
        last = i + n >= len(ids)
        msg = stream.delta(ids[i:i + n], gen_pb2.LENGTH if last else gen_pb2.FINISH_REASON_UNSPECIFIED)
        text.append(msg.text)
        sent += msg.token_ids
        i += n
    return "".join(text), sent


@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 4], [7], [100]])
def test_merged_deltas_give_the_text_of_one_token_a_message(text_checkpoint, sizes):
    tokenizer = Tokenizer.from_dir(text_checkpoint)
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some characters are split over tokens
    whole = tokenizer.decode(ids)
    assert _texts(tokenizer, ids, sizes, []) == (whole, ids)
    # with a stop string, merged deltas are cut at the token where it ended
    text, sent = _texts(tokenizer, ids, sizes, ["🚀"])
    assert text == whole[:whole.index("🚀")] and sent == _texts(tokenizer, ids, [1], ["🚀"])[1]
