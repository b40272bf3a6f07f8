"""What every benchmark reports the same way: spreads over interleaved repeats, goals judged on
the worst repeat, the machine's state, and its section of BENCHMARKS.md.

A figure is min / median / max over repeats. A goal counts as met only when the worst repeat
meets it: the minimum for a floor ("at least 2.5x"), the maximum for a ceiling ("within 3x").
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class Spread:
    min: float
    median: float
    max: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values) -> Spread:
        values = tuple(float(v) for v in values)
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(min(values), statistics.median(values), max(values), values)

    @classmethod
    def from_dict(cls, d: dict) -> Spread:
        """The spread back from `as_dict()` (a result JSON's)."""
        return cls(d["min"], d["median"], d["max"], tuple(d["values"]))

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        f = f"{{:.{digits}f}}"
        return f"{f.format(self.min)} / {f.format(self.median)} / {f.format(self.max)}{unit}"

    def as_dict(self) -> dict:
        return asdict(self)


def fmt_spread(d: dict, digits: int = 2, unit: str = "") -> str:
    """A result JSON's spread (`Spread.as_dict()`) as "min / median / max" with `unit`."""
    return Spread.from_dict(d).fmt(digits, unit)


@dataclass(frozen=True, slots=True)
class Goal:
    name: str
    spread: Spread
    target: float
    is_floor: bool  # True: every repeat must be >= target; False: every repeat <= target

    @property
    def worst(self) -> float:
        return self.spread.min if self.is_floor else self.spread.max

    @property
    def is_met(self) -> bool:
        return self.worst >= self.target if self.is_floor else self.worst <= self.target

    def row(self, digits: int = 2, unit: str = "×") -> str:
        sign = "≥" if self.is_floor else "≤"
        verdict = "met" if self.is_met else "**not met**"
        return (f"| {self.name} | {self.spread.fmt(digits, unit)} | {sign} {self.target:g}{unit} | "
                f"{verdict} (worst {self.worst:.{digits}f}{unit}) |")

    def as_dict(self) -> dict:
        return dict(name=self.name, spread=self.spread.as_dict(), target=self.target, is_floor=self.is_floor,
                    is_met=self.is_met)


GOAL_HEADER = ["| goal | min / median / max | target | verdict |", "|---|---|---|---|"]


def machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "cpu": cpu_name(),
            "load_avg_1m": os.getloadavg()[0]}


def host(m: dict) -> str:
    """A `machine()` record as benchmark headers print it: "2 CPUs, <model>, <size> L3"."""
    return f"{m['cpu_count']} CPUs" + (f", {m['cpu']}" if m.get("cpu") else "")


def cpu_name() -> str:
    """The CPU's model name and last-level cache size, as Linux reports them ("" elsewhere): the
    figures of a small model depend on whether its weights fit in that cache."""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return ""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))
    if not caches:
        return model
    size, level = (caches[-1] / "size").read_text().strip(), (caches[-1] / "level").read_text().strip()
    if size.endswith("K") and size[:-1].isdigit() and int(size[:-1]) % 1024 == 0:
        size = f"{int(size[:-1]) // 1024} MiB"
    return f"{model}, {size} L{level}"


def measure_read_bandwidth(num_mb: int = 256, repeats: int = 5) -> float:
    """Best-of-`repeats` GB/s of reading a buffer much larger than the caches once (a `sum`),
    with the current torch threads: what a decode step's weight reads can reach at best."""
    buf = torch.ones(num_mb << 18, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


# In a section a script writes, this line and what follows it to the section's end are notes
# written by hand (what changed, what the figures mean): kept, after the new body, on every rewrite.
NOTES_MARK = "<!-- notes below are written by hand: kept when the script rewrites this section -->"


def revision_subject(rev: str) -> str:
    """`rev`'s short hash and subject line, as a variant's table names it."""
    return subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "log", "-1", "--format=%h %s", rev],
                          check=True, capture_output=True, text=True).stdout.strip()


def export_revision(rev: str, into: Path) -> Path:
    """`rev`'s sources laid out as the installed package is: the repository root as `pdserve`,
    with proto/pdserve (`__init__`, `v1`) inside it. Returns the directory to put first on
    PYTHONPATH (a process there, and any it starts, imports that revision)."""
    package = into / "pdserve"
    package.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "archive", rev],
                             capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(package, filter="data")
    for item in (package / "proto" / "pdserve").iterdir():
        os.rename(item, package / item.name)
    return into


def files_line(stem: str) -> list[str]:
    """The lines a section ends with: the files its run wrote."""
    return ["", f"Files: `benchmarks/results/{stem}.json`, `benchmarks/results/{stem}.png`."]


def grouped_bars(ax, names: list[str], series: list[tuple[str, list[dict]]]) -> None:
    """Per name, one bar for each (label, spreads) series side by side: the median, with whiskers
    to the min and max (`Spread.as_dict()`s)."""
    width = 0.8 / len(series)
    for i, (label, spreads) in enumerate(series):
        med = [s["median"] for s in spreads]
        err = [[s["median"] - s["min"] for s in spreads], [s["max"] - s["median"] for s in spreads]]
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(names))], med, width, yerr=err, capsize=3,
               label=label)
    ax.set_xticks(range(len(names)), names)
    ax.legend()


def update_section(path: Path, title: str, body: str) -> None:
    """Replace (or append) the `## title` section of a Markdown file with `body`, keeping the
    section's hand-written notes (`NOTES_MARK` onwards) below it."""
    heading = f"## {title}"
    section = f"{heading}\n\n{body.rstrip()}\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(heading + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(heading))
        old = text[start:end] if end >= 0 else text[start:]
        if NOTES_MARK in old:
            section += "\n" + old[old.index(NOTES_MARK):].rstrip("\n") + "\n"
        text = text[:start] + section + (text[end:] if end >= 0 else "")
    path.write_text(text)


def publish(result: dict, name: str, script_args: list[str], out_dir: Path, markdown, plot, section: str | None,
            stem: str | None = None) -> str:
    """A benchmark's outputs: its command (the script and `script_args`) into `result`, then
    `out_dir/<stem>.json` and `.png` (`plot(result, path)`; stem defaults to name), and its
    Markdown (`markdown(result, command)`) printed and, unless `section` is None, written as that
    section of BENCHMARKS.md. Returns the Markdown."""
    command = f"python benchmarks/{name}.py" + "".join(f" {a}" for a in script_args)
    result["command"] = command
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or name
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / f"{stem}.png")
    text = markdown(result, command)
    print(text)
    if section is not None:
        update_section(Path(__file__).resolve().parents[1] / "BENCHMARKS.md", section, text)
    return text
