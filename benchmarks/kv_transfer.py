"""The KV transfer paths, measured side by side in one run (this machine is shared and noisy).

    python benchmarks/kv_transfer.py [--quick] [--kv-cache-dtype bfloat16]

1. gRPC: a long prompt's K/V pushed the production way (`GrpcTransport`, chunks with CRC-32C
   copied out of a KV cache into their gRPC messages by `host_chunks`, as the prefill worker's
   engine thread does, inside the timing) into a real decode worker, which checks
   and writes them into its KV cache; against a raw TCP socket moving the same bytes out of the
   same kind of cache into the same kind of cache (`read_kv` -> sendall -> recv_into ->
   `write_kv`, no checksum, no framing). Goal: gRPC / TCP >= 0.5.
2. Shared memory: the same push by `ShmTransport` to a decode worker on this node (chunks name
   slots of our KV cache in /dev/shm; the decode worker copies them into its cache and checks
   each chunk's CRC-32C on its copy); against a plain `torch` copy_ of the same number of bytes
   in this process, on one thread as the decode worker's copy runs (torch's default would
   split it over every core). The chunk checksums are computed before the clock starts, as the prefill
   worker's engine thread computes them while later layers run. Goal: shm / copy >= 0.8.
   Beside them, for the reader, the decode worker's part alone: `copy_runs` (its copy-and-check
   of each chunk) from a second mapping of the same segment into a cache like its own, in this
   process; the push's time beyond it is the gRPC control path (messages, header, trailer, ack),
   measured on its own by the same push for a SMALL_PROMPT-token prompt.
   Beside them, the torch.distributed path (`DistTransport`, gloo here: each chunk's bytes one send
   over a two-rank group, its CRC-32C checked on arrival, gRPC carrying the rest) into the same
   decode worker as the gRPC push: not a goal on a host (its device-to-device use is between
   CUDA caches, with NCCL), reported against raw TCP like the gRPC push.
3. TTFT at low load (one request at a time) through a router: disaggregated (prefill worker ->
   decode worker) against colocated (decode worker alone), each repeat the median of --inner
   requests a side, alternating, with an A/A control (the colocated request again). Goal: <= 1.10.

Parts 1 and 2 interleave their paths: a repeat is --inner rounds back to back (gRPC, TCP, shm,
the small shm push, copy, copy-and-check; every other round in reverse order), and each path's
figure in a repeat is the median of its rounds (one push of a few milliseconds is easily caught
by another process's burst on a shared 2-core machine, and the median is taken the same way for
both sides of every ratio). After each round the plain copy runs once more: that copy against the
round's copy is an A/A control, the ratio the host's noise alone gives. Each figure is min /
median / max over --runs repeats and a goal is met only when the worst repeat meets it.
"Per request" is the time to move one prompt's K/V once, end to end (reservation excluded).
JSON and a PNG under benchmarks/results/. With --kv-cache-dtype bfloat16 (or float16) every worker
keeps a 16-bit KV cache under the float32 model, and every path moves half the bytes; such a
run writes files of its own (`kv_transfer_bfloat16*`) and never the section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from kv_transfer_report import SMALL_PROMPT, markdown, plot  # noqa: E402
from report import Goal, Spread, machine, update_section  # noqa: E402

from pdserve.engine.disagg import read_kv, write_kv  # noqa: E402
from pdserve.serving.kv_transfer import KVData, KVHeader, KVTrailer  # noqa: E402
from pdserve.engine import kv_copy  # noqa: E402
from pdserve.engine.kv_copy import crc32c, rows_crc32c  # noqa: E402
from pdserve.serving.kv_transfer.dist import DistTransport  # noqa: E402
from pdserve.serving.kv_transfer.grpc_transport import GrpcTransport  # noqa: E402
from pdserve.serving.kv_transfer.shm import KVArena, PeerSegments, copy_runs, slot_runs  # noqa: E402
from pdserve.serving.kv_transfer.shm_transport import ShmTransport  # noqa: E402
from pdserve.engine.disagg import KVGroupLayout, raw_layer  # noqa: E402
from pdserve.prefill_worker.kv_sender import host_chunks  # noqa: E402
from pdserve.serving.allocator import keep_freed_memory  # noqa: E402
from pdserve.v1 import generation_pb2 as gen  # noqa: E402
from pdserve.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
BLOCK_SIZE = 16
LOOP = asyncio.new_event_loop()  # one loop for every push: a grpc.aio channel stays on the loop it began on


# ---- 1 and 2: pushes into a real decode worker -----------------------------------------------
def _tcp_server(port_q, shape, num_layers, dtype_name):
    """Raw TCP into a KV cache like the decode worker's: per layer, recv the K/V bytes, write_kv them."""
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    cache = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(num_layers)]
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port_q.put(srv.getsockname()[1])
    while True:
        conn, _ = srv.accept()
        with conn:
            num_tokens, layer_bytes = (int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little") for _ in range(2))
            slots = torch.arange(num_tokens)
            buf = bytearray(layer_bytes)
            view = memoryview(buf)
            for layer in range(num_layers):
                got = 0
                while got < layer_bytes:
                    got += conn.recv_into(view[got:], layer_bytes - got)
                write_kv(cache, layer, slots, buf)
            conn.sendall(b"k")


def tcp_seconds(port: int, cache, slots: torch.Tensor) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = time.perf_counter()
        layer_bytes = 2 * len(slots) * cache[0][0][0, 0].nbytes
        s.sendall(len(slots).to_bytes(8, "little") + layer_bytes.to_bytes(8, "little"))
        for layer in range(len(cache)):
            s.sendall(read_kv(cache, layer, slots))
        assert s.recv(1) == b"k"
        return time.perf_counter() - t


def kv_dtype_name(info: worker_pb2.WorkerInfo) -> str:
    """The worker's KV cache dtype ("float32", "bfloat16", ...), which a push's header names."""
    return info.kv_dtype or info.dtype


class Pusher:
    """Reservations on a real decode worker, and pushes into them."""

    def __init__(self, address: str, prompt: list[int]):
        self.address, self.prompt, self.n = address, prompt, 0
        self.channel = grpc.insecure_channel(address)
        self.stub = worker_pb2_grpc.DecodeWorkerStub(self.channel)
        self.info = self.stub.GetInfo(worker_pb2.InfoRequest(), timeout=10)

    def reserve(self):
        """A reservation for the whole prompt: its first token is this reservation's own, or the
        decode worker would adopt the blocks an earlier push filled (its prefix cache) and take
        only the K/V after them."""
        self.n += 1
        prompt = [3 + (self.prompt[0] + self.n) % 500, *self.prompt[1:]]
        work = worker_pb2.WorkRequest(req_id=f"kv-{self.n}", prompt_token_ids=prompt,
                                      sampling_params=gen.SamplingParams(temperature=0, max_tokens=1, seed=1))
        stream = self.stub.Decode(work, timeout=120)
        event = next(stream)
        assert event.WhichOneof("event") == "admitted", event
        assert event.admitted.num_cached_tokens == 0, event
        return stream, event.admitted.ticket

    def header(self, ticket: str) -> KVHeader:
        return KVHeader(ticket, len(self.prompt), kv_dtype_name(self.info), tuple(
            KVGroupLayout(g.name, g.num_layers, g.num_kv_heads, g.head_dim) for g in self.info.kv_groups))

    def push_seconds(self, transport, messages) -> float:
        """One push of `messages` (or of what `messages()` returns, made inside the timing: the
        gRPC path's copy out of the cache, as the TCP path's `read_kv` is timed too)."""
        stream, ticket = self.reserve()

        async def go():
            t = time.perf_counter()
            msgs = [self.header(ticket), *(messages() if callable(messages) else messages)]

            async def gen_():
                for m in msgs:
                    yield m
            ack = await transport.push(self.address, gen_(), 120)
            assert ack.num_chunks == len(msgs) - 2, ack  # every data chunk (not the header, nor the trailer)
            return time.perf_counter() - t, ack

        dt, ack = LOOP.run_until_complete(go())
        list(stream)  # the one decode step; the reservation ends
        return dt


def grpc_messages(cache, slots, max_chunk_bytes: int) -> list:
    """What `KVSender.send_rows` queues: per layer, chunks checksummed where the rows lie and
    copied once, into their gRPC messages (`host_chunks`); then the trailer."""
    out, runs = [], slot_runs(slots.numpy())
    for layer in range(len(cache)):
        out += host_chunks(len(out), 0, layer, 0, runs, *raw_layer(cache, layer), max_chunk_bytes)
    return out + [KVTrailer(len(out), 1)]


def grpc_messages_copied(cache, slots, max_chunk_bytes: int) -> list:
    """The same chunks built as the prefill worker built them before `host_chunks`: `read_kv`
    gathers a layer, each chunk is checksummed (and copied out if the layer is split), and
    the transport then copies every chunk into its gRPC message."""
    out = []
    for layer in range(len(cache)):
        kv = read_kv(cache, layer, slots)
        step = max(1, max_chunk_bytes // (2 * kv[0, 0].nbytes))
        for s in range(0, kv.shape[1], step):
            part = kv if step >= kv.shape[1] else np.ascontiguousarray(kv[:, s:s + step])
            out.append(KVData(len(out), 0, layer, s, part.shape[1], memoryview(part).cast("B"), crc32c(part)))
    return out + [KVTrailer(len(out), 1)]


def shm_messages(cache, slots) -> list:
    """What `KVSender.send_slots` queues: per layer, the slots and their CRC-32C."""
    runs = slot_runs(slots.numpy())
    flat = tuple(x for r in runs for x in r)
    out = [KVData(layer, 0, layer, 0, len(slots), b"", rows_crc32c(*raw_layer(cache, layer), runs), flat)
           for layer in range(len(cache))]
    return out + [KVTrailer(len(out), 1)]


def dist_messages(cache, slots) -> list:
    """What `KVSender.send_refs` queues: per layer, the slots (the transport reads and sums them)."""
    runs = slot_runs(slots.numpy())
    flat = tuple(x for r in runs for x in r)
    return [KVData(layer, 0, layer, 0, len(slots), b"", 0, flat) for layer in range(len(cache))] + [
        KVTrailer(len(cache), 1)]


def bench_paths(args, model: Path, procs, bar) -> dict:
    prompt = [(7 * i) % 500 + 3 for i in range(args.prompt_tokens)]
    num_blocks = -(-args.prompt_tokens // BLOCK_SIZE) * 2 + 8
    worker = ["--num-threads", "1", "--num-kv-blocks", str(num_blocks), "--no-prefix-caching", "--no-warmup",
              "--max-num-batched-tokens", str(max(2048, args.prompt_tokens)), "--kv-cache-dtype", args.kv_cache_dtype]
    d_grpc = procs.start("decode-worker", *worker, "--no-kv-shm")
    d_shm = procs.start("decode-worker", *worker)
    procs.wait([d_grpc, d_shm])
    grpc_push, shm_push = Pusher(d_grpc, prompt), Pusher(d_shm, prompt)
    small_push = Pusher(d_shm, prompt[:SMALL_PROMPT])  # the control path's own cost
    g = grpc_push.info.kv_groups[0]
    assert len(grpc_push.info.kv_groups) == 1, "the benchmark model has no draft"
    shape = (num_blocks, BLOCK_SIZE, g.num_kv_heads, g.head_dim)
    dtype = getattr(torch, kv_dtype_name(grpc_push.info))
    kv_copy.prepare(torch.device("cpu"))  # the native copies, as the workers load them
    arena = KVArena()
    src = arena(g.num_layers, shape, dtype, torch.device("cpu"))  # the prefill side's cache, in /dev/shm
    for k, v in src:
        k.normal_(), v.normal_()
    slots = torch.arange(BLOCK_SIZE * 4, BLOCK_SIZE * 4 + args.prompt_tokens)  # a sequence's blocks
    nbytes = 2 * g.num_layers * args.prompt_tokens * src[0][0][0, 0].nbytes
    q = mp.Queue()
    tcp = mp.Process(target=_tcp_server, args=(q, shape, g.num_layers, kv_dtype_name(grpc_push.info)), daemon=True)
    tcp.start()
    tcp_port = q.get(timeout=30)
    flat_src = torch.empty(nbytes, dtype=torch.uint8)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8)
    flat_src.random_(0, 255)
    grpc_t = GrpcTransport()
    shm_t = ShmTransport(arena, GrpcTransport(), lambda group, layer: raw_layer(src, layer))
    dist_t = DistTransport(GrpcTransport(), lambda group: src, lambda: "127.0.0.1")
    try:
        grpc_push.push_seconds(grpc_t, grpc_messages(src, slots, args.max_chunk_bytes))  # warm up all three
        shm_push.push_seconds(shm_t, shm_messages(src, slots))
        grpc_push.push_seconds(dist_t, dist_messages(src, slots))  # and make the group
        assert dist_t.num_dist_pushes == 1, "the decode worker took no K/V over gloo"
        tcp_seconds(tcp_port, src, slots)
        assert shm_t.num_shm_pushes == 1, "the decode worker's probe could not be opened: no shared memory"
        peer = PeerSegments().open(arena.names[0], g.num_layers, arena.num_slots, shape[2:],
                                   raw_layer(src, 0)[0].dtype)  # what the decode worker maps
        dst = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(g.num_layers)]
        dst_slots = slots.numpy() + len(slots)  # elsewhere in the cache, consecutive, as the pushes' reservations get
        src_runs = slot_runs(slots.numpy())
        small_push.push_seconds(shm_t, shm_messages(src, slots[:SMALL_PROMPT]))
        def copy_seconds() -> float:
            t = time.perf_counter()
            flat_dst.copy_(flat_src)
            return time.perf_counter() - t

        def shm_copy_seconds() -> float:
            t = time.perf_counter()
            for layer in range(g.num_layers):
                copy_runs(src_runs, dst_slots, peer.layers[layer], raw_layer(dst, layer))
            return time.perf_counter() - t

        paths = {"grpc": lambda: grpc_push.push_seconds(grpc_t, lambda: grpc_messages(src, slots,
                                                                                   args.max_chunk_bytes)),
                 "grpc_copied": lambda: grpc_push.push_seconds(grpc_t, lambda: grpc_messages_copied(
                     src, slots, args.max_chunk_bytes)),
                 "tcp": lambda: tcp_seconds(tcp_port, src, slots),
                 "dist": lambda: grpc_push.push_seconds(dist_t, dist_messages(src, slots)),
                 "shm": lambda: shm_push.push_seconds(shm_t, shm_messages(src, slots)),
                 "shm_small": lambda: small_push.push_seconds(shm_t, shm_messages(src, slots[:SMALL_PROMPT])),
                 "copy": copy_seconds, "shm_copy": shm_copy_seconds}
        runs = {k: [] for k in (*paths, "copy_again")}
        for rep in range(args.runs):
            inner = {k: [] for k in runs}
            for i in range(args.inner):  # rounds back to back, the order reversed every other one
                names = list(paths) if (rep + i) % 2 == 0 else list(paths)[::-1]
                threads = torch.get_num_threads()
                for name in names:
                    # like for like: the decode worker copies on one thread (torch would use every core)
                    torch.set_num_threads(1 if name in ("copy", "shm_copy") else threads)
                    inner[name].append(paths[name]())
                    torch.set_num_threads(threads)
                # the A/A control: the same copy again, right after the round
                torch.set_num_threads(1)
                inner["copy_again"].append(copy_seconds())
                torch.set_num_threads(threads)
            for name, xs in inner.items():
                runs[name].append(statistics.median(xs))
            bar.update(1)
    finally:
        tcp.kill()
        arena.close()
    ratio = lambda a, b: Spread.of(runs[b][i] / runs[a][i] for i in range(args.runs))  # noqa: E731
    return dict(kv_bytes=nbytes, prompt_tokens=args.prompt_tokens, layers=g.num_layers,
                kv_dtype=kv_dtype_name(grpc_push.info), kv_row_elements=g.num_kv_heads * g.head_dim,
                seconds={k: Spread.of(v).as_dict() for k, v in runs.items()},
                gbps={k: Spread.of(nbytes / x / 1e9 for x in v).as_dict() for k, v in runs.items()},
                grpc_vs_tcp=Goal("production gRPC push / raw TCP (speed)", ratio("grpc", "tcp"), 0.5, True).as_dict(),
                shm_vs_copy=Goal("shared-memory push / plain memory copy (speed)", ratio("shm", "copy"), 0.8,
                                 True).as_dict(),
                shm_copy_vs_copy=ratio("shm_copy", "copy").as_dict(), copy_a_a=ratio("copy_again", "copy").as_dict(),
                grpc_vs_copied=ratio("grpc", "grpc_copied").as_dict(), dist_vs_tcp=ratio("dist", "tcp").as_dict(),
                inner=args.inner)


# ---- 2 and 3: real processes -------------------------------------------------------------------
def build_model(path: Path, layers: int, hidden: int) -> None:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                                   vocab_size=512, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


class Procs:
    def __init__(self, model: Path, logs: Path):
        self.model, self.logs, self.procs = model, logs, []

    def start(self, command: str, *args: str) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(self.logs / f"{command}-{port}.log", "w")
        self.procs.append(subprocess.Popen([str(Path(sys.executable).with_name("pdserve")), command, "--model", str(self.model),
                                            "--port", str(port), *args], cwd=REPO, stdout=log, stderr=log))
        return f"127.0.0.1:{port}"

    def wait(self, addresses: list[str], timeout_s: float = 180) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        for a in addresses:
            with grpc.insecure_channel(a) as ch:
                while True:
                    try:
                        if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{a} not serving")
                    time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def ttft(router: str, prompt: list[int], i: int) -> float:
    with grpc.insecure_channel(router) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[(prompt[0] + i) % 512, *prompt[1:]]),
                                  sampling_params=gen.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        grpc.channel_ready_future(ch).result(timeout=10)
        t = time.perf_counter()
        stream = stub.Generate(req, timeout=60)
        next(stream)
        dt = time.perf_counter() - t
        list(stream)
    return dt


