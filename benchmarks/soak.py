"""Soak: many requests against `pdserve serve`, a fifth of them cancelled by their clients, and a
worker killed with -9 every --kill-every requests (prefill and decode in turn).

    python benchmarks/soak.py [--requests 10000] [--kill-every 1000] [--concurrency 16]

Goals: zero requests lost (every one ends with its tokens, its client's cancellation, or an
explicit status); every KV pool fully free at idle; the router's resident memory and open file
descriptors flat (their slope over the run, by least squares, is reported), and each worker's
between restarts. Writes benchmarks/results/soak.json and .png and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil
from tqdm import tqdm

from pdserve.cluster.local import PDSERVE, LocalProcess
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:\n    def __init__(self", "for i in range(",
           "with open(path) as f:", "return sorted(", "try:\n    import json", "if __name__ == '__main__':"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--kill-every", type=int, default=1000)
    ap.add_argument("--cancel-share", type=float, default=0.2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        system = start(Path(tmp))
        try:
            outcome = asyncio.run(soak(system, args))
            outcome["blocks_held_at_idle"] = held_blocks(system)
        finally:
            system["proc"].stop(120)
    report(args, outcome)


def start(tmp: Path) -> dict:
    token = tmp / "token"
    token.write_text("soak-cluster-secret-0123456789\n")
    config = tmp / "soak.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "prefill": {"workers": 1, "cpus": 0.5}, "decode": {"workers": 2, "cpus": 0.5},
        "router": {"grpc_port": 0, "http_port": 0, "drain_timeout": 5, "health_interval": 0.5, "failover_wait": 60},
        "security": {"cluster_token_file": str(token)}}))
    env = {"PDSERVE_RUNTIME_DIR": str(tmp)}
    proc = LocalProcess("soak", "serve", ["--config", str(config)], tmp / "serve.log", env=env).start()
    proc.wait_ready(300)
    return {"proc": proc, "env": {**os.environ, **env}, "token": token.read_text().strip()}


def workers(system: dict) -> list[dict]:
    out = subprocess.run([PDSERVE, "status", "--json"], env=system["env"], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)["workers"]


async def soak(system: dict, args) -> dict:
    rng = random.Random(args.seed)
    ends, details = collections.Counter(), collections.Counter()
    samples, kills = [], []
    router = psutil.Process(system["proc"].popen.pid)
    sem = asyncio.Semaphore(args.concurrency)
    bar = tqdm(total=args.requests, desc="soak", unit="req")
    async with grpc.aio.insecure_channel(system["proc"].address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            async with sem:
                ends[await request(stub, i, rng.random() < args.cancel_share, rng, args.max_tokens, details)] += 1
                bar.update(1)
                samples.append((time.monotonic(), router.memory_info().rss, router.num_fds()))
                if (i + 1) % args.kill_every == 0 and i + 1 < args.requests:
                    kills.append(await asyncio.to_thread(kill_one, system, len(kills)))

        await asyncio.gather(*(one(i) for i in range(args.requests)))
    bar.close()
    return {"ends": dict(ends), "status_details": dict(details.most_common(10)), "kills": kills, "router_samples": samples}


async def request(stub, i: int, cancel: bool, rng: random.Random, max_tokens: int,
                  details: collections.Counter) -> str:
    req = gen.GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], sampling_params=gen.SamplingParams(
        temperature=rng.choice([0.0, 0.8]), max_tokens=max_tokens, seed=i, ignore_eos=True))
    call = stub.Generate(req, timeout=300)
    cut = rng.randint(1, max_tokens) if cancel else None
    n = 0
    try:
        async for msg in call:
            n += len(msg.token_ids)
            if cut is not None and n >= cut:
                call.cancel()
                return "cancelled by its client"
            if msg.finish_reason:
                return "finished" if n == max_tokens else f"finished short ({n} tokens)"
        return "LOST: stream ended without finishing"
    except grpc.aio.AioRpcError as e:
        details[f"{e.code().name}: {_shape_of(e.details() or '')}"] += 1
        return f"status {e.code().name}"
    except asyncio.CancelledError:
        return "cancelled by its client"


def _shape_of(details: str) -> str:
    """A status's details with addresses, ids and numbers blanked, so alike failures count together."""
    details = re.sub(r"\b[0-9a-f]{16,}\b", "<id>", details)
    return re.sub(r"\d+(\.\d+)*", "<n>", details)[:300]


