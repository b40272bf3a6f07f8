"""Latency percentiles and SLO attainment against request rate, one line per configuration.

matplotlib is imported inside `plot_sweeps`, so importing the load generator stays light.
"""
from __future__ import annotations

from pathlib import Path

from pdserve.loadgen.stats import SLO, RunSummary

_PERCENTILES = (("p50", "-"), ("p90", "--"), ("p99", ":"))


def plot_sweeps(series: dict[str, list[RunSummary]], path: str | Path, slo: SLO | None = None,
                title: str = "") -> Path:
    """Three panels (TTFT, TPOT, SLO attainment) against offered rate; `series`: label -> runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, runs) in enumerate(series.items()):
        runs = sorted((r for r in runs if r.rate != float("inf")), key=lambda r: r.rate)
        color = colors[i % len(colors)]
        for ax, metric in zip(axes[:2], ("ttft", "tpot")):
            for pct, style in _PERCENTILES:
                pts = [(r.rate, getattr(getattr(r, metric), pct) * 1e3) for r in runs if getattr(r, metric)]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=color, label=f"{label} {pct}")
        pts = [(r.rate, 100 * r.slo_attainment) for r in runs if r.slo_attainment is not None]
        if pts:
            axes[2].plot(*zip(*pts), "-", marker="o", ms=3, color=color, label=label)
    _decorate(axes, slo)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _decorate(axes, slo: SLO | None) -> None:
    names = (("TTFT (ms)", slo and slo.ttft_s), ("TPOT (ms)", slo and slo.tpot_s))
    for ax, (name, limit) in zip(axes[:2], names):
        ax.set_ylabel(name)
        if limit:
            ax.axhline(limit * 1e3, color="grey", lw=0.8, label="SLO")
        ax.set_yscale("log")
    axes[2].set_ylabel("SLO attainment (%)")
    axes[2].axhline(90, color="grey", lw=0.8, label="90%")
    axes[2].set_ylim(0, 105)
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
