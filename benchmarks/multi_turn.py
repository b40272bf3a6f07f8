"""Multi-turn conversations on a disaggregated pair: what the decode worker's prefix cache saves a
conversation's later turns. A reservation adopts the blocks the decode worker holds of the prompt
(the earlier turns, prompt and answer); when they leave a short tail (`local_prefill_tokens`), the
decode worker prefills it itself, else the prefill worker pushes the K/V of the rest only.

    python benchmarks/multi_turn.py [--quick] [--repeats 5] [--conversations 4] [--turns 4] [--no-kv-shm]
                                    [--background] [--draft]

Three pairs side by side, alike but for the decode worker: "local prefill" (the defaults: a later
turn's tail is prefilled on the decode worker), "push" (`--local-prefill-tokens 0`: the prefill
worker computes the prompt past what its own cache holds and pushes the tail's K/V) and "no
reuse" (`--no-prefix-caching`: every push carries the whole prompt, as before the decode side
adopted blocks). Every prefill worker keeps its own prefix cache. Each conversation opens with a
256-token cut of this repository's sources, and each turn adds a 32-token greedy answer and a
64-token cut as the next question; every arm gets the same history (the first arm's answers).
One request at a time; per turn, the arms take turns in an order that rotates. Measured per turn
after the first: TTFT at the client (the first streamed message), the time to the second token
(the transfer sits there: the router streams the first token as soon as the prefill worker
samples it, and the second comes from the decode worker once the K/V are in), the KV bytes the
decode worker received (its `pdserve:kv_transfer_bytes_total`), and the prompt tokens the
prefill worker computed (its prefix cache's queries less its hits). A repeat's figure is the
median over its later turns; the ratios between arms are taken per repeat.
Workers pinned (prefill core 0, decode core 1, the arms on the same cores), one torch thread each.
With `--background`, each turn runs beside another stream on the same pair, started before the
turn and cancelled after it: the longest gap between that stream's tokens during the turn is
what a request already decoding pays for the turn (a tail prefilled on the decode worker is a few
steps of its batch that carry the tail's chunks; a push, the copy into its cache and the
activation), against the median gap before the turn. With `--background` a fourth arm, "local
prefill, one step" (`--local-prefill-chunk-tokens 0`), prefills the tail in one step, as before
the decode worker capped a local tail's tokens in a step that also decodes
(`local_prefill_chunk_tokens`, 32 on a CPU by default): the other stream's gap against the new
turn's first tokens. With `--draft`, every worker has the demo draft (as `make serve`'s): the
decode workers speculate, and a later turn's reuse needs the draft's K/V of its blocks too.
Writes JSON and PNG under benchmarks/results/ and, for the default run, its BENCHMARKS.md section.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
from launcher import Launcher, scrape
from report import Spread, host, machine, update_section
from tqdm import tqdm

from pdserve.engine.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = str(REPO / "models" / "demo")
DRAFT = str(REPO / "models" / "demo-draft")
WORKER = ["--model", MODEL, "--num-kv-blocks", "1024", "--max-num-seqs", "8"]
OPENING, QUESTION, ANSWER = 256, 64, 32
ARMS = ("local prefill", "push", "no reuse")
ARM_FLAGS = {"local prefill": [], "push": ["--local-prefill-tokens", "0"], "no reuse": ["--no-prefix-caching"],
             "local prefill, one step": ["--local-prefill-chunk-tokens", "0"]}
# with --background, also the tail prefilled in one step (the decode worker's prompt chunks not capped)
BACKGROUND_ARMS = (*ARMS, "local prefill, one step")
SECTION = "Multi-turn conversations (`benchmarks/multi_turn.py`)"


@functools.cache
def _source_ids() -> tuple[int, ...]:
    """This repository's engine sources, tokenized once."""
    tok = Tokenizer.from_dir(MODEL)
    return tuple(t for p in sorted((REPO / "engine").rglob("*.py")) for t in tok.encode(p.read_text()))


