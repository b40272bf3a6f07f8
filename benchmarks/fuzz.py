"""Fuzzing the public APIs at length: tens of thousands of hostile requests against real
processes (a prefill worker, a decode worker, a router with the OpenAI API), built by the same
strategies as the test suite's fuzz tests (`tests/disagg/fuzz_cases.py`).

    python benchmarks/fuzz.py [--grpc 4000] [--wire 3000] [--http 3000]

Goal: zero server errors (gRPC UNKNOWN / INTERNAL / UNAVAILABLE, HTTP 5xx), zero tracebacks in
any process's log, and afterwards the system healthy and holding no KV block. Writes
benchmarks/results/fuzz.json and .png and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc
from hypothesis import HealthCheck, given, settings
from tqdm import tqdm

from launcher import Launcher

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "disagg"))  # the strategies live beside the fuzz tests
from fuzz_cases import GOOD_CODES, GOOD_HTTP, generate_requests, http_bodies, raw_requests, send_grpc, send_http  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MODEL = str(REPO / "models" / "demo")
TOKEN = "fuzz-cluster-secret-0123456789"


def fuzz(kind: str, strategy, n: int, send, tally: collections.Counter, bad: list) -> None:
    bar = tqdm(total=n, desc=kind, unit="req")

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=strategy)
    def run(case):
        for outcome, ok in send(case):
            tally[(kind, outcome)] += 1
            if not ok:
                bad.append((kind, outcome, repr(case)[:300]))
        bar.update(1)

    run()
    bar.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grpc", type=int, default=4000, help="requests built from the proto's fields")
    ap.add_argument("--wire", type=int, default=3000, help="mangled wire bytes")
    ap.add_argument("--http", type=int, default=3000, help="OpenAI JSON bodies (each sent to both endpoints)")
    args = ap.parse_args()
    tally, bad = collections.Counter(), []
    with tempfile.TemporaryDirectory() as logs, Launcher(Path(logs)) as run:
        env = {"PDSERVE_CLUSTER_TOKEN": TOKEN}
        p = run.worker("prefill-worker", "P", ["--model", MODEL], None, env)
        d = run.worker("decode-worker", "D", ["--model", MODEL], None, env)
        r = run.router("R", MODEL, [p], [d], env=env)
        run.wait_ready()
        start = time.monotonic()
        with grpc.insecure_channel(r.address) as channel:
            def grpc_send(case):
                code = send_grpc(channel, case)
                return [(code.name, code in GOOD_CODES)]

            def http_send(body):
                return [(f"{path} {status}", status in GOOD_HTTP) for path in ("/v1/completions", "/v1/chat/completions")
                        for status in [send_http(r.http_address, path, body)]]

            fuzz("grpc fields", generate_requests(), args.grpc, grpc_send, tally, bad)
            fuzz("wire bytes", raw_requests(), args.wire, grpc_send, tally, bad)
            fuzz("http bodies", http_bodies(), args.http, http_send, tally, bad)
        seconds = time.monotonic() - start
        tracebacks = {proc.name: proc.log.read_text().count("Traceback") for proc in run.procs}
        healthy = _still_serves(r.address)
    report(args, tally, bad, tracebacks, healthy, seconds)


def _still_serves(address: str) -> bool:
    from pdserve.v1 import generation_pb2 as gen
    from pdserve.v1 import generation_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        msgs = list(generation_pb2_grpc.GenerationStub(channel).Generate(gen.GenerateRequest(
            prompt="def f():", sampling_params=gen.SamplingParams(temperature=0, max_tokens=4)), timeout=60))
    return msgs[-1].finish_reason == gen.LENGTH


def report(args, tally: collections.Counter, bad: list, tracebacks: dict, healthy: bool, seconds: float) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    total = sum(tally.values())
    out = {"command": "python benchmarks/fuzz.py " + " ".join(sys.argv[1:]), "cases": vars(args), "answers": total,
           "seconds": seconds, "by_outcome": {f"{k} | {o}": n for (k, o), n in sorted(tally.items())},
           "server_errors": len(bad), "examples_of_server_errors": bad[:20], "tracebacks": tracebacks,
           "healthy_after": healthy}
    (RESULTS / "fuzz.json").write_text(json.dumps(out, indent=1) + "\n")
    _plot(tally)
    print(f"\nCommand: `{out['command']}`\n")
    print("| what | answers | server errors (UNKNOWN, INTERNAL, UNAVAILABLE, 5xx) | tracebacks in logs | serves after |")
    print("|---|---|---|---|---|")
    print(f"| {args.grpc} field-built gRPC requests, {args.wire} mangled wire messages, {args.http} OpenAI bodies "
          f"(each to both endpoints) | {total} | {len(bad)} | {sum(tracebacks.values())} | {'yes' if healthy else 'NO'} |")
    print("\n| kind | answer | count |\n|---|---|---|")
    for (kind, outcome), n in sorted(tally.items()):
        print(f"| {kind} | {outcome} | {n} |")


def _plot(tally: collections.Counter) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{k}: {o}" for k, o in sorted(tally)]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(labels) + 1.5))
    ax.barh(labels, [tally[k] for k in sorted(tally)])
    ax.set_xlabel("answers")
    ax.set_title("pdserve fuzzing: every answer by kind")
    fig.tight_layout()
    fig.savefig(RESULTS / "fuzz.png", dpi=120)


if __name__ == "__main__":
    main()
