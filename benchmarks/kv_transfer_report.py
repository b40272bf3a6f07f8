"""The report of `kv_transfer.py`: its result dict as the Markdown section BENCHMARKS.md holds
(the paths' table, the goals, the notes under them) and the plot. Functions of the result only:
nothing here measures."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # report.py, beside this script

from report import GOAL_HEADER, Goal, Spread, host  # noqa: E402

SMALL_PROMPT = 16  # tokens: a push whose time is nearly all messages, header, trailer and ack


def _spread(d: dict) -> Spread:
    return Spread.from_dict(d)


def _goal(d: dict) -> Goal:
    return Goal(d["name"], _spread(d["spread"]), d["target"], d["is_floor"])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, t = result["paths"], result["ttft"]
    fig, axes = plt.subplots(1, 2 if t else 1, figsize=(11 if t else 6, 4), squeeze=False)
    axes = axes[0]
    bars = [("grpc", "gRPC push", "tab:blue"), ("tcp", "raw TCP", "tab:gray"), ("dist", "gloo push", "tab:purple"),
            ("shm", "shm push", "tab:green"), ("copy", "memory copy", "tab:gray"), ("shm_copy", "shm copy\nalone",
                                                                                   "tab:olive")]
    bars = [b for b in bars if b[0] in p["gbps"]]
    names = [n for n, _, _ in bars]
    med = [p["gbps"][n]["median"] for n in names]
    lo = [m - p["gbps"][n]["min"] for m, n in zip(med, names)]
    hi = [p["gbps"][n]["max"] - m for m, n in zip(med, names)]
    axes[0].bar([label for _, label, _ in bars], med, yerr=[lo, hi], color=[c for _, _, c in bars])
    axes[0].set_title(f"{p['kv_bytes'] / 2**20:.0f} MiB of KV into a cache (GB/s, min/median/max)")
    if t:
        axes[1].bar(["disaggregated", "colocated"], [t["disagg_s"]["median"] * 1e3, t["colocated_s"]["median"] * 1e3],
                    color=["tab:blue", "tab:gray"])
        axes[1].set_title(f"TTFT at low load (ms), {t['prompt_tokens']}-token prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def markdown(result: dict) -> str:
    p, t = result["paths"], result["ttft"]
    ms = lambda n: Spread(**{k: v * 1e3 if k != "values" else tuple(x * 1e3 for x in v)  # noqa: E731
                             for k, v in p["seconds"][n].items()}).fmt(1, " ms")
    gb = lambda n: _spread(p["gbps"][n]).fmt(2, " GB/s")  # noqa: E731
    stem = result.get("stem", "kv_transfer")
    out = result.get("out_dir", "benchmarks/results")
    lines = [f"Command: `{result['command']}` (JSON: `{out}/{stem}.json`, plot: "
             f"`{out}/{stem}.png`). Load average at the start: "
             f"{result['machine']['load_avg_1m']:.1f} on {host(result['machine'])}.", "",
             f"One request's K/V: a {p['prompt_tokens']}-token prompt, {p['layers']} layers, "
             f"{p['kv_bytes'] / 2**20:.0f} MiB, pushed into a real decode worker's KV cache; "
             f"{len(p['seconds']['grpc']['values'])} repeats, each the median of {p.get('inner', 1)} rounds of every "
             "path back to back.", "",
             "| path | per request (min / median / max) | throughput |", "|---|---|---|",
             f"| production gRPC push (`GrpcTransport`, CRC-32C, into the decode worker's cache) | {ms('grpc')} | {gb('grpc')} |",
             *([f"| the same push, chunks built then framed by a copy (the prefill side before `host_chunks`) | "
                f"{ms('grpc_copied')} | {gb('grpc_copied')} |"] if "grpc_copied" in p["seconds"] else []),
             f"| raw TCP, same bytes, cache to cache, no checksum | {ms('tcp')} | {gb('tcp')} |",
             *([f"| torch.distributed push (`DistTransport`, gloo: each chunk one send, CRC-32C, into the same decode "
                f"worker's cache) | {ms('dist')} | {gb('dist')} |"] if "dist" in p["seconds"] else []),
             f"| shared-memory push (`ShmTransport`: decode copies from /dev/shm and checksums in the same pass) | {ms('shm')} | {gb('shm')} |",
             f"| plain memory copy (`torch` copy_, one thread), same bytes | {ms('copy')} | {gb('copy')} |",
             f"| the shared-memory push's copy-and-check alone (`copy_runs`, in this process) | {ms('shm_copy')} | "
             f"{gb('shm_copy')} |", "",
             *GOAL_HEADER, _goal(p["grpc_vs_tcp"]).row(), _goal(p["shm_vs_copy"]).row(),
             *([_goal(t["ratio"]).row()] if t else []), "",
             f"The same shared-memory push for a {SMALL_PROMPT}-token prompt (its bytes copied in microseconds; "
             f"what is left is gRPC's messages, the header, the trailer and the ack): "
             f"{ms('shm_small')}.", "",
             f"The copy-and-check alone ran at {_spread(p['shm_copy_vs_copy']).fmt(2, '×')} the plain copy's speed "
             "(not a goal: the push's own figure above is end to end).", "",
             *([f"The production gRPC push against the same push with its chunks built then framed by a copy: "
                f"{_spread(p['grpc_vs_copied']).fmt(2, '×')} the speed."] if "grpc_vs_copied" in p else []), "",
             *([f"The torch.distributed push (gloo, on this host) against raw TCP: {_spread(p['dist_vs_tcp']).fmt(2, '×')} "
                "the speed (not a goal: between CUDA caches the same transport runs NCCL, device to device, which "
                "no machine here has)."] if "dist_vs_tcp" in p else []), "",
             *([f"A/A control, the plain copy against the same copy run again right after each round: "
                f"{_spread(p['copy_a_a']).fmt(2, '×')} (what the host's noise alone does to a ratio)."] if "copy_a_a" in p
               else []), ""]
    if t:
        lines.append(f"TTFT ({t['prompt_tokens']}-token prompt, through a router; each repeat the median of "
                     f"{t.get('inner', 1)} requests a side, alternating): disaggregated "
                     f"{_spread(t['disagg_s']).fmt(3, ' s')}, colocated {_spread(t['colocated_s']).fmt(3, ' s')}."
                     + (f" A/A control, the colocated request again right after each round against the round's: "
                        f"{_spread(t['a_a']).fmt(2, '×')}." if "a_a" in t else ""))
    else:
        lines.append("TTFT: not measured in this run (`--skip-ttft`).")
    return "\n".join(lines)
