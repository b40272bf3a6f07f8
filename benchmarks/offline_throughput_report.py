"""The report of `offline_throughput.py`: its result dict as the Markdown section BENCHMARKS.md
holds (the table, the goals of issues 2 and 14 met or missed, static batching's waste), the JSON
and the plot. Functions of the result dict only: nothing here measures."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # report.py, beside this script

from report import GOAL_HEADER, Goal, Spread, host, update_section  # noqa: E402

MARKDOWN = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
SECTION = "Offline throughput (issues 2, 14)"


def _goal(d: dict) -> Goal:
    s = d["spread"]
    return Goal(d["name"], Spread.from_dict(s), d["target"], d["is_floor"])


def _spread(d: dict) -> Spread:
    return Spread.from_dict(d)


def table_rows(result: dict) -> list[str]:
    rows = ["| model | params | pdserve start-up s | workload | pdserve | transformers |", "|---|---|---|---|---|---|"]
    for m in result["models"]:
        pd, hf = m["systems"]["pdserve"], m["systems"]["transformers"]
        name, params = m["model"]["name"], f"{m['model']['num_params'] / 1e6:.1f} M"
        start = f"{m['pdserve_startup_seconds']:.1f}"
        rows.append(f"| {name} | {params} | {start} | mixed ({len(m['mixed_workload']['max_tokens'])} prompts), "
                    f"useful tokens/s | {_spread(pd['mixed_tokens_per_s']).fmt(0)} | "
                    f"{_spread(hf['mixed_tokens_per_s']).fmt(0)} |")
        rows.append(f"| {name} | {params} | {start} | batch 1, request seconds | {_spread(pd['b1_seconds']).fmt(3)} | "
                    f"{_spread(hf['b1_seconds']).fmt(3)} |")
        rows.append(f"| {name} | {params} | {start} | batch 1, decode ms/step (floor {m['decode_floor_ms']:.2f}) | "
                    f"{_spread(pd['step_ms']).fmt(2)} | {_spread(hf['step_ms']).fmt(2)} |")
    return rows


def goal_rows(result: dict) -> list[str]:
    return GOAL_HEADER + [_goal(g).row() for m in result["models"] for g in m["goals"]]


def waste_lines(result: dict) -> list[str]:
    w = result["models"][0]["mixed_workload"]
    return [f"Static batching's share of work on the mixed batch: {w['hf_padded_prompt_tokens']} padded prompt tokens "
            f"for {w['prompt_tokens']} real ones, {w['hf_generated_tokens']} generated tokens for {w['useful_tokens']} "
            f"asked for: {w['static_batching_waste']:.2f}× the tokens, the ratio an engine with transformers' cost "
            "per token would get from continuous batching alone."]


def write_json(result: dict, out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def write_plot(result: dict, out_dir: Path, stem: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = ((axes[0], "mixed_tokens_per_s", "mixed batch: useful tokens/s"),
              (axes[1], "b1_seconds", "batch 1: request seconds"))
    for ax, key, title in panels:
        xs = range(len(models))
        for k, system in enumerate(("pdserve", "transformers")):
            spreads = [_spread(m["systems"][system][key]) for m in models]
            med = [sp.median for sp in spreads]
            err = [[sp.median - sp.min for sp in spreads], [sp.max - sp.median for sp in spreads]]
            bars = ax.bar([x + (k - 0.5) * 0.38 for x in xs], med, 0.38, yerr=err, capsize=3, label=system)
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(list(xs), [m["model"]["name"] for m in models])
        ax.set_title(f"{title} (median, min-max of {result['config']['repeats']})")
        ax.legend()
    fig.suptitle(f"pdserve vs transformers, fp32 CPU, {result['machine']['torch_threads']} threads")
    fig.tight_layout()
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(result: dict, command: str) -> str:
    m = result["machine"]
    return "\n".join([
        "pdserve's offline `LLM.generate` against `transformers`' batched `generate` (static batches, "
        "left-padded, run to each batch's longest `max_tokens`), same checkpoints, fp32 on CPU, greedy, EOS "
        f"ignored, {m['torch_threads']} torch thread(s) on both sides. pdserve options: "
        f"`{result['config']['engine_options']}`. Tokens/s count only the tokens each request asked for. "
        f"Each figure is min / median / max over {result['config']['repeats']} repeats; within a repeat the two "
        "systems run back to back (alternating who goes first), and each goal is judged on its worst repeat.", "",
        "Command:", "", "```", command, "```", "",
        *table_rows(result), "",
        *goal_rows(result), "",
        *waste_lines(result), "",
        f"Memory floor: parameter bytes / {result['read_bandwidth_gbps']:.1f} GB/s, the read bandwidth measured in the "
        "same run (best of 5 sums over 256 MB). pdserve start-up (weights, KV cache and graph capture) is not in "
        "any timed run.", "",
        f"Files: `benchmarks/results/offline_throughput.json`, `benchmarks/results/offline_throughput.png`. "
        f"Load average (1 min) at the start and end: {m['load_avg_1m_start']:.2f}, {m['load_avg_1m_end']:.2f} "
        f"({host(m)}).",
    ])


def update_markdown(result: dict, command: str, path: Path = MARKDOWN) -> None:
    update_section(path, SECTION, markdown(result, command))


def print_summary(result: dict, command: str) -> None:
    print(f"## {SECTION}\n")
    print(markdown(result, command))
