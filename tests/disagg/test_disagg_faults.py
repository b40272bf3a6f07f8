"""Failures end one request with a clear status, free its blocks on both workers, and leave
every process serving."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import google_crc32c

import grpc
import pytest
import torch

from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc
from pdserve.v1 import worker_pb2 as wk
from procs import unique_prompt

PROMPT = list(range(10, 30))  # 20 tokens


def long_stream(cluster, router="R"):
    return cluster.generation(router).Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=PROMPT), sampling_params=gen.SamplingParams(
            temperature=0, max_tokens=400, ignore_eos=True)), timeout=60)


def assert_router_serves(cluster, router="R"):
    msgs = list(cluster.generation(router).Generate(gen.GenerateRequest(
        prompt="still here", sampling_params=gen.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        timeout=60))
    assert msgs[-1].finish_reason == gen.LENGTH


@pytest.mark.parametrize("router", ["R", "R2"])
def test_cancel_mid_stream_frees_blocks_on_both_workers(cluster, router):
    for _ in range(5):  # the tiny model's 400 tokens take well under a second: a stalled test may miss them
        stream = long_stream(cluster, router)
        assert len(next(stream).token_ids) >= 1
        next(stream)
        running = cluster.stats("D" if router == "R" else "D2").num_running == 1  # it holds blocks now
        stream.cancel()
        if running:
            break
        cluster.wait_all_free()
    else:
        pytest.fail("each of five requests had finished before it could be cancelled")
    cluster.wait_all_free()
    assert_router_serves(cluster, router)


def test_vanished_client_frees_blocks(cluster):
    client = textwrap.dedent(f"""
        import os, grpc
        from pdserve.v1 import generation_pb2 as gen, generation_pb2_grpc
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("{cluster.address('R')}"))
        stream = stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids={PROMPT}),
            sampling_params=gen.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)))
        next(stream)
        print("streaming", flush=True)
        os._exit(0)  # no cancel, no goodbye: the connection just drops
    """)
    out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=60)
    assert "streaming" in out.stdout, out.stderr
    cluster.wait_all_free()
    assert_router_serves(cluster)


# ---- a decode worker's PushKV driven by hand ---------------------------------------------------
def reserve(cluster, req_id: str, prompt=PROMPT):
    """Open a Decode stream on D and read its admission, for a hand-made push of every token (the
    prompt's first token made the request's own: `unique_prompt`)."""
    stream = cluster.decode_stub().Decode(wk.WorkRequest(req_id=req_id, prompt_token_ids=unique_prompt(req_id, prompt),
                                                         sampling_params=gen.SamplingParams(temperature=0, max_tokens=3, seed=1)),
                                          timeout=60)
    event = next(stream)
    assert event.WhichOneof("event") == "admitted"
    assert event.admitted.ticket and req_id not in event.admitted.ticket  # the decode worker's own, signed
    assert event.admitted.num_cached_tokens == 0
    return stream, event.admitted.ticket


def kv_chunks(cluster, ticket: str, num_tokens=len(PROMPT), first_token=5):
    """A well-formed push: random K/V for every layer, one chunk per layer."""
    info = cluster.decode_stub().GetInfo(wk.InfoRequest(), timeout=5)
    yield wk.KVChunk(header=wk.KVHeader(ticket=ticket, num_tokens=num_tokens, dtype=info.dtype,
                                        groups=info.kv_groups))
    seq = 0
    for g, group in enumerate(info.kv_groups):
        for layer in range(group.num_layers):
            data = torch.randn(2, num_tokens, group.num_kv_heads, group.head_dim).numpy().tobytes()
            yield wk.KVChunk(data=wk.KVData(seq=seq, group=g, layer=layer, token_start=0, num_tokens=num_tokens,
                                            data=data, crc32c=google_crc32c.value(data)))
            seq += 1
    yield wk.KVChunk(trailer=wk.KVTrailer(num_chunks=seq, first_token_id=first_token))


def push(cluster, chunks):
    return cluster.decode_stub().PushKV(iter(list(chunks)), timeout=30)


def test_hand_made_push_is_accepted_and_decoded(cluster):
    stream, ticket = reserve(cluster, "hand-ok")
    ack = push(cluster, kv_chunks(cluster, ticket))
    assert ack.num_chunks >= 2
    events = list(stream)
    assert [t for e in events for t in e.tokens.token_ids][0] == 5
    assert events[-1].tokens.finish_reason == gen.LENGTH
    cluster.wait_all_free()


def batched(chunks):
    """The same parts in one message, a `KVBatch`, as a protobuf client may send them."""
    yield wk.KVChunk(batch=wk.KVBatch(parts=list(chunks)))


def test_hand_made_batched_push_is_accepted_and_decoded(cluster):
    stream, ticket = reserve(cluster, "hand-batch")
    ack = push(cluster, batched(kv_chunks(cluster, ticket)))
    assert ack.num_chunks >= 2
    assert [t for e in stream for t in e.tokens.token_ids][0] == 5
    cluster.wait_all_free()


def nested(chunks):
    chunks = list(chunks)
    yield chunks[0]
    yield wk.KVChunk(batch=wk.KVBatch(parts=[wk.KVChunk(batch=wk.KVBatch(parts=chunks[1:]))]))


def corrupt_in_a_batch(chunks):
    return batched(corrupt(chunks))


def corrupt(chunks):
    for c in chunks:
        if c.WhichOneof("part") == "data" and c.data.seq == 1:
            c.data.data = b"\x00" + c.data.data[1:]
        yield c


def truncate(chunks):
    for c in chunks:
        if c.WhichOneof("part") == "trailer":
            return
        yield c


def lose_one(chunks):
    yield from (c for c in chunks if not (c.WhichOneof("part") == "data" and c.data.seq == 0))


def miscount(chunks):
    for c in chunks:
        if c.WhichOneof("part") == "trailer":
            c.trailer.num_chunks += 1
        yield c


@pytest.mark.parametrize("fault, words", [(corrupt, "checksum"), (truncate, "truncated"),
                                          (lose_one, "was expected"), (miscount, "truncated"),
                                          (corrupt_in_a_batch, "checksum"), (nested, "batch holds another batch")])
def test_bad_push_fails_the_request_and_frees_its_blocks(cluster, fault, words):
    req_id = f"hand-{fault.__name__}"
    before = cluster.stats("D").kv_transfer_failures_total
    stream, ticket = reserve(cluster, req_id)
    with pytest.raises(grpc.RpcError) as push_err:
        push(cluster, fault(kv_chunks(cluster, ticket)))
    assert push_err.value.code() == grpc.StatusCode.DATA_LOSS and words in push_err.value.details()
    with pytest.raises(grpc.RpcError) as decode_err:
        list(stream)
    assert decode_err.value.code() == grpc.StatusCode.DATA_LOSS and words in decode_err.value.details()
    assert cluster.stats("D").kv_transfer_failures_total == before + 1
    cluster.wait_all_free()
    assert_router_serves(cluster)


def test_push_without_a_valid_ticket_is_refused(cluster):
    """Naming the request id, or a ticket with its signature broken, reaches nothing."""
    stream, ticket = reserve(cluster, "hand-wrong-id")
    head, payload, mac = ticket.split(".")
    for forged in ("hand-wrong-id", f"{head}.{payload}.{mac[:-2]}AA"):
        with pytest.raises(grpc.RpcError) as err:
            push(cluster, kv_chunks(cluster, forged))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "ticket refused" in err.value.details()
    stream.cancel()
    cluster.wait_all_free()


def test_full_decode_worker_refuses_admission_and_router_answers_resource_exhausted(cluster):
    held, refusal = [], None
    prompt = list(range(1, 100))  # 100 tokens with the first output: 7 blocks of 16
    try:
        for i in range(40):
            try:
                held.append(reserve(cluster, f"hold-{i}", prompt)[0])
            except grpc.RpcError as e:
                refusal = e
                break
        assert refusal is not None and refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "decode worker is full" in refusal.details()
        with pytest.raises(grpc.RpcError) as err:  # R3 has no admission queue
            list(cluster.generation("R3").Generate(gen.GenerateRequest(
                token_ids=gen.TokenIds(ids=prompt), sampling_params=gen.SamplingParams(max_tokens=2)), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for stream in held:
            stream.cancel()
    cluster.wait_all_free()
    assert_router_serves(cluster, "R3")


def test_sigterm_drains_the_router(cluster):
    """On SIGTERM: NOT_SERVING at once on both APIs, new requests refused with UNAVAILABLE, the
    request in flight (its decode worker frozen, so it cannot finish) ends with UNAVAILABLE
    saying why once the drain timeout passes, and nothing in the log is a traceback."""
    import json
    import signal
    import time
    import urllib.error
    import urllib.request

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from procs import wait_ready

    router = cluster.start_router("R-drain", "--prefill", cluster.address("P"), "--decode", cluster.address("D"),
                                  "--http-port", "0", "--drain-timeout", "3")
    wait_ready(router)
    with grpc.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        long = stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=PROMPT), sampling_params=gen.SamplingParams(
            temperature=0, max_tokens=400, ignore_eos=True)), timeout=60)
        next(long)
        decode = cluster.procs["D"].popen
        decode.send_signal(signal.SIGSTOP)
        try:
            router.signal(signal.SIGTERM)
            time.sleep(0.5)
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(urllib.error.HTTPError) as http_err:
                urllib.request.urlopen(f"http://{router.addresses['http']}/ready", timeout=5)
            assert http_err.value.code == 503
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(gen.GenerateRequest(prompt="new", sampling_params=gen.SamplingParams(max_tokens=2)),
                                   timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
            body = json.dumps({"prompt": "new", "max_tokens": 2}).encode()
            with pytest.raises(urllib.error.HTTPError) as http_err:
                urllib.request.urlopen(urllib.request.Request(f"http://{router.addresses['http']}/v1/completions",
                                                              body), timeout=10)
            assert http_err.value.code == 503
            with pytest.raises(grpc.RpcError) as err:
                for _ in long:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "drain" in err.value.details()
        finally:
            decode.send_signal(signal.SIGCONT)
    assert router.popen.wait(30) == 0
    assert "Traceback" not in router.log.read_text()
    cluster.wait_all_free()


def test_a_worker_back_with_another_configuration_is_not_paired_and_one_back_as_before_serves_soon(cluster):
    """A decode worker restarted at the same address with a different block size is asked again
    what it runs and refused (requests get UNAVAILABLE at once, saying why, not a stream of
    transfer failures); restarted as before, it gets traffic again within a few seconds of
    saying SERVING (a generous bound: the check is that the reconnect backoff is capped)."""
    import time

    from procs import wait_ready

    args = ["--num-threads", "1", "--num-kv-blocks", "64", "--draft-model", str(cluster.model)]  # pairs with P
    d = cluster.start("D-flip", "decode-worker", *args)
    wait_ready(d)
    address, port = d.address, d.address.rsplit(":", 1)[1]
    r = cluster.start_router("R-flip", "--prefill", cluster.address("P"), "--decode", address,
                             "--health-interval", "0.5", "--failover-wait", "2")
    wait_ready(r)
    request = gen.GenerateRequest(prompt="x", sampling_params=gen.SamplingParams(temperature=0, max_tokens=2))
    assert list(cluster.generation("R-flip").Generate(request, timeout=60))

    d.stop()
    flipped = cluster.start("D-flip", "decode-worker", *args, "--block-size", "8", "--port", port)
    wait_ready(flipped)
    deadline = time.monotonic() + 30
    while True:
        try:
            list(cluster.generation("R-flip").Generate(request, timeout=30))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            if "pairs" in e.details():
                break
            # until the router re-checks the worker back at that address it has no healthy decode
            # worker at all, and says so at once
            assert "no healthy decode worker" in e.details(), e.details()
        assert time.monotonic() < deadline, "the reconfigured worker kept getting traffic"
        time.sleep(0.2)

    flipped.stop()
    back = cluster.start("D-flip", "decode-worker", *args, "--port", port)
    wait_ready(back)
    ready_at = time.monotonic()
    while True:
        try:
            if list(cluster.generation("R-flip").Generate(request, timeout=30)):
                break
        except grpc.RpcError:
            pass
        assert time.monotonic() - ready_at < 15, "the returning worker got no traffic for 15 s"
        time.sleep(0.1)
    recovery = time.monotonic() - ready_at
    print(f"recovery after SERVING: {recovery:.2f} s")


def test_a_push_its_sender_abandons_ends_the_request_as_cancelled_not_as_a_failed_transfer(cluster):
    """A prefill worker whose request ended gives its push up with an `abandoned` trailer: the
    decode side frees the reservation and counts no failed transfer; a push that just stops
    (its sender died) still counts as one."""
    before = cluster.stats("D").kv_transfer_failures_total
    stream, ticket = reserve(cluster, "hand-abandoned")
    chunks = list(kv_chunks(cluster, ticket))
    abandoned = [*chunks[:2], wk.KVChunk(trailer=wk.KVTrailer(num_chunks=1, abandoned=True))]
    with pytest.raises(grpc.RpcError) as push_err:
        push(cluster, abandoned)
    assert push_err.value.code() == grpc.StatusCode.ABORTED and "abandoned" in push_err.value.details()
    with pytest.raises(grpc.RpcError) as decode_err:
        list(stream)
    assert decode_err.value.code() == grpc.StatusCode.ABORTED
    assert cluster.stats("D").kv_transfer_failures_total == before
    cluster.wait_all_free()
