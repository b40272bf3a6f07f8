"""The report of `spec_decode.py`: its rows (one per method, batch and temperature, made here by
`collect` from the runs' records), its engines' first runs (`first_runs`), the Markdown table
BENCHMARKS.md holds, the goals of issue 14 they meet or miss, and the plot. Functions of the runs'
records and the result dicts only: nothing here measures."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # report.py, beside this script

from report import GOAL_HEADER, Goal, Spread, host  # noqa: E402


def ideal_speedup(alpha: float, k: float, c: float) -> float:
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (1 + k * c)


def first_runs(first: dict[tuple, dict], methods: tuple) -> list[dict]:
    """Each method's first run of each case (its warm-up, right after its engine started): the
    whole run's and the decode phase's speed against its baseline's first run of the case. Not
    interleaved (the engines warm up one after another, minutes apart), so only a rough figure
    of what a fresh engine's first requests cost."""
    out = []
    for (b, t, name), r in first.items():
        m = next(m for m in methods if m.name == name)
        base = next((first.get((b, t, x.name)) for x in methods if x.is_plain and x.is_newcomer == m.is_newcomer), None)
        if m.is_plain or base is None:
            continue
        out.append(dict(batch_size=b, temperature=t, method=name, speedup=base["seconds"] / r["seconds"],
                        decode_speedup=decode_spt(base) / decode_spt(r)))
    return out


def decode_spt(r: dict) -> float:
    """Seconds per token of a run's decode phase (`generate_timed`)."""
    return r["decode_seconds"] / max(r["decode_tokens"], 1)


def collect(raw: dict, methods: tuple, cases: list[tuple]) -> list[dict]:
    """The table's rows from every run's record (`spec_decode.run_once`'s, keyed by batch,
    temperature and method name; `methods`: spec_decode's `Method`s measured)."""
    rows = []
    for b, temp in cases:
        plain_runs = raw[(b, temp, "plain")]
        target_s = statistics.median(r["target_forward_s"] for r in plain_runs if r["target_forward_s"])
        # c is the pair's, not a method's: every draft forward over exactly b tokens (one per
        # sequence, past the catch-up pass) at this batch and temperature, whichever method ran it
        draft_times = [r["draft_forward_s"] for m in methods if (b, temp, m.name) in raw and not m.is_newcomer
                       for r in raw[(b, temp, m.name)] if r["draft_forward_s"]]
        c = statistics.median(draft_times) / target_s if draft_times else None
        for m in methods:
            runs = raw.get((b, temp, m.name))
            if runs is None:
                continue
            row = summarize(m, runs, c if m.uses_draft else 0.0)
            row.update(batch_size=b, temperature=temp, is_newcomer=m.is_newcomer,
                       target_forward_ms=target_s * 1e3, draft_forward_ms=c * target_s * 1e3 if c else None)
            if not m.is_plain and (temp == 0 or "rejection" not in m.name):  # coupled: same tokens as plain
                row["same_tokens_as_plain"] = all(r["token_ids"] == r["baseline_token_ids"]
                                                  and r.get("own_plain_token_ids", r["token_ids"]) == r["token_ids"]
                                                  for r in runs)
            rows.append(row)
    return rows


def summarize(method, runs: list[dict], c: float | None) -> dict:
    rates = Spread.of(r["num_tokens"] / r["seconds"] for r in runs)
    out = dict(method=method.name, tokens_per_s=rates.as_dict(), num_tokens=runs[0]["num_tokens"])
    if method.is_plain:  # the A/A control: a plain run against the one before it, one method run between
        pairs = [r["previous_baseline_seconds"] / r["seconds"] for r in runs if "previous_baseline_seconds" in r]
        if pairs:
            out["a_a"] = Spread.of(pairs).as_dict()
        decode_pairs = [r["previous_baseline_decode_spt"] / decode_spt(r) for r in runs
                        if "previous_baseline_decode_spt" in r]
        if decode_pairs:
            out["a_a_decode"] = Spread.of(decode_pairs).as_dict()
        return out
    speedup = Spread.of(r["baseline_seconds"] / r["seconds"] for r in runs)  # same tokens, neighbouring runs
    decode = Spread.of(r["baseline_decode_spt"] / decode_spt(r) for r in runs)
    out.update(speedup=speedup.as_dict(), decode_speedup=decode.as_dict())
    if method.is_control:  # plain decoding: nothing speculative to report
        return out
    if all("own_plain_seconds" in r for r in runs):  # against its own engine, speculation set aside
        out["own_speedup"] = Spread.of(r["own_plain_seconds"] / r["seconds"] for r in runs).as_dict()
        out["own_decode_speedup"] = Spread.of(r["own_plain_decode_spt"] / decode_spt(r) for r in runs).as_dict()
    drafts = sum(r["num_drafts"] for r in runs)
    draft_tokens = sum(r["num_draft_tokens"] for r in runs)
    accepted = sum(r["num_accepted_tokens"] for r in runs)
    alpha = accepted / draft_tokens if draft_tokens else 0.0
    mean_k = draft_tokens / drafts if drafts else 0.0
    out.update(alpha=alpha, mean_accepted_length=(accepted + drafts) / drafts if drafts else 0.0,
               mean_k=mean_k, num_drafts=drafts, c=c,
               accepted_per_pos=[sum(x) for x in zip(*(r["accepted_per_pos"] for r in runs))])
    if any("cost_lines" in r for r in runs):  # adaptive: each repeat's drafts and its lines before and after
        out["per_repeat"] = [dict(speedup=r["baseline_seconds"] / r["seconds"], num_drafts=r["num_drafts"],
                                  cost_lines=r.get("cost_lines")) for r in runs]
    if c is not None and drafts:
        ideal = ideal_speedup(alpha, mean_k, c)
        out["ideal_speedup"] = ideal
        # the ideal is a decode-phase figure (tokens per step over a step's cost): the decode phase's speedup
        out["share_of_ideal"] = Spread.of(s / ideal for s in decode.values).as_dict()
    return out


