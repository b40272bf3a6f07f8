"""The shared-memory KV path with real worker processes on loopback.

Each process gets a /dev/shm of its own choosing ($PDSERVE_SHM_DIR, a temporary folder), the
way containers on one node may or may not share one:

    P (dir A) ──shm──► D (dir A)     same /dev/shm: the probe opens, K/V go through shared memory
    P (dir A) ──gRPC─► DX (dir B)    another /dev/shm: the probe cannot be opened, plain gRPC
"""
from __future__ import annotations

import os
import signal

import grpc
import numpy as np
import pytest

from pdserve.cluster.local import LocalProcess
from pdserve.engine.disagg import raw_layer, read_kv, write_kv
from pdserve.engine.kv_copy import crc32c, rows_crc32c
from pdserve.serving.kv_transfer.shm import KVArena, Segment, copy_runs, slot_runs
from pdserve.v1 import worker_pb2 as wk
from procs import CLUSTER_TOKEN, Cluster, greedy_tokens, reserve, wait_ready

PROMPT = list(range(40, 90))


def _start(c: Cluster, name: str, command: str, shm_dir, *args: str) -> LocalProcess:
    extra = ["--model", str(c.model)] if command != "router" else ["--model", str(c.model)]
    proc = LocalProcess(name, command, [*extra, *args], c.logs / f"{name}.log",
                        env={"PDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN, "PDSERVE_SHM_DIR": str(shm_dir)})
    c.procs[name] = proc
    return proc.start()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tmp_path_factory.mktemp("shm-a"), tmp_path_factory.mktemp("shm-b")


@pytest.fixture(scope="module")
def pair(serving_model, tmp_path_factory, dirs):
    a, b = dirs
    c = Cluster(serving_model, tmp_path_factory.mktemp("shm-logs"))
    worker = ["--num-threads", "1", "--num-kv-blocks", "64", "--kv-transfer-timeout", "20", "--no-warmup"]
    try:
        # small chunks: each layer's K/V of the prompt become several chunks on both paths; and
        # a small step budget: the prompt's prefill takes several steps, each handing its K/V over
        wait_ready(_start(c, "P", "prefill-worker", a, *worker, "--max-chunk-bytes", "1024",
                          "--max-num-batched-tokens", "16"),
                   # every request pushed, however much of its prompt the decode worker holds
                   _start(c, "D", "decode-worker", a, *worker, "--local-prefill-tokens", "0"),
                   _start(c, "DX", "decode-worker", b, *worker, "--local-prefill-tokens", "0"),
                   # no shared memory at all: its chunks are copied out of its own cache into their messages
                   _start(c, "PN", "prefill-worker", a, *worker, "--max-chunk-bytes", "1024",
                          "--max-num-batched-tokens", "16", "--no-kv-shm"))
        # the same over bfloat16 caches under the float32 model (`--kv-cache-dtype`)
        narrow = [*worker, "--kv-cache-dtype", "bfloat16"]
        wait_ready(_start(c, "PB", "prefill-worker", a, *narrow, "--max-chunk-bytes", "1024"),
                   _start(c, "DB", "decode-worker", a, *narrow, "--local-prefill-tokens", "0"),
                   _start(c, "DBX", "decode-worker", b, *narrow, "--local-prefill-tokens", "0"))
        wait_ready(_start(c, "R", "router", a, "--prefill", c.address("P"), "--decode", c.address("D")),
                   _start(c, "RX", "router", a, "--prefill", c.address("P"), "--decode", c.address("DX")),
                   _start(c, "RN", "router", a, "--prefill", c.address("PN"), "--decode", c.address("D")),
                   _start(c, "RB", "router", a, "--prefill", c.address("PB"), "--decode", c.address("DB")),
                   _start(c, "RBX", "router", a, "--prefill", c.address("PB"), "--decode", c.address("DBX")))
        yield c
    finally:
        c.stop()


def test_same_node_pair_uses_shm_and_the_other_falls_back_to_grpc(pair, dirs):
    shm_before = pair.stats("P").kv_transfer_shm_total
    via_shm = greedy_tokens(pair, "R", PROMPT)
    pair.wait_all_free(("P",))  # its push counted once it is acknowledged, which may come after the tokens
    assert pair.stats("P").kv_transfer_shm_total == shm_before + 1
    via_grpc = greedy_tokens(pair, "RX", PROMPT)  # DX's probe lives in another folder: P cannot open it
    assert pair.stats("P").kv_transfer_shm_total == shm_before + 1
    assert via_shm == via_grpc and len(via_shm) == 12  # the same cache contents decode the same tokens
    assert pair.stats("DX").kv_transfer_bytes_total > 0
    bytes_before = pair.stats("D").kv_transfer_bytes_total
    assert greedy_tokens(pair, "RN", PROMPT) == via_shm  # from a prefill worker without shared memory: bytes over gRPC
    assert pair.stats("PN").kv_transfer_shm_total == 0 and pair.stats("D").kv_transfer_bytes_total > bytes_before
    pair.wait_all_free(("P", "PN", "D", "DX"))
    names = sorted(os.listdir(dirs[0]))
    assert any(n.startswith("pdserve-kv-") for n in names) and any(n.startswith("pdserve-probe-") for n in names)


def test_a_bfloat16_cache_pair_moves_half_the_bytes_and_decodes_like_the_offline_engine(pair, serving_model):
    """Workers started with `--kv-cache-dtype bfloat16` under the float32 model: their K/V cross
    as bfloat16 (through shared memory, and as bytes over gRPC at half a float32 pair's count for
    the same prompt) and decode what the offline engine with that cache decodes."""
    from pdserve.engine import LLM, SamplingParams

    info = pair.decode_stub("DB").GetInfo(wk.InfoRequest(), timeout=5)
    assert (info.dtype, info.kv_dtype) == ("float32", "bfloat16")
    prompt = list(range(140, 190))  # not in any decode worker's prefix cache yet
    want = LLM(str(serving_model), kv_cache_dtype="bfloat16").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    shm_before = pair.stats("PB").kv_transfer_shm_total
    assert greedy_tokens(pair, "RB", prompt) == want
    pair.wait_all_free(("PB",))
    assert pair.stats("PB").kv_transfer_shm_total == shm_before + 1
    narrow_before, wide_before = pair.stats("DBX").kv_transfer_bytes_total, pair.stats("DX").kv_transfer_bytes_total
    assert greedy_tokens(pair, "RBX", prompt) == want
    greedy_tokens(pair, "RX", prompt)  # the float32 pair, the same prompt over gRPC
    narrow = pair.stats("DBX").kv_transfer_bytes_total - narrow_before
    wide = pair.stats("DX").kv_transfer_bytes_total - wide_before
    assert narrow > 0 and wide == 2 * narrow
    pair.wait_all_free(("PB", "DB", "DBX"))


def _shm_push(c: Cluster, ticket: str, segments: list[Segment], arrays, num_slots: int, corrupt: bool):
    """A push naming slots [100, 100 + len(PROMPT)) of our own segments, as a prefill worker would."""
    info = c.decode_stub("D").GetInfo(wk.InfoRequest(), timeout=5)
    yield wk.KVChunk(header=wk.KVHeader(ticket=ticket, num_tokens=len(PROMPT), dtype=info.kv_dtype,
                                        groups=info.kv_groups,
                                        shm=wk.KVShm(segments=[s.name for s in segments], num_slots=num_slots)))
    runs = slot_runs(np.arange(100, 100 + len(PROMPT)))
    seq = 0
    for g, group in enumerate(info.kv_groups):
        for layer in range(group.num_layers):
            crc = rows_crc32c(*arrays[g][layer], runs) ^ (seq == 1 and corrupt)
            yield wk.KVChunk(data=wk.KVData(seq=seq, group=g, layer=layer, token_start=0, num_tokens=len(PROMPT),
                                            crc32c=crc, src_runs=[x for r in runs for x in r]))
            seq += 1
    yield wk.KVChunk(trailer=wk.KVTrailer(num_chunks=seq, first_token_id=5))


@pytest.mark.parametrize("corrupt", [False, True])
def test_hand_made_shm_push(pair, dirs, monkeypatch, corrupt):
    """A wrong checksum over shared memory is DATA_LOSS and frees the reservation; a right one decodes."""
    monkeypatch.setenv("PDSERVE_SHM_DIR", str(dirs[0]))
    info = pair.decode_stub("D").GetInfo(wk.InfoRequest(), timeout=5)
    arena = KVArena()
    try:
        import torch

        dtype = getattr(torch, info.dtype)
        num_slots = 64 * info.block_size
        arrays = []
        for group in info.kv_groups:
            shape = (64, info.block_size, group.num_kv_heads, group.head_dim)
            layers = arena(group.num_layers, shape, dtype, torch.device("cpu"))
            for k, v in layers:
                k.normal_(), v.normal_()
            arrays.append([raw_layer(layers, i) for i in range(group.num_layers)])
        stream, ticket = reserve(pair, "D", f"shm-hand-{corrupt}", PROMPT)
        chunks = list(_shm_push(pair, ticket, arena.segments, arrays, num_slots, corrupt))
        if corrupt:
            with pytest.raises(grpc.RpcError) as e:
                pair.decode_stub("D").PushKV(iter(chunks), timeout=30)
            assert e.value.code() == grpc.StatusCode.DATA_LOSS and "CRC-32C" in e.value.details()
            with pytest.raises(grpc.RpcError):
                list(stream)
        else:
            assert pair.decode_stub("D").PushKV(iter(chunks), timeout=30).num_chunks == len(chunks) - 2
            assert [t for e in stream for t in e.tokens.token_ids][0] == 5
        pair.wait_all_free(("P", "D"))
    finally:
        arena.close()


def test_no_segment_left_after_stop_and_stale_ones_cleaned_after_kill_9(serving_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("shm-kill")
    c = Cluster(serving_model, tmp_path_factory.mktemp("shm-kill-logs"))
    worker = ["--num-threads", "1", "--num-kv-blocks", "16", "--no-warmup"]
    try:
        wait_ready(_start(c, "P", "prefill-worker", d, *worker), _start(c, "D", "decode-worker", d, *worker))
        assert len(os.listdir(d)) >= 2  # P's KV segment(s), D's probe
        c.procs["D"].stop()  # SIGTERM: its probe goes
        assert all(n.startswith("pdserve-kv-") for n in os.listdir(d))
        c.procs["P"].popen.send_signal(signal.SIGKILL)  # no chance to unlink: its segments stay ...
        c.procs["P"].popen.wait(timeout=10)
        assert any(n.startswith("pdserve-kv-") for n in os.listdir(d))
        wait_ready(_start(c, "D2", "decode-worker", d, *worker))  # ... until the next worker starts there
        assert [n for n in os.listdir(d) if n.startswith("pdserve-kv-")] == []
    finally:
        c.stop()
    assert os.listdir(d) == []


def test_shm_copy_writes_what_the_bytes_path_writes():
    """The two ways K/V reach a decode cache give the same bytes and the same checksum."""
    import torch

    arena = KVArena()
    try:
        shape = (8, 4, 2, 16)  # [num_blocks, block_size, num_kv_heads, head_dim]
        src = arena(2, shape, torch.float32, torch.device("cpu"))
        for k, v in src:
            k.normal_(), v.normal_()
        src_slots = torch.tensor([4, 5, 6, 7, 20, 21, 2, 3, 30])  # blocks 1 and 5 and pieces of others
        dst_slots = torch.tensor([8, 9, 10, 11, 12, 13, 14, 15, 16])
        via_bytes = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(2)]
        via_shm = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(2)]
        for layer in range(2):
            data = read_kv(src, layer, src_slots)
            write_kv(via_bytes, layer, dst_slots, data.tobytes())
            runs = slot_runs(src_slots.numpy())
            crc = copy_runs(runs, dst_slots.numpy(), raw_layer(src, layer), raw_layer(via_shm, layer))
            assert crc == crc32c(data) == rows_crc32c(*raw_layer(src, layer), runs)
        for (kb, vb), (ks, vs) in zip(via_bytes, via_shm):
            assert torch.equal(kb, ks) and torch.equal(vb, vs)
    finally:
        arena.close()


ROOMLESS = """
import torch
from pdserve.serving.kv_transfer.shm import KVArena
f32, cpu = torch.float32, torch.device("cpu")
a = KVArena()  # one layer's K and V of [blocks, 16, 2, 32] float32: 8 KiB a block
assert a(1, (256, 16, 2, 32), f32, cpu) is None  # 2 MiB in a 1 MiB /dev/shm: declined, nothing left
assert a.declined and a.segments == [] and a(1, (4, 16, 2, 32), f32, cpu) is None  # the later groups too
b = KVArena()
(k, v), = b(1, (64, 16, 2, 32), f32, cpu)  # 512 KiB: fits, and every byte of it can be written
k.fill_(1.0), v.fill_(2.0)
try:
    b(1, (96, 16, 2, 32), f32, cpu)  # a draft's 768 KiB beside it: no room, and no splitting the groups
except RuntimeError as e:
    print("draft:", e)
"""


def test_a_dev_shm_without_room_for_the_cache_is_said_at_allocation_not_a_sigbus(tmp_path):
    """Where /dev/shm is smaller than the cache (Docker's and Kubernetes' default is 64 MiB), the
    arena declines at allocation and the worker keeps its cache in ordinary memory, K/V over
    gRPC. Before, the segment was made sparse and the first K/V write past the room killed the
    process with SIGBUS. A tmpfs of a set size needs a mount namespace of our own (root, or
    unprivileged user namespaces)."""
    import shutil
    import subprocess
    import sys

    room = tmp_path / "shm"
    room.mkdir()
    script = tmp_path / "roomless.py"
    script.write_text(ROOMLESS)
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a small tmpfs")
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]
    run = subprocess.run(["unshare", *flags, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {room} || exit 99; "
                          f"exec {sys.executable} {script}"], env={**os.environ, "PDSERVE_SHM_DIR": str(room)},
                         capture_output=True, text=True, timeout=120)
    if run.returncode == 99 or "unshare failed" in run.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr  # 135 would be the SIGBUS
    assert "no room for the target's KV cache (2 MiB" in run.stderr and "--no-kv-shm" in run.stderr
    assert "draft: /" in run.stdout and "no room for the draft's KV cache (1 MiB" in run.stdout
    assert "beside the target's" in run.stdout
