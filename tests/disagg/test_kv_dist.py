"""K/V bytes over a torch.distributed group (`serving/kv_transfer/dist.py`) between real worker
processes on loopback, with gloo (these caches are on the host; between CUDA caches the same
code runs NCCL, device to device). Every worker has a draft (the model itself), so a push carries
the target's K/V, a `KVTargetReady`, then the draft's:

    P (--kv-dist) ──gloo──► D       D takes gloo: the bytes go over the group, gRPC carries the rest
    P (--kv-dist) ──gRPC──► DN      DN takes none (--no-kv-dist): bytes over gRPC, CRC-32C made here
    PG            ──gRPC──► D       the reference: a prefill worker with neither

and this test process as a sender of its own: a chunk whose bytes do not match their checksum is
DATA_LOSS, a sender that stops sending costs that transfer only, and the worker serves on.
"""
from __future__ import annotations

import secrets
import time
from datetime import timedelta

import grpc
import pytest
import torch
import torch.distributed as dist

from pdserve.serving.kv_transfer.dist import checksum, make_group, sum64
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import worker_pb2 as wk
from procs import Cluster, greedy_tokens, reserve, wait_ready

PROMPT = list(range(40, 90))


def worker(model) -> list[str]:
    """Every worker's options: one thread, a small cache, the model drafting for itself."""
    return ["--num-threads", "1", "--num-kv-blocks", "64", "--no-warmup", "--draft-model", str(model)]


@pytest.fixture(scope="module")
def cluster(serving_model, tmp_path_factory):
    args = worker(serving_model)
    c = Cluster(serving_model, tmp_path_factory.mktemp("dist-logs"))
    try:
        # small chunks and a small step budget: the prompt's K/V are several chunks, over several steps
        small = ["--max-chunk-bytes", "1024", "--max-num-batched-tokens", "16", "--kv-transfer-timeout", "20"]
        wait_ready(c.start("P", "prefill-worker", *args, *small, "--kv-dist"),
                   c.start("PG", "prefill-worker", *args, *small, "--no-kv-shm"),
                   # every request pushed, however much of its prompt the decode worker holds
                   c.start("D", "decode-worker", *args, "--kv-transfer-timeout", "5", "--local-prefill-tokens", "0"),
                   c.start("DN", "decode-worker", *args, "--kv-transfer-timeout", "20", "--no-kv-dist",
                           "--local-prefill-tokens", "0"))
        wait_ready(c.start_router("R", "--prefill", c.address("P"), "--decode", c.address("D")),
                   c.start_router("RN", "--prefill", c.address("P"), "--decode", c.address("DN")),
                   c.start_router("RG", "--prefill", c.address("PG"), "--decode", c.address("D")))
        yield c
    finally:
        c.stop()


def test_kv_goes_over_the_group_to_a_decode_worker_that_takes_it_and_over_grpc_to_one_that_does_not(cluster):
    assert list(cluster.decode_stub("D").GetInfo(wk.InfoRequest(), timeout=5).kv_dist_backends) == ["gloo"]
    assert list(cluster.decode_stub("DN").GetInfo(wk.InfoRequest(), timeout=5).kv_dist_backends) == []
    assert cluster.decode_stub("D").GetInfo(wk.InfoRequest(), timeout=5).kv_target_ready  # it has a draft
    reference = greedy_tokens(cluster, "RG", PROMPT)
    received = cluster.stats("D").kv_transfer_bytes_total
    for n in (1, 2):  # the second push reuses the group the first one made
        assert greedy_tokens(cluster, "R", PROMPT) == reference and len(reference) == 12
        cluster.wait_all_free(("P",))  # the draft's K/V may still be on their way when the answer ends
        assert cluster.stats("P").kv_transfer_dist_total == n
    assert cluster.stats("D").kv_transfer_bytes_total > received
    # bytes over gRPC, read out of P's cache and checksummed there
    assert greedy_tokens(cluster, "RN", PROMPT) == reference
    assert cluster.stats("P").kv_transfer_dist_total == 2 and cluster.stats("DN").kv_transfer_bytes_total > 0
    cluster.wait_all_free(("P", "PG", "D", "DN"))
    # the draft's K/V arrived whole every time (a part lost after KVTargetReady counts as failed)
    assert cluster.stats("D").kv_transfer_failures_total == cluster.stats("DN").kv_transfer_failures_total == 0


