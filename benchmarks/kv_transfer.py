"""KV transfer over gRPC, measured side by side in one run (this machine is shared and noisy).

    python benchmarks/kv_transfer.py [--quick]

1. Throughput: the PushKV framing (KVChunk messages of --chunk-mib, crc32 checked on arrival)
   over gRPC on loopback, against a plain TCP socket moving the same bytes. Goal: >= 0.5.
2. Overlap: a real prefill worker pushing a long prompt's KV to a real decode worker, layer by
   layer. The worker reports how long the push ran on after the first token was sampled (the
   tail, the part of the transfer not hidden); transfer alone = the KV bytes at the gRPC rate of
   part 1; hidden share = 1 - tail / transfer alone.
3. TTFT at low load (one request at a time) through a router: disaggregated (prefill worker ->
   decode worker) against colocated (decode worker alone). Goal: <= 1.10.

Medians of --runs runs; JSON and a PNG under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent import futures
from pathlib import Path

import grpc
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]

from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.serving.grpc_server import CHANNEL_OPTIONS, KV_TRANSFER_OPTIONS

OPTIONS = CHANNEL_OPTIONS + KV_TRANSFER_OPTIONS  # what the workers use for PushKV

RESULTS = REPO / "benchmarks" / "results"


# ---- 1. throughput ---------------------------------------------------------------------------
class _Sink(worker_pb2_grpc.DecodeWorkerServicer):
    def PushKV(self, request_iterator, context):
        n = num = 0
        for chunk in request_iterator:
            if chunk.WhichOneof("part") == "data":
                assert zlib.crc32(chunk.data.data) == chunk.data.crc32
                n += len(chunk.data.data)
                num += 1
        return worker_pb2.PushKVResponse(num_chunks=num, num_bytes=n)


def _grpc_server(port_q):
    server = grpc.server(futures.ThreadPoolExecutor(4), options=OPTIONS)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Sink(), server)
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _tcp_server(port_q):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port_q.put(srv.getsockname()[1])
    buf = bytearray(4 << 20)
    while True:
        conn, _ = srv.accept()
        with conn:
            total = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
            got = 0
            while got < total:
                got += conn.recv_into(buf, min(len(buf), total - got))
            conn.sendall(b"k")


def _spawn(target) -> tuple[mp.Process, int]:
    q = mp.Queue()
    p = mp.Process(target=target, args=(q,), daemon=True)
    p.start()
    return p, q.get(timeout=30)


def grpc_seconds(port: int, payload: bytes, num_chunks: int) -> float:
    crc = zlib.crc32(payload)

    def chunks():
        yield worker_pb2.KVChunk(header=worker_pb2.KVHeader(transfer_id="bench"))
        for i in range(num_chunks):
            yield worker_pb2.KVChunk(data=worker_pb2.KVData(seq=i, data=payload, crc32=crc))
        yield worker_pb2.KVChunk(trailer=worker_pb2.KVTrailer(num_chunks=num_chunks))

    with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        grpc.channel_ready_future(ch).result(timeout=10)
        t = time.perf_counter()
        ack = stub.PushKV(chunks(), timeout=300)
        dt = time.perf_counter() - t
    assert ack.num_bytes == len(payload) * num_chunks
    return dt


def tcp_seconds(port: int, payload: bytes, num_chunks: int) -> float:
    with socket.create_connection(("127.0.0.1", port)) as s:
        t = time.perf_counter()
        s.sendall((len(payload) * num_chunks).to_bytes(8, "little"))
        for _ in range(num_chunks):
            s.sendall(payload)
        assert s.recv(1) == b"k"
        return time.perf_counter() - t


def bench_throughput(total_mib: int, chunk_mib: float, runs: int, bar) -> dict:
    payload = bytes(range(256)) * int(chunk_mib * (1 << 20) / 256)
    num_chunks = max(1, int(total_mib / chunk_mib))
    nbytes = len(payload) * num_chunks
    gp, gport = _spawn(_grpc_server)
    tp, tport = _spawn(_tcp_server)
    g, t = [], []
    try:
        for _ in range(runs):
            g.append(nbytes / grpc_seconds(gport, payload, num_chunks) / 1e9)
            t.append(nbytes / tcp_seconds(tport, payload, num_chunks) / 1e9)
            bar.update(1)
    finally:
        gp.kill()
        tp.kill()
    gm, tm = statistics.median(g), statistics.median(t)
    return dict(bytes=nbytes, chunk_bytes=len(payload), grpc_gbps=gm, tcp_gbps=tm, ratio=gm / tm,
                grpc_runs=g, tcp_runs=t)


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


def prefill_with_push(p_addr: str, d_addr: str, prompt: list[int], i: int) -> worker_pb2.PrefillResponse:
    params = gen.SamplingParams(temperature=0, max_tokens=1, seed=1)
    work = worker_pb2.WorkRequest(req_id=f"ovl-{i}", prompt_token_ids=prompt, sampling_params=params)
    with grpc.insecure_channel(d_addr) as dch, grpc.insecure_channel(p_addr) as pch:
        stream = worker_pb2_grpc.DecodeWorkerStub(dch).Decode(work, timeout=60)
        next(stream)
        resp = worker_pb2_grpc.PrefillWorkerStub(pch).Prefill(worker_pb2.PrefillRequest(
            request=work, decode_address=d_addr, transfer_id=work.req_id), timeout=60)
        list(stream)
    return resp


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


def bench_processes(args, grpc_gbps: float, bar) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(model, args.layers, args.hidden)
        procs = Procs(model, Path(tmp))
        # like with like: every worker gets the same threads and the same step token budget
        worker = ["--num-threads", str(args.threads), "--num-kv-blocks", "512", "--no-prefix-caching",
                  "--max-num-batched-tokens", str(max(2048, args.prompt_tokens))]
        try:
            p = procs.start("prefill-worker", *worker)
            d = procs.start("decode-worker", *worker)
            d2 = procs.start("decode-worker", *worker)
            procs.wait([p, d, d2])
            r = procs.start("router", "--prefill", p, "--decode", d)
            r2 = procs.start("router", "--decode", d2)
            procs.wait([r, r2])
            prompt = [(7 * i) % 500 + 3 for i in range(args.prompt_tokens)]
            prefill_with_push(p, d, prompt, -1)  # warm up
            pushes = []
            for i in range(args.runs):
                pushes.append(prefill_with_push(p, d, [*prompt[:-1], (prompt[-1] + i + 1) % 512], i))
                bar.update(1)
            ttft_pd, ttft_co = [], []
            ttft(r, prompt, 10_000), ttft(r2, prompt, 10_000)  # warm up
            for i in range(args.runs):
                ttft_pd.append(ttft(r, prompt, i))
                ttft_co.append(ttft(r2, prompt, i))
                bar.update(1)
        finally:
            procs.stop()
    num_bytes = pushes[0].num_bytes
    prefill, tail = statistics.median(r.prefill_seconds for r in pushes), statistics.median(r.tail_seconds for r in pushes)
    transfer = num_bytes / (grpc_gbps * 1e9)
    hidden = max(0.0, min(1.0, 1 - tail / transfer))
    pd, co = statistics.median(ttft_pd), statistics.median(ttft_co)
    return dict(prompt_tokens=args.prompt_tokens, kv_bytes=num_bytes, prefill_s=prefill, tail_s=tail,
                transfer_alone_s=transfer, hidden_share=hidden, ttft_disagg_s=pd, ttft_colocated_s=co,
                ttft_ratio=pd / co, runs=dict(prefill=[r.prefill_seconds for r in pushes],
                                              tail=[r.tail_seconds for r in pushes], ttft_disagg=ttft_pd,
                                              ttft_colocated=ttft_co))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, o = result["throughput"], result["overlap_ttft"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(["gRPC PushKV", "raw TCP"], [t["grpc_gbps"], t["tcp_gbps"]], color=["tab:blue", "tab:gray"])
    axes[0].set_title(f"loopback throughput (GB/s), ratio {t['ratio']:.2f}")
    axes[1].bar(["prefill", "transfer alone", "exposed tail"],
                [o["prefill_s"] * 1e3, o["transfer_alone_s"] * 1e3, o["tail_s"] * 1e3],
                color=["tab:green", "tab:orange", "tab:blue"])
    axes[1].set_title(f"{o['prompt_tokens']}-token prompt (ms), hidden {o['hidden_share']:.0%}")
    axes[2].bar(["disaggregated", "colocated"], [o["ttft_disagg_s"] * 1e3, o["ttft_colocated_s"] * 1e3],
                color=["tab:blue", "tab:gray"])
    axes[2].set_title(f"TTFT at low load (ms), ratio {o['ttft_ratio']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 runs")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.total_mib, args.layers, args.prompt_tokens = 3, 64, 4, 512
    with tqdm(total=args.runs * 3, desc="kv_transfer", unit="run") as bar:
        throughput = bench_throughput(args.total_mib, args.chunk_mib, args.runs, bar)
        overlap = bench_processes(args, throughput["grpc_gbps"], bar)
    result = dict(command=" ".join(["python", "benchmarks/kv_transfer.py", *sys.argv[1:]]), args=vars(args),
                  throughput=throughput, overlap_ttft=overlap)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_transfer.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "kv_transfer.png")
    print(f"gRPC {throughput['grpc_gbps']:.2f} GB/s vs TCP {throughput['tcp_gbps']:.2f} GB/s: ratio "
          f"{throughput['ratio']:.2f} (goal >= 0.5)")
    print(f"layer-wise streaming hides {overlap['hidden_share']:.0%} of the transfer "
          f"(prefill {overlap['prefill_s'] * 1e3:.1f} ms, transfer alone {overlap['transfer_alone_s'] * 1e3:.1f} ms, "
          f"exposed tail {overlap['tail_s'] * 1e3:.1f} ms)")
    print(f"TTFT disaggregated {overlap['ttft_disagg_s'] * 1e3:.1f} ms vs colocated "
          f"{overlap['ttft_colocated_s'] * 1e3:.1f} ms: ratio {overlap['ttft_ratio']:.2f} (goal <= 1.10)")


if __name__ == "__main__":
    main()