def bench_ttft(args, model: Path, procs, bar) -> dict:
    # like with like: every worker gets the same threads and the same step token budget
    worker = ["--num-threads", str(args.threads), "--num-kv-blocks", "512", "--no-prefix-caching",
              "--max-num-batched-tokens", str(max(2048, args.prompt_tokens)), "--kv-cache-dtype", args.kv_cache_dtype]
    p = procs.start("prefill-worker", *worker)
    d = procs.start("decode-worker", *worker)
    d2 = procs.start("decode-worker", *worker)
    procs.wait([p, d, d2])
    r = procs.start("router", "--prefill", p, "--decode", d)
    r2 = procs.start("router", "--decode", d2)
    procs.wait([r, r2])
    prompt = [(7 * i) % 500 + 3 for i in range(args.prompt_tokens)]
    ttft(r, prompt, 10_000), ttft(r2, prompt, 10_000)  # warm up
    # a repeat is --inner requests of each side, alternating (every other round the colocated one
    # first), and its figure each side's median, as parts 1 and 2 take theirs: one 2048-token
    # prefill a side per repeat gave 0.85 / 1.21 / 1.38x over 7 repeats, the host's noise more
    # than the path's (the colocated request run again: the A/A control)
    pd, co, aa = [], [], []
    for i in range(args.runs):
        rounds: dict[str, list[float]] = {"pd": [], "co": [], "aa": []}
        for j in range(args.inner):
            prompt_id = i * args.inner + j
            order = [("pd", r), ("co", r2)] if j % 2 == 0 else [("co", r2), ("pd", r)]
            for name, router in [*order, ("aa", r2)]:
                rounds[name].append(ttft(router, prompt, prompt_id))
        pd.append(statistics.median(rounds["pd"]))
        co.append(statistics.median(rounds["co"]))
        aa.append(statistics.median(rounds["aa"]))
        bar.update(1)
    return dict(prompt_tokens=args.prompt_tokens, inner=args.inner, disagg_s=Spread.of(pd).as_dict(),
                colocated_s=Spread.of(co).as_dict(), a_a=Spread.of(a / b for a, b in zip(aa, co)).as_dict(),
                ratio=Goal("TTFT disaggregated / colocated", Spread.of(a / b for a, b in zip(pd, co)), 1.10,
                           False).as_dict())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--inner", type=int, default=5,
                    help="rounds of every path back to back per repeat; a repeat's figure is their median")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-chunk-bytes", type=int, default=4 << 20, help="as the prefill worker's default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-ttft", action="store_true", help="parts 1 and 2 only")
    ap.add_argument("--quick", action="store_true", help="small sizes, 5 runs (a smoke run)")
    ap.add_argument("--markdown", action="store_true", help="rewrite the KV transfer section of BENCHMARKS.md")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float16"),
                    help="every worker's KV cache (auto: the model's, float32)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and PNG go")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.layers, args.prompt_tokens = 5, 4, 512
    keep_freed_memory()  # as a worker process does (`serve_worker`): this process is the pushes' prefill side
    result = dict(command=" ".join(["python", "benchmarks/kv_transfer.py", *sys.argv[1:]]), args=vars(args),
                  machine=machine())
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=args.runs * (1 if args.skip_ttft else 2),
                                                    desc="kv_transfer", unit="run") as bar:
        model = Path(tmp) / "model"
        build_model(model, args.layers, args.hidden)
        procs = Procs(model, Path(tmp))
        try:
            result["paths"] = bench_paths(args, model, procs, bar)
            procs.stop()
            procs.procs = []
            result["ttft"] = None if args.skip_ttft else bench_ttft(args, model, procs, bar)
        finally:
            procs.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    # a smoke run, or one without the TTFT part, leaves the full run's files alone
    narrow = "" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}"
    stem = "kv_transfer" + narrow + ("_paths" if args.skip_ttft else "") + ("_quick" if args.quick else "")
    result["stem"] = stem
    out = args.out.resolve()
    result["out_dir"] = str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out)
    (args.out / f"{stem}.json").write_text(json.dumps(result, default=str, indent=2))
    plot(result, args.out / f"{stem}.png")
    text = markdown(result)
    print(text)
    if args.markdown and (args.skip_ttft or narrow):
        print("not rewriting BENCHMARKS.md: the section is the float32 cache's, with the TTFT part", file=sys.stderr)
    elif args.markdown:
        update_section(REPO / "BENCHMARKS.md", "KV transfer (`benchmarks/kv_transfer.py`)", text)


if __name__ == "__main__":
    main()