def source_cuts(num: int, length: int, salt: int) -> list[list[int]]:
    """`num` cuts of `length` tokens from this repository's engine sources, distinct per salt."""
    ids = list(_source_ids())
    step = (len(ids) - length) // (num + 1)
    return [ids[(i + 1) * step + salt * 7:(i + 1) * step + salt * 7 + length] for i in range(num)]


def turn(stub, prompt: list[int]) -> tuple[float, float, list[int]]:
    """(TTFT, time to the second token, the answer's tokens) of one greedy request."""
    start, first, second, ids = time.perf_counter(), None, None, []
    for msg in stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), sampling_params=gen.SamplingParams(
            temperature=0, max_tokens=ANSWER, ignore_eos=True)), timeout=120):
        first = first or time.perf_counter() - start
        ids += msg.token_ids
        second = second or (time.perf_counter() - start if len(ids) >= 2 else None)
    return first, second, ids


class Background:
    """Another stream on an arm's pair while a turn runs: when each of its messages came."""

    TOKENS = 1500  # outlasts any turn

    def __init__(self, stub, salt: int):
        self.times: list[float] = []
        self.call = stub.Generate(gen.GenerateRequest(
            token_ids=gen.TokenIds(ids=source_cuts(1, 24, salt=salt)[0]),
            sampling_params=gen.SamplingParams(temperature=0, max_tokens=self.TOKENS, ignore_eos=True)), timeout=120)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while len(self.times) < 8:  # decoding steadily before the turn starts
            assert time.monotonic() < deadline and self.thread.is_alive(), "the background stream did not start"
            time.sleep(0.002)

    def _read(self) -> None:
        try:
            for _ in self.call:
                self.times.append(time.perf_counter())
        except grpc.RpcError:
            pass  # cancelled

    def gaps(self, start: float, end: float) -> tuple[float, float]:
        """(the longest gap between its messages that overlaps [start, end], the median gap before);
        it ends the stream once a message came after `end`."""
        deadline = time.monotonic() + 30
        while self.times[-1] < end:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the background stream stopped"
            time.sleep(0.001)
        self.call.cancel()
        self.thread.join(timeout=10)
        pairs = list(zip(self.times, self.times[1:]))
        return (max(b - a for a, b in pairs if b > start and a < end),
                statistics.median(b - a for a, b in pairs if b <= start))


def one_repeat(stubs: dict, metrics: dict, r: int, conversations: int, turns: int, background: bool = False) -> dict:
    """metrics: each arm's {"P": ..., "D": ...} metrics addresses."""
    openings = source_cuts(conversations, OPENING, salt=r)
    questions = source_cuts(conversations * turns, QUESTION, salt=r + 1000)
    arms = tuple(stubs)
    samples = {arm: {"ttft_s": [], "second_s": [], "kv_bytes": [], "hit_tokens": [], "prefill_tokens": [],
                     "stall_s": [], "gap_s": []} for arm in arms}
    for c, history in enumerate(openings):
        for t in range(turns):
            k = (r + c + t) % len(arms)
            answer = None
            for arm in arms[k:] + arms[:k]:
                other = Background(stubs[arm], salt=r * 100 + c * 10 + t) if background else None
                before = {w: scrape(a) for w, a in metrics[arm].items()}
                start = time.perf_counter()
                ttft, second, ids = turn(stubs[arm], history)
                end = time.perf_counter()
                after = {w: scrape(a) for w, a in metrics[arm].items()}
                stall, gap = other.gaps(start, end) if other else (None, None)
                d = {(w, name): after[w][name] - before[w][name] for w in after for name in after[w]}
                if t:  # a later turn
                    s = samples[arm]
                    s["ttft_s"].append(ttft)
                    s["second_s"].append(second)
                    s["kv_bytes"].append(d["D", "pdserve:kv_transfer_bytes_total"])
                    s["hit_tokens"].append(d["D", "pdserve:prefix_cache_hits_total"])
                    s["prefill_tokens"].append(d["P", "pdserve:prefix_cache_queries_total"]
                                               - d["P", "pdserve:prefix_cache_hits_total"])
                    s["stall_s"].append(stall)
                    s["gap_s"].append(gap)
                answer = ids if arm == arms[0] else answer
            history = history + answer + questions[c * turns + t]
    return {arm: {"ttft_p50_s": statistics.median(s["ttft_s"]), "second_p50_s": statistics.median(s["second_s"]),
                  "kv_bytes_mean": statistics.mean(s["kv_bytes"]), "hit_tokens_mean": statistics.mean(s["hit_tokens"]),
                  "prefill_tokens_mean": statistics.mean(s["prefill_tokens"]),
                  **({"stall_p50_s": statistics.median(s["stall_s"]), "stall_max_s": max(s["stall_s"]),
                      "gap_p50_s": statistics.median(s["gap_s"])} if background else {}),
                  **s} for arm, s in samples.items()}


