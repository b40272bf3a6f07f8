"""A decode worker that holds all but a short tail of a prompt prefills the tail itself: its
reservation answers `prefills_here` with no ticket, the router asks no prefill worker, nothing is
pushed, and the tokens are the offline engine's. Real processes: the shared prefill worker P, a
decode worker of its own with the default `local_prefill_tokens` lowered to a test-sized 40 and
`local_prefill_chunk_tokens` to 8 (and a draft, as the shared D: adopting blocks for a push needs
their draft K/V too), and a router over the pair."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve.engine import SamplingParams
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import worker_pb2 as wk
from procs import MAX_NUM_SEQS, MAX_PROMPT_CHARS, NUM_KV_BLOCKS, greedy_tokens, wait_ready

TAIL = 40  # this decode worker's local_prefill_tokens
CHUNK = 8  # its local_prefill_chunk_tokens
NAMES = ("P", "D-local")


@pytest.fixture(scope="module")
def local(cluster, serving_model):
    worker = ["--num-threads", "1", "--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", str(NUM_KV_BLOCKS),
              "--kv-transfer-timeout", "20", "--metrics-port", "0"]
    wait_ready(cluster.start("D-local", "decode-worker", *worker, "--draft-model", str(serving_model),
                             "--num-speculative-tokens", "3", "--no-spec-adaptive", "--local-prefill-tokens", str(TAIL),
                             "--local-prefill-chunk-tokens", str(CHUNK)))
    wait_ready(cluster.start_router("R-local", "--prefill", cluster.address("P"), "--decode", cluster.address("D-local"),
                                    "--max-prompt-chars", str(MAX_PROMPT_CHARS), "--health-interval", "0.5",
                                    "--metrics-port", "0"))
    yield cluster
    for name in ("R-local", "D-local"):
        cluster.procs.pop(name).stop()


def offline_tokens(offline, prompt: list[int], max_tokens: int) -> list[int]:
    return offline.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def _counts(cluster) -> dict[str, float]:
    """What each turn moves: requests the prefill worker took, K/V bytes the decode worker
    received, the decode worker's prefix hits, and the router's local prefills."""
    d, metrics = cluster.stats("D-local"), cluster.metrics("R-local")
    return {"prefilled": cluster.stats("P").num_requests_total, "bytes": d.kv_transfer_bytes_total,
            "hits": d.prefix_cache_hits_total,
            "local": metrics[("pdserve:request_local_prefills_total", frozenset())]}


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def test_a_next_turn_with_a_short_tail_is_prefilled_on_the_decode_worker(local, offline):
    first = [6 + (i * 41) % 290 for i in range(50)]
    c0 = _counts(local)
    answer = greedy_tokens(local, "R-local", first, max_tokens=30)
    assert answer == offline_tokens(offline, first, 30)
    # each turn's counts once its blocks are free: a pushed request can finish decoding before its
    # push ends (the draft's K/V land after `KVTargetReady`), and only then are its bytes counted
    local.wait_all_free(NAMES)
    c1 = _counts(local)
    d = _delta(c0, c1)
    assert d["prefilled"] == 1 and d["bytes"] > 0 and d["local"] == 0 and d["hits"] == 0  # a new prompt: pushed

    second = first + answer + [9, 8, 7, 6, 5]  # 85 tokens, of which D holds 64 (79 computed, 4 full blocks)
    got = greedy_tokens(local, "R-local", second, max_tokens=20)
    assert got == offline_tokens(offline, second, 20)
    local.wait_all_free(NAMES)
    d = _delta(c1, c2 := _counts(local))
    assert d["local"] == 1 and d["prefilled"] == 0 and d["bytes"] == 0, d
    assert len(second) - d["hits"] <= TAIL and d["hits"] % 16 == 0

    third = second + got + [4 + i % 50 for i in range(TAIL + 10)]  # a tail longer than TAIL: pushed
    got3 = greedy_tokens(local, "R-local", third, max_tokens=8)
    assert got3 == offline_tokens(offline, third, 8)
    local.wait_all_free(NAMES)
    d = _delta(c2, _counts(local))
    assert d["local"] == 0 and d["prefilled"] == 1 and d["hits"] > 0, d
    assert d["bytes"] > 0


def test_its_ttft_stages_say_the_decode_worker_prefilled_it(local):
    """Stages of a request prefilled on the decode worker: nothing in transfer, and they still
    add up to its TTFT (the router waits for no prefill worker's account)."""
    prompt = [8 + (i * 43) % 280 for i in range(40)]
    greedy_tokens(local, "R-local", prompt, max_tokens=4)  # pushed; D holds its two full blocks then
    local.wait_all_free(NAMES)
    before = local.metrics("R-local")
    greedy_tokens(local, "R-local", prompt, max_tokens=4)  # the same prompt again: an 8-token tail
    deadline = time.monotonic() + 20

    def stage(m, name, stage_name):
        return m[(f"pdserve:time_to_first_token_stage_seconds_{name}", frozenset({("stage", stage_name)}))]

    while stage(after := local.metrics("R-local"), "count", "queue") == stage(before, "count", "queue"):
        assert time.monotonic() < deadline, "no TTFT stages observed"
        time.sleep(0.05)
    assert after[("pdserve:request_local_prefills_total", frozenset())] == \
        before[("pdserve:request_local_prefills_total", frozenset())] + 1
    sums = {s: stage(after, "sum", s) - stage(before, "sum", s) for s in ("queue", "prefill", "transfer", "delivery")}
    ttft = (after[("pdserve:time_to_first_token_seconds_sum", frozenset())]
            - before[("pdserve:time_to_first_token_seconds_sum", frozenset())])
    assert sums["transfer"] == 0 and sums["prefill"] > 0
    assert sum(sums.values()) == pytest.approx(ttft, abs=1e-9)
    local.wait_all_free(NAMES)


def test_a_reservation_that_prefills_here_streams_without_a_push_and_frees_its_blocks(local):
    """The decode worker's side alone: `prefills_here`, no ticket, tokens without any push, and
    cancelling one mid-stream frees its blocks; a second call with a live request's id is refused
    (ALREADY_EXISTS, never touching the live one), here one held for its push."""
    stub = local.decode_stub("D-local")
    prompt = [9 + (i * 47) % 280 for i in range(36)]
    greedy_tokens(local, "R-local", prompt, max_tokens=4)
    local.wait_all_free(NAMES)

    def decode(req_id: str, ids: list[int], max_tokens: int):
        return stub.Decode(wk.WorkRequest(req_id=req_id, prompt_token_ids=ids, sampling_params=gen.SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True)), timeout=60)

    stream = decode("here-1", prompt, 4)
    admitted = next(stream).admitted
    assert admitted.prefills_here and admitted.ticket == "" and admitted.num_cached_tokens == 32
    assert len([t for e in stream for t in e.tokens.token_ids]) == 4
    local.wait_all_free(NAMES)

    stream = decode("here-2", prompt, 400)
    assert next(stream).admitted.prefills_here
    assert next(stream).tokens.token_ids  # decoding
    stream.cancel()
    local.wait_all_free(NAMES)

    fresh = [10 + (i * 53) % 280 for i in range(60)]  # nothing of it cached: held for a push
    held = decode("held", fresh, 4)
    admitted = next(held).admitted
    assert not admitted.prefills_here and admitted.ticket
    with pytest.raises(grpc.RpcError) as e:
        next(decode("held", prompt, 4))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "already being served" in e.value.details()
    assert local.stats("D-local").num_reserved == 1  # still held, untouched
    held.cancel()
    local.wait_all_free(NAMES)