def _sp(d: dict | None) -> Spread | None:
    return None if d is None else Spread.from_dict(d)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| batch | temp | method | tokens/s (min / med / max) | speedup (min / med / max) "
             "| decode speedup (min / med / max) | speedup vs its own engine, speculation off (min / med / max) "
             "| α | mean accepted length "
             "| mean k | c | ideal | share of ideal, decode (min / med / max) | same tokens as plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        same = r.get("same_tokens_as_plain")
        speed, share, a_a = _sp(r.get("speedup")), _sp(r.get("share_of_ideal")), _sp(r.get("a_a"))
        decode, a_a_decode = _sp(r.get("decode_speedup")), _sp(r.get("a_a_decode"))
        decode_text = decode.fmt(2) if decode else f"A/A {a_a_decode.fmt(2)}" if a_a_decode else "–"
        speed_text = speed.fmt(2) if speed else f"A/A {a_a.fmt(2)}" if a_a else "–"
        own = _sp(r.get("own_speedup"))
        lines.append(
            f"| {r['batch_size']} | {r['temperature']:g} | {r['method']} | {_sp(r['tokens_per_s']).fmt(0)} | "
            f"{speed_text} | {decode_text} | {own.fmt(2) if own else '–'} | {fmt(r.get('alpha'), '.2f')} | "
            f"{fmt(r.get('mean_accepted_length'), '.2f')} | "
            f"{fmt(r.get('mean_k'), '.2f')} | {fmt(r.get('c'), '.2f')} | {fmt(r.get('ideal_speedup'), '.2f')} | "
            f"{share.fmt(2) if share else '–'} | {'–' if same is None else ('yes' if same else '**no**')} |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> list[Goal]:
    def row(b, t, name):
        return next((r for r in rows if r["batch_size"] == b and r["temperature"] == t and r["method"] == name), None)

    out = []
    # the tuned configurations, then the newcomer's (default options: what a user gets unasked)
    for name in ("draft k=4", "draft adaptive", "ngram k=4", "newcomer draft k=4"):
        r = row(1, 0.0, name)
        if r and r.get("speedup"):
            out.append(Goal(f"batch 1 greedy, {name}: speedup", _sp(r["speedup"]), 2.5, True))
            if r.get("decode_speedup"):
                out.append(Goal(f"batch 1 greedy, {name}: decode speedup", _sp(r["decode_speedup"]), 2.5, True))
            if r.get("share_of_ideal") and "draft" in name:
                out.append(Goal(f"batch 1 greedy, {name}: share of ideal", _sp(r["share_of_ideal"]), 0.85, True))
    for b in (8, 32):
        for t in (0.0, 1.0):
            # the default verifier's adaptive methods, then (temperature 1) the rejection sampler's
            for name in ("draft adaptive", "ngram adaptive", "draft adaptive rejection"):
                r = row(b, t, name)
                # against plain decoding's process, and against the method's own engine with
                # speculation set aside (one process: none of the processes' own differences)
                for key, against in (("speedup", ""), ("own_speedup", ", vs its own engine")):
                    if r and r.get(key):
                        sp = _sp(r[key])
                        out.append(Goal(f"batch {b}, temp {t:g}, {name}: speedup{against} (median)",
                                        Spread(sp.median, sp.median, sp.median, (sp.median,)), 1.0, True))
                        out.append(Goal(f"batch {b}, temp {t:g}, {name}: speedup{against} (every repeat)", sp, 0.95,
                                        True))
    r = row(1, 0.0, "draft k=4")
    if r and r.get("c") is not None:
        out.append(Goal("draft/target forward cost c at batch 1", Spread.of([r["c"]]), 0.17, False))
    return out


def markdown(result: dict, stem: str = "spec_decode") -> str:
    rows = [r for r in result["rows"] if not r["is_newcomer"]]
    newcomer = [r for r in result["rows"] if r["is_newcomer"]]
    m = result["machine"]
    start = ", ".join(f"{k} {v:.1f}" for k, v in result["startup_seconds"].items())
    return "\n".join([
        f"Command: `{result['command']}` ({result['runs']} interleaved repeats{rounds_text(result)}; every figure "
        f"min / median / max over them; each method's engine runs in a process of its own; a speedup divides by the two plain runs "
        f"right before and after the method's run, and plain's row gives in that column, marked A/A, a plain run "
        f"against the one before it, one method's runs apart: the host's drift alone; a speculative method's run "
        f"also sits between two runs of its own engine with speculation set aside, its speedup against them in "
        f"the column \"vs its own engine\": one process, the same weights and caches; \"plain, another process\" "
        f"is plain decoding in a second process, measured like a method: how far two processes of the same "
        f"configuration differ). Tuned options: "
        f"`{result['tuned_options']}`, {result['threads']} torch thread(s). Load average (1 min) at the start and "
        f"end: {m['load_avg_1m_start']:.2f}, {m['load_avg_1m_end']:.2f} ({host(m)}).", "",
        markdown_table(rows), "",
        "Newcomer (README's `LLM(\"models/demo\", draft_model=\"models/demo-draft\", num_speculative_tokens=4)` and "
        f"plain `LLM(\"models/demo\")`, default options, default torch threads ({result['default_threads']}); "
        "speedup against the newcomer plain engine):", "",
        markdown_table(newcomer), "",
        *GOAL_HEADER, *(g.row() for g in goals(result["rows"])), "",
        *first_runs_text(result.get("first_runs", [])),
        f"Start-up seconds (weights, caches, graph capture; not in any timed run): {start}.", "",
        f"Files: `benchmarks/results/{stem}.json`, `benchmarks/results/{stem}.png`.",
    ])


def rounds_text(result: dict) -> str:
    rounds = result.get("rounds", 1)
    return (f", each of {rounds} rounds of its paired runs back to back, every run's figure its median round "
            f"(`median_round`: one real run's record)") if rounds > 1 else ""


def first_runs_text(first: list[dict]) -> list[str]:
    """A paragraph: the adaptive methods' first run of each case (the warm-up before the timed
    repeats), whole run and decode phase against plain decoding's first run."""
    adaptive = [r for r in first if "adaptive" in r["method"] or r["method"].startswith("newcomer draft")]
    if not adaptive:
        return []
    parts = [f"{r['method']} batch {r['batch_size']} temp {r['temperature']:g}: {r['speedup']:.2f}× "
             f"({r['decode_speedup']:.2f}× decode)" for r in adaptive]
    return ["First runs (not in the table: each engine runs every case once, whole, right after it starts and "
            "before the timed repeats; a fresh engine's first requests, where an adaptive engine's gate runs its "
            "opening bursts; not interleaved with plain decoding's first runs, which ran minutes before or after): "
            + "; ".join(parts) + ".", ""]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r["is_newcomer"] and r.get("speedup")]
    temps = sorted({r["temperature"] for r in rows})
    batches = sorted({r["batch_size"] for r in rows})
    names = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(temps), figsize=(7 * len(temps), 4), squeeze=False)
    width = 0.8 / max(len(names), 1)
    for ax, temp in zip(axes[0], temps):
        for j, name in enumerate(names):
            sel = [next((r for r in rows if r["method"] == name and r["batch_size"] == b and r["temperature"] == temp),
                        None) for b in batches]
            med = [_sp(r["speedup"]).median if r else 0 for r in sel]
            err = [[(_sp(r["speedup"]).median - _sp(r["speedup"]).min) if r else 0 for r in sel],
                   [(_sp(r["speedup"]).max - _sp(r["speedup"]).median) if r else 0 for r in sel]]
            ax.bar([i + j * width for i in range(len(batches))], med, width, yerr=err, capsize=2, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(2.5, color="tab:gray", lw=0.8, ls="--")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_title(f"speedup vs plain decoding, temperature {temp:g} (median, min-max)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
