"""Recovery: how long a worker killed with -9 takes to serve again under `pdserve serve`, from the
kill until the router counts every worker of its pool healthy again
(`pdserve:router_healthy_workers`, read from the router's /metrics every 50 ms). Prefill and
decode workers are killed in turn, on an idle system with the default config (the demo pair, one
worker per pool).

    python benchmarks/recovery.py [--rounds 3] [--kills 4] [--baseline REV]

--baseline REV measures another revision's pdserve the same way, interleaved with this one round
by round (each round starts a fresh system of each, in alternating order): the revision is
exported with `git archive` into a temporary package that the serve process, its Ray and its
workers import before the installed one. Each round's figure is the median over its kills; the
ratio is this checkout's over the baseline's, per round, reported as min / median / max.

Writes benchmarks/results/recovery.json and .png and prints Markdown tables.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from report import export_revision
from tqdm import tqdm

from pdserve.cluster.local import PDSERVE, LocalProcess

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
HEALTHY = re.compile(r'^pdserve:router_healthy_workers\{[^}]*role="(\w+)"[^}]*\} ([0-9.e+-]+)$', re.M)
LOADED = re.compile(r"(prefill|decode) worker: loaded in ([0-9.]+) s")
POLL_S = 0.05


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kills", type=int, default=4, help="per system, prefill and decode in turn")
    ap.add_argument("--baseline", default=None, help="a git revision to measure beside this checkout")
    ap.add_argument("--timeout", type=float, default=120.0, help="for one worker to come back")
    args = ap.parse_args()
    if args.rounds < 1 or args.kills < 1:
        ap.error("--rounds and --kills must be >= 1")
    with tempfile.TemporaryDirectory(prefix="pdserve-recovery-") as tmp:
        arms = {"this checkout": {}}
        if args.baseline:
            arms[f"baseline {args.baseline}"] = {"PYTHONPATH": str(export_revision(args.baseline, Path(tmp) / "baseline"))}
        results: dict[str, list[dict]] = {arm: [] for arm in arms}
        bar = tqdm(total=args.rounds * len(arms) * args.kills, desc="kills", unit="kill")
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                run_dir = Path(tmp) / f"round{r}-{len(results[arm])}-{arm.split()[0]}"
                run_dir.mkdir()
                results[arm].append(measure(run_dir, arms[arm], args.kills, args.timeout, bar))
        bar.close()
    report(args, results)


def measure(run_dir: Path, env: dict, kills: int, timeout_s: float, bar) -> dict:
    env = {"PDSERVE_RUNTIME_DIR": str(run_dir), **env}
    log = run_dir / "serve.log"
    proc = LocalProcess("recovery", "serve", ["--grpc-port", "0", "--http-port", "0"], log, env=env).start()
    started = time.monotonic()
    try:
        proc.wait_ready(600)
        ready_s = time.monotonic() - started
        metrics = f"http://{proc.addresses['http']}/metrics"
        full = wait_full(metrics, None, timeout_s)
        out = []
        for k in range(kills):
            role = ("decode", "prefill")[k % 2]
            victim = next(w for w in status({**os.environ, **env}) if w["role"] == role)
            loaded_before = len(LOADED.findall(log.read_text(errors="replace")))
            killed = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            down = wait_until(metrics, lambda h: h.get(role, 0) < full[role], 10.0)
            wait_full(metrics, full, timeout_s)
            seconds = time.monotonic() - killed
            loads = LOADED.findall(log.read_text(errors="replace"))[loaded_before:]
            out.append({"role": role, "seconds": seconds, "seen_down_s": down,
                        "load_s": float(loads[-1][1]) if loads else None})
            bar.update()
            time.sleep(1.0)  # let the restarted worker's first second pass before the next kill
        return {"ready_s": ready_s, "kills": out, "median_s": statistics.median(k["seconds"] for k in out)}
    finally:
        proc.stop(120)


def status(env: dict) -> list[dict]:
    out = subprocess.run([PDSERVE, "status", "--json"], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"pdserve status failed: {out.stderr.strip()}")
    return json.loads(out.stdout)["workers"]


def healthy(metrics: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics, timeout=5) as resp:
        return {role: float(v) for role, v in HEALTHY.findall(resp.read().decode())}


def wait_until(metrics: str, predicate, timeout_s: float) -> float | None:
    """Seconds until predicate(healthy counts) holds; None if it did not within timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate(healthy(metrics)):
            return time.monotonic() - start
        time.sleep(POLL_S)
    return None


def wait_full(metrics: str, full: dict | None, timeout_s: float) -> dict[str, float]:
    """The healthy counts once every pool is at `full` (None: at least one worker in each)."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = healthy(metrics)
        if h and (all(v >= 1 for v in h.values()) if full is None else all(h.get(r, 0) >= n for r, n in full.items())):
            return h
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router's healthy workers did not come back within {timeout_s:g} s: {h}")
        time.sleep(POLL_S)


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def report(args, results: dict[str, list[dict]]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    arms = list(results)
    summary = {"command": "python benchmarks/recovery.py " + " ".join(sys.argv[1:]), "rounds": args.rounds,
               "kills": args.kills, "results": results}
    print(f"\nCommand: `{summary['command']}`\n")
    print("| arm | role | kill to healthy again (s), min / median / max over kills | worker's load (s), median |")
    print("|---|---|---|---|")
    for arm in arms:
        for role in ("decode", "prefill"):
            kills = [k for run in results[arm] for k in run["kills"] if k["role"] == role]
            if kills:
                loads = [k["load_s"] for k in kills if k["load_s"] is not None]
                load = f"{statistics.median(loads):.1f}" if loads else "—"
                print(f"| {arm} | {role} | {spread([k['seconds'] for k in kills])} | {load} |")
    print("\n| arm | start to ready (s), min / median / max over rounds | round medians (s) |\n|---|---|---|")
    for arm in arms:
        print(f"| {arm} | {spread([run['ready_s'] for run in results[arm]])} | "
              f"{spread([run['median_s'] for run in results[arm]])} |")
    if len(arms) == 2:
        ratios = [a["median_s"] / b["median_s"] for a, b in zip(results[arms[0]], results[arms[1]])]
        summary["ratios"] = ratios
        print(f"\nRecovery time, {arms[0]} / {arms[1]}, per round: {spread(ratios)}× (lower is faster)")
    (RESULTS / "recovery.json").write_text(json.dumps(summary, indent=1))
    _plot(results)


def _plot(results: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (arm, runs) in enumerate(results.items()):
        for j, role in enumerate(("decode", "prefill")):
            ys = [k["seconds"] for run in runs for k in run["kills"] if k["role"] == role]
            ax.scatter([i * 2 + j] * len(ys), ys, alpha=0.6, label=f"{arm}, {role}")
    ax.set_xticks(range(2 * len(results)))
    ax.set_xticklabels([f"{arm}\n{role}" for arm in results for role in ("decode", "prefill")], fontsize=7)
    ax.set_ylabel("kill -9 to healthy again (s)")
    ax.set_ylim(bottom=0)
    ax.set_title("pdserve serve: a worker's recovery after kill -9")
    fig.tight_layout()
    fig.savefig(RESULTS / "recovery.png", dpi=120)


if __name__ == "__main__":
    main()