def test_a_tail_prefilled_beside_a_decoding_request_runs_in_chunks_and_both_keep_their_tokens(local, offline):
    """Another request decodes on the worker while a turn's tail is prefilled there, CHUNK tokens
    a step (the worker passes its cap to the reservation; tests/engine/test_disagg.py checks the
    chunks themselves): both streams' tokens are the offline engine's."""
    first = [7 + (i * 37) % 280 for i in range(40)]
    answer = greedy_tokens(local, "R-local", first, max_tokens=12)
    local.wait_all_free(NAMES)
    turn = first + answer + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 62 tokens
    other = [12 + (i * 59) % 270 for i in range(20)]
    got: dict[str, list[int]] = {}
    started = threading.Event()

    def background() -> None:
        call = local.generation("R-local").Generate(gen.GenerateRequest(
            token_ids=gen.TokenIds(ids=other), sampling_params=gen.SamplingParams(
                temperature=0, max_tokens=200, ignore_eos=True)), timeout=60)
        tokens = []
        for msg in call:
            tokens += msg.token_ids
            started.set()
        got["other"] = tokens

    thread = threading.Thread(target=background)
    thread.start()
    assert started.wait(30), "the other request never streamed"
    c0 = _counts(local)
    got["turn"] = greedy_tokens(local, "R-local", turn, max_tokens=8)
    thread.join(60)
    d = _delta(c0, _counts(local))
    assert d["local"] == 1 and len(turn) - d["hits"] > CHUNK, d  # a tail of more than one chunk
    assert got["turn"] == offline_tokens(offline, turn, 8)
    assert got["other"] == offline_tokens(offline, other, 200)
    local.wait_all_free(NAMES)