def kill_one(system: dict, k: int) -> dict:
    """kill -9 of a live worker of the role whose turn it is (the registry may still list one
    killed before that has not registered again: it is skipped, and the list asked again)."""
    role = ("decode", "prefill")[k % 2]
    deadline = time.monotonic() + 120
    while True:
        for victim in (w for w in workers(system) if w["role"] == role):
            try:
                os.kill(victim["pid"], signal.SIGKILL)
            except ProcessLookupError:
                continue
            return {"at": time.monotonic(), "worker": victim["worker_id"], "pid": victim["pid"]}
        if time.monotonic() > deadline:
            raise RuntimeError(f"no live {role} worker to kill for 120 s")
        time.sleep(1)


def held_blocks(system: dict) -> dict:
    """Per worker, once idle: KV blocks and sequences still held (0 everywhere is the goal)."""
    deadline, held = time.monotonic() + 120, {}
    md = (("pdserve-cluster-token", system["token"]),)
    while time.monotonic() < deadline:
        held = {}
        for w in workers(system):
            stub = (worker_pb2_grpc.DecodeWorkerStub if w["role"] == "decode" else worker_pb2_grpc.PrefillWorkerStub)
            with grpc.insecure_channel(w["address"]) as channel:
                try:
                    s = stub(channel).GetStats(worker_pb2.StatsRequest(), timeout=10, metadata=md)
                except grpc.RpcError as e:  # a worker killed last is still restarting: ask again
                    held[w["worker_id"]] = f"not answering yet ({e.code().name})"
                    continue
            held[w["worker_id"]] = s.num_blocks - s.num_free_blocks + s.num_reserved + s.num_running + s.num_waiting
        if not any(held.values()):
            break
        time.sleep(1)
    return held


def slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of value over time (per hour)."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt, mv = sum(t for t, _ in samples) / n, sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 3600 * sum((t - mt) * (v - mv) for t, v in samples) / var if var else 0.0


def report(args, outcome: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    s = outcome["router_samples"]
    warm = s[len(s) // 10:]  # after the first tenth: allocators and caches warmed up
    rss_slope = slope([(t, r / 2**20) for t, r, _ in warm])
    fd_slope = slope([(t, f) for t, _, f in warm])
    lost = sum(n for end, n in outcome["ends"].items() if end.startswith("LOST"))
    out = {"command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]), "args": vars(args), "ends": outcome["ends"],
           "status_details": outcome["status_details"], "lost": lost, "kills": outcome["kills"],
           "blocks_held_at_idle": outcome["blocks_held_at_idle"],
           "router_rss_mib_per_hour": rss_slope, "router_fds_per_hour": fd_slope,
           "router_rss_mib": [s[0][1] / 2**20, s[-1][1] / 2**20], "router_fds": [s[0][2], s[-1][2]]}
    (RESULTS / "soak.json").write_text(json.dumps(out, indent=1) + "\n")
    _plot(outcome)
    print(f"\nCommand: `{out['command']}`\n")
    print("| requests | cancelled by clients | workers killed (-9) | lost | blocks held at idle | router RSS slope | "
          "router open fds slope |")
    print("|---|---|---|---|---|---|---|")
    cancelled = outcome["ends"].get("cancelled by its client", 0)
    print(f"| {args.requests} | {cancelled} | {len(outcome['kills'])} | {lost} | "
          f"{sum(v if isinstance(v, int) else 10**9 for v in outcome['blocks_held_at_idle'].values())} | {rss_slope:+.1f} MiB/h | {fd_slope:+.1f} /h |")
    print("\n| how requests ended | count |\n|---|---|")
    for end, n in sorted(outcome["ends"].items()):
        print(f"| {end} | {n} |")
    if outcome["status_details"]:
        print("\n| status details (numbers blanked), most common first | count |\n|---|---|")
        for what, n in outcome["status_details"].items():
            print(f"| {what.replace('|', '/')} | {n} |")


def _plot(outcome: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = outcome["router_samples"]
    t0 = s[0][0]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot([t - t0 for t, _, _ in s], [r / 2**20 for _, r, _ in s])
    a.set_ylabel("router RSS (MiB)")
    b.plot([t - t0 for t, _, _ in s], [f for _, _, f in s])
    b.set_ylabel("router open fds")
    b.set_xlabel("seconds")
    for k in outcome["kills"]:
        for ax in (a, b):
            ax.axvline(k["at"] - t0, color="red", alpha=0.3)
    a.set_title("pdserve soak: the router over the run (red: a worker killed with -9)")
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=120)


if __name__ == "__main__":
    main()
