"""A decode worker's prefix cache across transfers: a reservation adopts the prompt's leading
blocks that the decode worker holds (the conversation's earlier turn, decoded there), its ticket
says how many tokens they hold, and the prefill worker pushes the K/V of the rest only. Real
processes (the shared cluster: P and D speculate, so adoption needs the draft's K/V too)."""
from __future__ import annotations

import time

import google_crc32c
import grpc
import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import worker_pb2 as wk
from procs import generate_all, greedy_tokens, joined

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(info: wk.WorkerInfo) -> int:
    return sum(2 * g.num_layers * g.num_kv_heads * g.head_dim for g in info.kv_groups) * ITEMSIZE[info.dtype]


def offline_tokens(offline, prompt: list[int], max_tokens: int) -> list[int]:
    return offline.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def test_the_next_turn_pushes_only_what_the_decode_worker_lacks_and_answers_as_offline(cluster, offline):
    info = cluster.decode_stub().GetInfo(wk.InfoRequest(), timeout=5)
    per_token, block = kv_bytes_per_token(info), info.block_size
    first = [5 + (i * 37) % 300 for i in range(70)]
    before = cluster.stats("D")
    answer = greedy_tokens(cluster, "R", first, max_tokens=48)
    assert answer == offline_tokens(offline, first, 48)
    mid = cluster.stats("D")
    assert mid.prefix_cache_hits_total == before.prefix_cache_hits_total  # a prompt it never saw
    assert mid.kv_transfer_bytes_total - before.kv_transfer_bytes_total == len(first) * per_token
    cluster.wait_all_free()

    second = first + answer + [9, 8, 7, 6, 5]  # the conversation goes on
    got = greedy_tokens(cluster, "R", second, max_tokens=24)
    assert got == offline_tokens(offline, second, 24)
    after = cluster.stats("D")
    cached = after.prefix_cache_hits_total - mid.prefix_cache_hits_total
    # at least the first prompt's full blocks (their draft K/V came with them); at most every
    # full block of what the first request computed
    assert len(first) // block * block <= cached <= (len(first) + len(answer) - 1) // block * block
    assert cached % block == 0
    assert after.kv_transfer_bytes_total - mid.kv_transfer_bytes_total == (len(second) - cached) * per_token
    cluster.wait_all_free()


def _reserve(cluster, req_id: str, prompt: list[int]):
    stream = cluster.decode_stub().Decode(wk.WorkRequest(
        req_id=req_id, prompt_token_ids=prompt, sampling_params=gen.SamplingParams(temperature=0, max_tokens=3)),
        timeout=60)
    event = next(stream)
    assert event.WhichOneof("event") == "admitted"
    return stream, event.admitted


def _push(cluster, ticket: str, num_tokens: int, cached_in_header: int, token_start: int):
    """Random K/V for tokens [token_start, num_tokens) of every layer, one chunk a layer."""
    info = cluster.decode_stub().GetInfo(wk.InfoRequest(), timeout=5)
    yield wk.KVChunk(header=wk.KVHeader(ticket=ticket, num_tokens=num_tokens, dtype=info.dtype, groups=info.kv_groups,
                                        num_cached_tokens=cached_in_header))
    seq, n = 0, num_tokens - token_start
    for g, group in enumerate(info.kv_groups):
        for layer in range(group.num_layers):
            data = torch.randn(2, n, group.num_kv_heads, group.head_dim).numpy().tobytes()
            yield wk.KVChunk(data=wk.KVData(seq=seq, group=g, layer=layer, token_start=token_start, num_tokens=n,
                                            data=data, crc32c=google_crc32c.value(data)))
            seq += 1
    yield wk.KVChunk(trailer=wk.KVTrailer(num_chunks=seq, first_token_id=5))


@pytest.mark.parametrize("fault", ["header", "chunk"])
def test_a_push_that_would_write_the_adopted_blocks_is_refused_and_frees_the_reservation(cluster, fault):
    """The adopted blocks may be read by other requests: a push must skip them. One whose header
    ignores the ticket's count (a sender older than the decode worker) is FAILED_PRECONDITION, one
    with a chunk inside them DATA_LOSS; the reservation is freed either way, and the cache still
    serves the prefix afterwards."""
    block = cluster.decode_stub().GetInfo(wk.InfoRequest(), timeout=5).block_size
    prompt = [3 + (i * 11) % 290 for i in range(3 * block + 5)] + ([1] if fault == "chunk" else [])
    greedy_tokens(cluster, "R", prompt, max_tokens=48)  # D holds its prompt blocks now
    cluster.wait_all_free()
    stream, admitted = _reserve(cluster, f"adopted-{fault}", prompt)
    cached = admitted.num_cached_tokens
    assert cached == 3 * block
    chunks = _push(cluster, admitted.ticket, len(prompt), 0 if fault == "header" else cached,
                   cached if fault == "header" else cached - 1)
    with pytest.raises(grpc.RpcError) as e:
        cluster.decode_stub().PushKV(chunks, timeout=30)
    if fault == "header":
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"holds {cached}" in e.value.details() and "older" in e.value.details()
    else:
        assert e.value.code() == grpc.StatusCode.DATA_LOSS and f"holds the first {cached}" in e.value.details()
    with pytest.raises(grpc.RpcError) as ended:
        list(stream)
    assert ended.value.code() == e.value.code()  # ended by the refusal, not by the transfer timeout
    cluster.wait_all_free()
    stream, admitted = _reserve(cluster, f"adopted-{fault}-again", prompt)
    assert admitted.num_cached_tokens == cached
    stream.cancel()
    cluster.wait_all_free()


