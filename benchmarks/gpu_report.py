"""`gpu_check.py`'s report: Markdown tables and a PNG from a run's files alone
(`python benchmarks/gpu_check.py --render DIR`)."""
from __future__ import annotations

import json
from pathlib import Path

# --- the report ---------------------------------------------------------------------------

def render(out_dir: Path) -> str:
    """Markdown tables of a run's `gpu_check.json` (and `kernel_bandwidth.py`'s kernels-*.json
    beside it), and `gpu_check.png`: what BENCHMARKS.md shows, from the files alone."""
    report = json.loads((out_dir / "gpu_check.json").read_text())
    peak, lines = report["peak_tbps"], []
    env = report.get("env", {})
    lines += [f"{report['device']}, run {report['started']} (`{report['command']}`, {report['seconds']:.0f} s); "
              f"torch {env.get('torch')}, Triton {env.get('triton')}. Ceilings measured in the run: a device copy "
              f"{env.get('copy_tbps', 0):.2f} TB/s (read + written), a bf16 8192³ product "
              f"{env.get('bf16_matmul_tflops', 0):.0f} TFLOP/s; the datasheet's bandwidth {peak} TB/s.", ""]
    if "tests" in report and "summary" in report["tests"]:
        summary = [line for line in report["tests"]["summary"] if " passed" in line or " failed" in line]
        log = out_dir / "gpu_check_kernel_tests.log"
        if not summary and log.exists():  # runs before the summary kept pytest's count: the log has it
            summary = [line for line in log.read_text().splitlines() if " passed" in line or " failed" in line][-1:]
        lines += [f"Kernel tests (`tests/kernels`' Triton ones), compiled: {' '.join(summary).strip()}.", ""]
    if "ops" in report and "checks" in report["ops"]:
        lines += ["| op at serving size (bf16) | kernel vs reference |", "|---|---|"]
        lines += [f"| {c['op']} | " + (f"max abs err {c['max_abs_err']:.3g}" if "max_abs_err" in c
                                       else f"agreement {c['agreement']:.3f}") + (" ✓" if c["ok"] else " ✗") + " |"
                  for c in report["ops"]["checks"]]
        lines.append("")
    att = report.get("attention", {})
    if "default" in att:
        d, b = att["default"], att.get("best") or {}
        lines += [f"Paged decode attention, batch {att['batch']}, context {att['context']}, {att['heads']} query / "
                  f"{att['kv_heads']} KV heads, head_dim {att['head_dim']}, bf16 ({att['bytes'] / 1e6:.0f} MB read "
                  f"and written). Goal: ≥ 70% of the datasheet's bandwidth.", "",
                  "| launcher | time | bandwidth | of the datasheet's | of the measured copy | goal |",
                  "|---|---|---|---|---|---|",
                  f"| default (partition {d['partition_size']}) | {d['ms'] * 1e3:.1f} µs | {d['tbps']:.2f} TB/s | "
                  f"{100 * d['share_of_peak']:.1f}% | {100 * (d['share_of_copy'] or 0):.1f}% | "
                  f"{'met' if att['goal_met'] else 'not met'} |"]
        if b:
            lines.append(f"| best of the sweep's {len(att['sweep'])}: `{b['settings']}` | {b['ms'] * 1e3:.1f} µs | "
                         f"{b['tbps']:.2f} TB/s | {100 * b['share_of_peak']:.1f}% | "
                         f"{100 * (b['share_of_copy'] or 0):.1f}% | {'met' if b['share_of_peak'] >= 0.7 else 'not met'} |")
        if att.get("head_dim_128"):
            h = att["head_dim_128"]
            lines.append(f"| default, {h['shape']} | {h['ms'] * 1e3:.1f} µs | {h['tbps']:.2f} TB/s | "
                         f"{100 * h['share_of_peak']:.1f}% | | |")
        if len(att.get("default_repeats_ms", [])) > 1:
            reps = sorted(att["default_repeats_ms"])
            share = lambda ms: att["bytes"] / (ms * 1e-3) / 1e12 / peak  # noqa: E731
            lines += ["", f"The default launcher in {len(reps)} timings of the run: {reps[0] * 1e3:.1f} / "
                      f"{reps[len(reps) // 2] * 1e3:.1f} / {reps[-1] * 1e3:.1f} µs (min / median / max), "
                      f"{100 * share(reps[-1]):.1f}% / {100 * share(reps[len(reps) // 2]):.1f}% / "
                      f"{100 * share(reps[0]):.1f}% of the datasheet's bandwidth: the goal is "
                      f"{'met' if att['goal_met'] else 'not met'} in the worst."]
        if att.get("default_timings"):
            t = att["default_timings"]
            names = dict(graph_flushed="CUDA-graph replays after a read-only L2 flush (the table's)",
                         graph_warm_l2="graph replays back to back", eager_do_bench="eager, Triton's do_bench")
            lines.append("")
            lines.append("The default launcher timed three ways: " + "; ".join(
                f"{names.get(k, k)} {v * 1e3:.1f} µs" for k, v in t.items()) + "."
                + "".join(f" A torch sum over the same K and V reads at {v:.2f} TB/s." for v in att.get("ceilings", {}).values()))
            lines.append("")
        if att.get("by_shape"):
            cols = sorted({k for r in att["by_shape"] for k in r if k.endswith("_tbps") and k != "default_tbps"},
                          key=lambda k: int(k[1:-5]))
            lines += ["", "TB/s by partition size (0: one pass) with the sweep's best other settings, and the "
                      "default launcher's:", "",
                      "| batch | context | " + " | ".join(c[:-5] for c in cols) + " | default (its choice) |",
                      "|---" * (len(cols) + 3) + "|"]
            lines += [f"| {r['num_seqs']} | {r['context']} | " + " | ".join(f"{r[c]:.2f}" if c in r else "" for c in cols)
                      + f" | {r['default_tbps']:.2f} (p{r['chosen']}) |" for r in att["by_shape"]]
        lines.append("")
    dec = report.get("decode", {})
    if "off" in dec:
        batches = sorted(int(k[5:-13]) for k in dec["off"] if k.endswith("_tokens_per_s"))
        lines += [f"Decode, a {dec['num_params'] / 1e9:.2f} B-parameter Llama (Llama-3.2-1B's config, random "
                  "weights, bf16), prompts of 128 tokens, greedy; tokens/s of decoding alone (a run of n tokens "
                  "less a run of one).", "",
                  "| graph capture | " + " | ".join(f"batch {b}: tok/s (ms/step)" for b in batches) + " |",
                  "|---" * (len(batches) + 1) + "|"]
        for cap in ("cuda_graphs", "off"):
            if cap in dec:
                lines.append(f"| {cap} | " + " | ".join(f"{dec[cap][f'batch{b}_tokens_per_s']:.0f} "
                                                        f"({dec[cap][f'batch{b}_step_ms']:.2f})" for b in batches) + " |")
        if "cuda_graph_speedup" in dec:
            lines.append("")
            lines.append("CUDA graphs: " + ", ".join(f"{v:.2f}× at {k}" for k, v in dec["cuda_graph_speedup"].items())
                         + f"; greedy tokens identical with and without: {dec['greedy_identical']}.")
        if "batch1_floor_ms" in dec:
            lines.append(f"Batch-1 step against its floor (weight bytes / half the measured copy's bytes per second): "
                         f"{dec['batch1_step_over_floor']:.2f}× ({dec['batch1_floor_ms']:.2f} ms).")
        if "transformers_batch1_tokens_per_s" in dec:
            lines.append(f"transformers' `generate` on the same weights, batch 1: "
                         f"{dec['transformers_batch1_tokens_per_s']:.1f} tok/s; pdserve {dec['batch1_vs_transformers']:.2f}×.")
        lines.append("")
    spec = report.get("spec", {})
    if "speedup" in spec:
        ng = spec["ngram_k4"]
        lines += [f"n-gram speculation (k = 4, adaptive) at batch 1 on the same model: {spec['speedup']:.2f}× plain "
                  f"({ng['tokens_per_s']:.0f} against {spec['plain']['tokens_per_s']:.0f} tok/s); {ng.get('drafts', 0)} "
                  f"drafts, {ng.get('accepted_tokens', 0)} of {ng.get('draft_tokens', 0)} draft tokens accepted; "
                  f"tokens identical to plain decoding: {spec['identical']}.", ""]
    ext = report.get("extend", {})
    if ext.get("shapes"):
        lines += [f"Prefill attention (`extend_attention`), {ext['heads']} query / {ext['kv_heads']} KV heads, head_dim "
                  f"{ext['head_dim']}, bf16, graph replays from a cold L2; TFLOP/s of the causal products needed:", "",
                  "| shape | dense SDPA | default launcher | best of the sweep | its settings |", "|---|---|---|---|---|"]
        cell = lambda e: f"{e['ms'] * 1e3:.1f} µs ({e['tflops']:.0f} TFLOP/s)" if e else ""  # noqa: E731
        for name, r in ext["shapes"].items():
            dense = f"{r['dense_ms'] * 1e3:.1f} µs" if "dense_ms" in r else r.get("dense_error", "")[:60]
            lines.append(f"| {name} | {dense} | {cell(r.get('default'))} | {cell(r.get('best'))} | "
                         f"`{(r.get('best') or {}).get('label', '')}` |")
        lines.append("")
    demo = report.get("spec_demo", {})
    if "table" in demo:
        lines += [f"Speculative decoding of the demo pair (`models/demo`, `models/demo-draft`) with "
                  f"{demo['capture']}, {demo['max_tokens']} tokens a request, {demo['repeats']} interleaved repeats "
                  "(each method's run between two plain runs; speedup over their mean, min / median / max); tokens "
                  "compared with plain decoding's:", "",
                  "| method | batch | temperature | speedup | plain tok/s | α | tokens / verification | mean k | "
                  "tokens as plain |", "|---|---|---|---|---|---|---|---|---|"]
        fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        lines += [f"| {r['method']} | {r['batch']} | {r['temperature']:g} | {r['speedup_min']:.2f} / "
                  f"{r['speedup_median']:.2f} / {r['speedup_max']:.2f}× | {r['plain_tokens_per_s_median']:.0f} | "
                  f"{fmt(r['acceptance'], '.2f')} | {fmt(r['tokens_per_verification'], '.2f')} | "
                  f"{fmt(r['mean_k'], '.1f')} | {'yes' if r['identical'] else 'no'} |" for r in demo["table"]]
        lines.append("")
    serving = report.get("serving", {})
    if "summary" in serving:
        lines += [f"The engine's and the serving tests on CUDA (`SERVING_TESTS`): {' '.join(serving['summary']).strip()}"
                  + "".join(f"; {f}" for f in serving.get("failed", [])) + ".", ""]
    if "table" in report.get("sampling", {}):
        lines += [f"The sample kernel against torch's reference, vocabulary {report['sampling']['vocab']}:", "",
                  "| filters | rows | kernel | torch reference | kernel's speed-up | same tokens |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['filters']} | {r['rows']} | {r['kernel_ms'] * 1e3:.1f} µs | {r['reference_ms'] * 1e3:.1f} µs | "
                  f"{r['reference_ms'] / r['kernel_ms']:.2f}× | {'yes' if r['agree'] else 'no'} |"
                  for r in report["sampling"]["table"]]
        lines.append("")
    kernel_files = sorted(out_dir.glob("kernels-*.json"))
    if kernel_files:
        rows = json.loads(kernel_files[-1].read_text())["rows"]
        lines += [f"`kernel_bandwidth.py` ({kernel_files[-1].name}):", "",
                  "| op | time | bandwidth | of the datasheet's | vs torch reference | vs dense SDPA |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['triton_ms'] * 1e3:.1f} µs | {r['bandwidth_gbps']:.0f} GB/s | "
                  f"{100 * r['peak_share']:.1f}% | {r['speedup_vs_ref']:.2f}× | "
                  + (f"{r['speedup_vs_sdpa']:.2f}× |" if r["speedup_vs_sdpa"] else "|") for r in rows]
    _plot(report, out_dir / "gpu_check.png")
    return "\n".join(lines)


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw=dict(width_ratios=[3, 2]))
    att = report.get("attention", {})
    rows = [r for r in att.get("sweep", []) if "tbps" in r and r.get("ok")]
    if rows:
        rows = sorted(rows, key=lambda r: r["tbps"])[-15:]
        short = dict(block_n="n", heads_first="heads-first", num_warps="w", num_stages="s",
                     cache_dtype_dots="16-bit dots", partition_size="p", all_heads="all-heads")
        labels = [" ".join(short.get(k, k) if v is True else f"{short.get(k, k)}{v}"
                           for k, v in r["settings"].items() if v is not False) for r in rows]
        ax1.barh(labels + ["default launcher"], [r["tbps"] for r in rows] + [att["default"]["tbps"]])
        ax1.axvline(0.7 * report["peak_tbps"], color="r", lw=1, label="goal: 70% of the datasheet")
        if report.get("env", {}).get("copy_tbps"):
            ax1.axvline(report["env"]["copy_tbps"], color="k", lw=1, ls="--", label="measured copy")
        ax1.set_xlabel("TB/s")
        ax1.tick_params(axis="y", labelsize=6)
        ax1.set_title(f"paged decode attention b{att['batch']} ctx{att['context']} (best 15 of the sweep)")
        ax1.legend(fontsize=7)
    dec = report.get("decode", {})
    caps = [c for c in ("cuda_graphs", "off") if c in dec]
    if caps:
        batches = sorted(int(k[5:-13]) for k in dec[caps[0]] if k.endswith("_tokens_per_s"))
        for i, cap in enumerate(caps):
            ax2.bar([j + 0.4 * i for j in range(len(batches))], [dec[cap][f"batch{b}_tokens_per_s"] for b in batches],
                    width=0.4, label=cap)
        ax2.set_xticks([j + 0.2 for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax2.set_yscale("log")
        ax2.set_ylabel("decode tokens/s")
        ax2.set_title(f"{dec['num_params'] / 1e9:.2f} B Llama, bf16")
        ax2.legend()
    fig.suptitle(report["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