@pytest.mark.parametrize("fault", [None, "corrupt", "stalled"])
def test_hand_made_push_over_a_group(cluster, fault):
    """This process as the sender (rank 0): right bytes decode; bytes that do not match their
    checksum (CRC-32C between host caches) are DATA_LOSS; a sender that stops sending halfway has
    the transfer fail when the decode worker's receive times out. Either way the reservation is
    freed and D serves on."""
    info = cluster.decode_stub("D").GetInfo(wk.InfoRequest(), timeout=5)
    dtype = getattr(torch, info.dtype)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    name = secrets.token_hex(16)
    stream, ticket = reserve(cluster, "D", f"dist-hand-{fault}", PROMPT)
    chunks, bufs = [wk.KVChunk(header=wk.KVHeader(
        ticket=ticket, num_tokens=len(PROMPT), dtype=info.dtype, groups=info.kv_groups,
        dist=wk.KVDist(host="127.0.0.1", port=store.port, name=name, backend="gloo")))], []
    last = sum(group.num_layers for group in info.kv_groups) - 1  # corrupt, the sends before it all match
    for g, group in enumerate(info.kv_groups):
        for layer in range(group.num_layers):
            buf = torch.randn(2, len(PROMPT), group.num_kv_heads, group.head_dim).to(dtype)
            crc, _ = checksum(buf, "gloo")
            if fault == "corrupt" and len(bufs) == last:
                buf.view(torch.int16).view(-1)[7] ^= 1  # one bit off after the sum was taken
            chunks.append(wk.KVChunk(data=wk.KVData(seq=len(bufs), group=g, layer=layer, token_start=0,
                                                    num_tokens=len(PROMPT), crc32c=crc)))
            bufs.append(buf)
    chunks.append(wk.KVChunk(trailer=wk.KVTrailer(num_chunks=len(bufs), first_token_id=5)))
    push = cluster.decode_stub("D").PushKV.future(iter(chunks), timeout=30)
    group = make_group(store, name, 0, "gloo", 10)  # D joins on reading the header
    sent = bufs[:1] if fault == "stalled" else bufs
    for seq, buf in enumerate(sent):
        group.send([buf], 1, seq).wait()
    if fault is None:
        assert push.result().num_chunks == len(bufs)
        assert [t for e in stream for t in e.tokens.token_ids][0] == 5
    else:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            push.result()
        if fault == "corrupt":
            assert e.value.code() == grpc.StatusCode.DATA_LOSS and "CRC-32C" in e.value.details()
            # the failed push's group is gone from D for good: a header naming it fails at once
            again, ticket = reserve(cluster, "D", "dist-hand-again", PROMPT)
            header = wk.KVChunk(header=wk.KVHeader(ticket=ticket, num_tokens=len(PROMPT), dtype=info.dtype,
                                                   groups=info.kv_groups, dist=chunks[0].header.dist))
            with pytest.raises(grpc.RpcError) as e:
                cluster.decode_stub("D").PushKV(iter([header]), timeout=30)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "dropped" in e.value.details()
            with pytest.raises(grpc.RpcError):
                list(again)
        else:  # D's receive of chunk 1 waited its 5 s transfer timeout
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "chunk 1" in e.value.details()
            assert time.monotonic() - started < 15
        with pytest.raises(grpc.RpcError):
            list(stream)
    cluster.wait_all_free(("D",))
    assert greedy_tokens(cluster, "RG", PROMPT)  # D serves on


def test_a_decode_worker_killed_with_a_group_open_costs_one_request(cluster):
    """P keeps a group with D3 after a push. D3 reserves blocks for another request and is killed
    (-9); P's push of that request goes to the dead worker over the kept group, fails within
    seconds (not the 20 s transfer timeout), drops the group and frees P's blocks, and P serves on."""
    from pdserve.v1 import worker_pb2_grpc

    d3 = cluster.start("D3", "decode-worker", *worker(cluster.model), "--local-prefill-tokens", "0")  # pushed again
    wait_ready(d3)
    wait_ready(cluster.start_router("R3", "--prefill", cluster.address("P"), "--decode", d3.address))
    cluster.wait_all_free(("P",))
    pushed = cluster.stats("P").kv_transfer_dist_total
    reference = greedy_tokens(cluster, "R3", PROMPT)
    cluster.wait_all_free(("P",))
    assert cluster.stats("P").kv_transfer_dist_total == pushed + 1  # a group with D3 now
    request = wk.WorkRequest(req_id="dist-killed", prompt_token_ids=PROMPT,
                             sampling_params=gen.SamplingParams(temperature=0, max_tokens=3))
    reservation = cluster.decode_stub("D3").Decode(request, timeout=60)
    ticket = next(reservation).admitted.ticket
    d3.popen.kill()
    d3.popen.wait(timeout=10)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        worker_pb2_grpc.PrefillWorkerStub(cluster.channel("P")).Prefill(
            wk.PrefillRequest(request=request, ticket=ticket), timeout=60)
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED), e.value.details()
    assert time.monotonic() - started < 10
    cluster.wait_all_free(("P",))
    assert greedy_tokens(cluster, "R", PROMPT) == reference  # to D, over its own group
    cluster.wait_all_free(("P",))
    assert cluster.stats("P").kv_transfer_dist_total == pushed + 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum64_is_its_definition_and_sees_swapped_words(dtype):
    """The chunk's bytes as little-endian 16-bit words w_i: the sum of w_i * ((i mod 32749) + 1)
    (NCCL's checksum, computed on the device; run here on the host)."""
    t = torch.randn(2, 7, 3, 5).to(dtype)
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    words = [int.from_bytes(raw[i:i + 2], "little") for i in range(0, len(raw), 2)]
    assert sum64(t) == sum(w * (i % 32749 + 1) for i, w in enumerate(words))
    swapped = t.clone()
    flat = swapped.view(torch.int16).view(-1)
    flat[[3, 4]] = flat[[4, 3]].clone()
    assert torch.equal(swapped.view(torch.int16).view(-1).sort().values, t.view(torch.int16).view(-1).sort().values)
    assert (sum64(swapped) == sum64(t)) == (flat[3] == flat[4]).item()
    long = torch.full((70000,), -1, dtype=torch.int16)  # past two periods of the weights, every word 0xFFFF
    assert sum64(long) == 0xFFFF * sum(i % 32749 + 1 for i in range(70000))