def test_a_right_hand_made_push_after_the_cached_tokens_decodes(cluster):
    block = cluster.decode_stub().GetInfo(wk.InfoRequest(), timeout=5).block_size
    prompt = [4 + (i * 13) % 290 for i in range(2 * block + 3)]
    greedy_tokens(cluster, "R", prompt, max_tokens=48)
    cluster.wait_all_free()
    stream, admitted = _reserve(cluster, "adopted-right", prompt)
    assert admitted.num_cached_tokens == 2 * block
    ack = cluster.decode_stub().PushKV(_push(cluster, admitted.ticket, len(prompt), 2 * block, 2 * block), timeout=30)
    assert ack.num_bytes == (len(prompt) - 2 * block) * kv_bytes_per_token(
        cluster.decode_stub().GetInfo(wk.InfoRequest(), timeout=5))
    assert [t for e in stream for t in e.tokens.token_ids][0] == 5
    cluster.wait_all_free()


def test_a_conversations_next_turn_goes_to_the_decode_worker_that_served_the_last(cluster):
    """Two conversations start at once on a router over two colocated decode workers, one on
    each (the least loaded takes each); each one's next turn, sent alone, goes where its first
    turn went, and finds its start cached there: the router noted what each worker finished.
    (Which worker the least loaded order alone would pick here depends on when the router last
    read their free blocks; `tests/router/test_decode_affinity.py` checks the choice itself.)"""
    from procs import MAX_NUM_SEQS, MAX_PROMPT_CHARS, NUM_KV_BLOCKS, wait_ready

    worker = ["--num-threads", "1", "--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", str(NUM_KV_BLOCKS),
              "--metrics-port", "0"]
    names = ("D-turns-1", "D-turns-2")  # names no other test uses (`Cluster.channel` keeps a channel by name)
    wait_ready(*(cluster.start(name, "decode-worker", *worker) for name in names))
    wait_ready(cluster.start_router("R-turns", "--decode", ",".join(cluster.address(name) for name in names),
                                    "--max-prompt-chars", str(MAX_PROMPT_CHARS), "--health-interval", "0.5",
                                    "--metrics-port", "0"))
    deadline = time.monotonic() + 30  # ready once it can serve: wait until it has seen both healthy
    while sum(v for (name, labels), v in cluster.metrics("R-turns").items()
              if name == "pdserve:router_healthy_workers" and ("role", "decode") in labels) < 2:
        assert time.monotonic() < deadline, "the router did not see both decode workers healthy within 30 s"
        time.sleep(0.1)
    cluster.wait_all_free(names)
    firsts = {c: [7 + (i * k) % 280 for i in range(45)] for c, k in (("A", 29), ("B", 31))}
    before = {w: cluster.stats(w) for w in names}
    answers = generate_all(cluster, "R-turns", [gen.GenerateRequest(token_ids=gen.TokenIds(ids=p), sampling_params=gen.SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True)) for p in firsts.values()])
    mid = {w: cluster.stats(w) for w in names}
    assert [mid[w].num_requests_total - before[w].num_requests_total for w in names] == [1, 1]
    served = {}
    for (c, first), msgs in zip(firsts.items(), answers):
        ahead = {w: cluster.stats(w).prefix_cache_hits_total for w in names}
        greedy_tokens(cluster, "R-turns", first + joined(msgs)[0] + [3, 4, 5], max_tokens=8)
        hits = {w: cluster.stats(w).prefix_cache_hits_total - ahead[w] for w in names}
        served[c] = [w for w, n in hits.items() if n >= len(first) // 16 * 16]
        assert len(served[c]) == 1 and sum(hits.values()) == hits[served[c][0]], hits
    assert served["A"] != served["B"]
    cluster.wait_all_free(names)
    for name in ("R-turns", *names):
        cluster.procs.pop(name).stop()