def markdown(result: dict) -> str:
    runs, a = result["repeats"], result["args"]
    arms = tuple(runs[0])
    ms = lambda arm, key="ttft_p50_s": Spread.of(rep[arm][key] * 1e3 for rep in runs)  # noqa: E731
    kb = lambda arm: Spread.of(rep[arm]["kv_bytes_mean"] / 1024 for rep in runs)  # noqa: E731
    mean = lambda arm, key: Spread.of(rep[arm][key] for rep in runs)  # noqa: E731
    ratio = lambda a, b, key: Spread.of(rep[a][key] / rep[b][key] for rep in runs)  # noqa: E731
    lines = [f"Command: `PYTHONPATH=benchmarks .venv/bin/python {result['command']}` ({a['repeats']} repeats of "
             f"{a['conversations']} conversations of {a['turns']} turns: a {OPENING}-token opening, then per turn "
             f"a {ANSWER}-token greedy answer and a {QUESTION}-token question; demo target, workers pinned, "
             + ("K/V over gRPC (`--no-kv-shm`, as between nodes), " if a["no_kv_shm"] else "K/V through shared "
                "memory (the default on one node), ")
             + ("each turn beside one other stream on its pair" if a["background"] else "one request at a time")
             + (", every worker with the demo draft (the decode workers speculate)" if a.get("draft") else "")
             + f"). Machine: {host(result['machine'])}. Figures per later turn, min / median / max over repeats.", "",
             "| arm | TTFT p50 (ms) | second token p50 (ms) | KV received per turn (KiB) | prompt tokens found "
             "on the decode worker | prompt tokens the prefill worker computed |"
             + (" other stream's longest gap in a turn, p50 / max (ms) | its median gap before (ms) |"
                if a["background"] else ""), "|---|---|---|---|---|---|" + ("---|---|" if a["background"] else "")]
    for arm in arms:
        lines.append(f"| {arm} | {ms(arm).fmt(1)} | {ms(arm, 'second_p50_s').fmt(1)} | {kb(arm).fmt(0)} | "
                     f"{mean(arm, 'hit_tokens_mean').fmt(0)} | {mean(arm, 'prefill_tokens_mean').fmt(0)} |"
                     + (f" {ms(arm, 'stall_p50_s').fmt(1)}, {ms(arm, 'stall_max_s').fmt(1)} | "
                        f"{ms(arm, 'gap_p50_s').fmt(2)} |" if a["background"] else ""))
    lines += [""]
    for a, b in (("local prefill", "push"), ("local prefill", "no reuse"), ("push", "no reuse")):
        lines.append(f"- {a} / {b}, per repeat: TTFT {ratio(a, b, 'ttft_p50_s').fmt(2)}×, time to the second "
                     f"token {ratio(a, b, 'second_p50_s').fmt(2)}×"
                     + (f", KV bytes received {ratio(a, b, 'kv_bytes_mean').fmt(3)}×." if a == "push" else "."))
    if "local prefill, one step" in arms:
        a, b = "local prefill", "local prefill, one step"
        lines.append(f"- {a} / {b}, per repeat: TTFT {ratio(a, b, 'ttft_p50_s').fmt(2)}×, time to the second "
                     f"token {ratio(a, b, 'second_p50_s').fmt(2)}×, the other stream's longest gap (p50) "
                     f"{ratio(a, b, 'stall_p50_s').fmt(2)}×.")
    lines += ["", f"Files: `{result['out']}.json`, `.png`."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["repeats"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for arm in runs[0]:
        ax1.plot([rep[arm]["ttft_p50_s"] * 1e3 for rep in runs], marker="o", label=f"{arm}: first token")
        ax1.plot([rep[arm]["second_p50_s"] * 1e3 for rep in runs], marker="s", label=f"{arm}: second token")
        ax2.plot([rep[arm]["kv_bytes_mean"] / 1024 for rep in runs], marker="o", label=arm)
    ax1.set(xlabel="repeat", ylabel="p50, later turns (ms)")
    ax2.set(xlabel="repeat", ylabel="KV received per later turn (KiB)")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 repeat of 2 conversations of 2 turns: checks the script")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--no-kv-shm", action="store_true", help="K/V over gRPC, as to a decode worker on another node")
    p.add_argument("--draft", action="store_true", help="every worker with the demo draft; the decode workers "
                   "speculate")
    p.add_argument("--background", action="store_true", help="each turn beside another stream on its pair: what "
                   "that stream's tokens wait for the turn")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.conversations, args.turns = 1, 2, 2
    stem = ("multi_turn" + ("_no_kv_shm" if args.no_kv_shm else "") + ("_background" if args.background else "")
            + ("_draft" if args.draft else "") + ("_quick" if args.quick else ""))
    runs = []
    with tempfile.TemporaryDirectory() as logs, Launcher(Path(logs)) as run:
        routers, workers = {}, {}
        arms = BACKGROUND_ARMS if args.background else ARMS
        for arm in arms:
            tag = arm.replace(",", "").replace(" ", "-")
            worker = [*WORKER, *(["--draft-model", DRAFT] if args.draft else [])]
            prefill = run.worker("prefill-worker", f"P-{tag}", [*worker, *(["--no-kv-shm"] if args.no_kv_shm else [])], [0])
            decode = run.worker("decode-worker", f"D-{tag}", [*worker, *ARM_FLAGS[arm]], [1])
            routers[arm] = run.router(f"R-{tag}", MODEL, [prefill], [decode])
            workers[arm] = {"P": prefill, "D": decode}
        run.wait_ready()
        metrics = {arm: {w: proc.metrics_address for w, proc in pair.items()} for arm, pair in workers.items()}
        channels = {arm: grpc.insecure_channel(r.address) for arm, r in routers.items()}
        stubs = {arm: generation_pb2_grpc.GenerationStub(ch) for arm, ch in channels.items()}
        for arm in arms:  # warm-up
            turn(stubs[arm], source_cuts(1, OPENING, salt=999)[0])
        for r in tqdm(range(args.repeats), desc="repeats", unit="repeat"):
            runs.append(one_repeat(stubs, metrics, r, args.conversations, args.turns, args.background))
        for ch in channels.values():
            ch.close()
    out = RESULTS / stem
    command = "benchmarks/multi_turn.py" + ("" if args.quick else f" --repeats {args.repeats} --conversations "
                                            f"{args.conversations} --turns {args.turns}") \
        + (" --quick" if args.quick else "") + (" --no-kv-shm" if args.no_kv_shm else "") \
        + (" --background" if args.background else "") + (" --draft" if args.draft else "")
    result = {"repeats": runs, "args": vars(args), "machine": machine(), "command": command,
              "out": str(out.relative_to(REPO))}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    body = markdown(result)
    print(body)
    if not args.quick and not args.no_kv_shm and not args.background and not args.draft:
        update_section(REPO / "BENCHMARKS.md", SECTION, body)


if __name__ == "__main__":
    main()
