"""Offline throughput: pdserve against `transformers`' batched `generate`, side by side in one run.

For each model (the committed demo target, and random-weight Llama configs built once and cached
under `benchmarks/.cache/`):

- **batch 1**: one prompt, greedy, a fixed number of new tokens (EOS ignored on both sides).
  Reported: the whole request's latency, and the decode step time, estimated as
  (time for N tokens - time for 1 token) / (N - 1), against this machine's floor: the model's
  parameter bytes divided by the read bandwidth measured in the same run (`report.py`).
- **mixed**: many prompts of seeded random lengths and seeded random `max_tokens`. pdserve gets
  every request with its own `max_tokens`; `transformers` runs static batches (left-padded with an
  attention mask) to the longest `max_tokens` of each batch. Useful tokens are the ones each
  request asked for, on both sides: rows that run past their own limit only cost time.

Every repeat runs both systems back to back (who goes first alternates), so load from other
processes skews both alike; each figure is min / median / max over the repeats of the per-repeat
ratio, and a goal is met only when the worst repeat meets it. Everything is fp32 on the CPU with
the same torch threads on both sides; pdserve runs with `--graph-capture` (compile by default:
its start-up, compile included, is reported apart from the timed runs).

    python benchmarks/offline_throughput.py            # full run, updates BENCHMARKS.md
    python benchmarks/offline_throughput.py --quick    # smoke run, writes *_quick files only
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]

import torch
from tqdm import tqdm

sys.path.insert(0, str(ROOT / "benchmarks"))
from report import Goal, Spread, machine, measure_read_bandwidth  # noqa: E402
from offline_throughput_report import print_summary, update_markdown, write_json, write_plot  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
CACHE_DIR = ROOT / "benchmarks" / ".cache"
PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 2


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A random-weight Llama config; `save_pretrained` output is cached by these fields."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = 8192
    max_position_embeddings: int = 1024
    seed: int = 0
    path: str = ""  # a committed checkpoint (relative to the repository) instead of random weights

    def cache_key(self) -> str:
        return "-".join(str(v) for v in asdict(self).values())


MODELS = {
    # the committed demo target: 8 layers, hidden 256, vocab 4096 (the shape fields are informative)
    "demo": ModelSpec("demo", 256, 8, 8, 4, 768, vocab_size=4096, max_position_embeddings=2048, path="models/demo"),
    "llama-100m": ModelSpec("llama-100m", 768, 12, 12, 4, 2048),
    "llama-10m": ModelSpec("llama-10m", 256, 6, 4, 2, 688),
}
DEFAULT_MODELS = ("demo", "llama-100m")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    models: tuple[ModelSpec, ...] = tuple(MODELS[m] for m in DEFAULT_MODELS)
    repeats: int = 5
    b1_prompt_len: int = 64
    b1_new_tokens: int = 64
    num_prompts: int = 32
    min_prompt_len: int = 16
    max_prompt_len: int = 256
    min_max_tokens: int = 8
    max_max_tokens: int = 128
    hf_batch_size: int = 32  # transformers' static batch; prompts run in chunks of this size
    bandwidth_mb: int = 256
    seed: int = 0
    threads: int = 1  # torch intra-op threads, both systems
    engine_options: dict = field(default_factory=lambda: {"graph_capture": "compile"})  # extra `LLM(...)` options
    cache_dir: Path = CACHE_DIR

    def __post_init__(self) -> None:
        for name in ("repeats", "b1_prompt_len", "num_prompts", "min_prompt_len", "min_max_tokens",
                     "hf_batch_size", "bandwidth_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.b1_new_tokens < 2:
            raise ValueError(f"b1_new_tokens must be >= 2 (the decode step is a difference), got {self.b1_new_tokens}")
        if self.min_prompt_len > self.max_prompt_len or self.min_max_tokens > self.max_max_tokens:
            raise ValueError("each min_* must be <= its max_*")


@dataclass(frozen=True, slots=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


# ---- setup ---------------------------------------------------------------------------------

def build_checkpoint(spec: ModelSpec, cache_dir: Path) -> Path:
    """Build (once) and return the directory of a random-weight Llama checkpoint (or the
    committed one the spec names)."""
    if spec.path:
        return ROOT / spec.path
    path = Path(cache_dir) / spec.cache_key()
    if (path / "model.safetensors").is_file():
        return path
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.LlamaConfig(
        hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings, eos_token_id=EOS_TOKEN_ID,
        bos_token_id=1, pad_token_id=PAD_TOKEN_ID, tie_word_embeddings=False)
    torch.manual_seed(spec.seed)
    model = transformers.LlamaForCausalLM(config)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(path)  # a half-written checkpoint never looks finished
    return path


def make_workload(cfg: BenchConfig, vocab_size: int, repeat: int = 0) -> list[Request]:
    """The mixed batch: the same prompt lengths and max_tokens in every repeat, fresh prompt tokens
    in each, so no repeat finds the previous one's prompts in pdserve's prefix cache."""
    shape, tokens = random.Random(cfg.seed), random.Random(f"{cfg.seed}/mixed/{repeat}")
    return [Request([tokens.randrange(3, vocab_size) for _ in range(shape.randint(cfg.min_prompt_len, cfg.max_prompt_len))],
                    shape.randint(cfg.min_max_tokens, cfg.max_max_tokens))
            for _ in range(cfg.num_prompts)]


def random_prompt(length: int, vocab_size: int, seed: str) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


# ---- the two systems -----------------------------------------------------------------------

class PdserveRunner:
    name = "pdserve"

    def __init__(self, path: Path, options: dict):
        from pdserve.engine import LLM

        start = time.perf_counter()
        self.llm = LLM(str(path), dtype="float32", device="cpu", **options)
        self.startup_seconds = time.perf_counter() - start  # weights, KV cache, graph capture

    def generate(self, requests: list[Request]) -> list[list[int]]:
        from pdserve.engine import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        outs = self.llm.generate([r.prompt_token_ids for r in requests], params)
        return [list(o.token_ids) for o in outs]


class HFRunner:
    """`transformers` static batching: each batch runs every row to its longest `max_tokens`."""

    name = "transformers"

    def __init__(self, path: Path, batch_size: int):
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.batch_size = batch_size

    def generate(self, requests: list[Request]) -> list[list[int]]:
        out = []
        for i in range(0, len(requests), self.batch_size):
            out.extend(self._generate_batch(requests[i:i + self.batch_size]))
        return out

    @torch.inference_mode()
    def _generate_batch(self, requests: list[Request]) -> list[list[int]]:
        width = max(len(r.prompt_token_ids) for r in requests)
        ids = torch.full((len(requests), width), PAD_TOKEN_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(requests):  # left padding: every row's last token lines up
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        num_new = max(r.max_tokens for r in requests)
        gen = self.model.generate(ids, attention_mask=mask, max_new_tokens=num_new, min_new_tokens=num_new,
                                  do_sample=False, eos_token_id=None, pad_token_id=PAD_TOKEN_ID)
        # a user gets only what they asked for; the rest of the row was wasted work
        return [gen[row, width:width + r.max_tokens].tolist() for row, r in enumerate(requests)]


def timed(runner, requests: list[Request]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    tokens = runner.generate(requests)
    return time.perf_counter() - t0, tokens


# ---- measurements --------------------------------------------------------------------------

def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy outputs are identical (informational: padding changes
    fp32 rounding in transformers' batch, and random weights have near-ties)."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def bench_model(spec: ModelSpec, cfg: BenchConfig, bandwidth_gbps: float, bar: tqdm) -> dict:
    path = build_checkpoint(spec, cfg.cache_dir)
    runners = [PdserveRunner(path, cfg.engine_options), HFRunner(path, cfg.hf_batch_size)]
    num_params = sum(p.numel() for p in runners[1].model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in runners[1].model.parameters())
    # every timed run has prompts of its own: pdserve's prefix cache (on by default) must not
    # skip a prefill that transformers does, nor the 1-token run's prefill the full run's
    warm = make_workload(cfg, spec.vocab_size, repeat=-1)
    for runner in runners:  # warm-up: first-call allocations, thread pools, lazy imports
        runner.generate([Request(random_prompt(16, spec.vocab_size, "warm"), 4)])
        runner.generate(warm[:2])

    times = {r.name: {"b1_full": [], "b1_first": [], "mixed": []} for r in runners}
    outputs: dict[str, dict[str, list[list[int]]]] = {r.name: {} for r in runners}
    for rep in range(cfg.repeats):
        b1_first = [Request(random_prompt(cfg.b1_prompt_len, spec.vocab_size, f"{cfg.seed}/b1_first/{rep}"), 1)]
        b1_full = [Request(random_prompt(cfg.b1_prompt_len, spec.vocab_size, f"{cfg.seed}/b1_full/{rep}"),
                           cfg.b1_new_tokens)]
        mixed = make_workload(cfg, spec.vocab_size, rep)
        for kind, requests in (("b1_first", b1_first), ("b1_full", b1_full), ("mixed", mixed)):
            for runner in (runners if rep % 2 == 0 else runners[::-1]):  # who goes first alternates
                seconds, tokens = timed(runner, requests)
                times[runner.name][kind].append(seconds)
                outputs[runner.name][kind] = tokens
                bar.update(1)
    floor_ms = param_bytes / (bandwidth_gbps * 1e9) * 1e3
    systems = {r.name: system_figures(times[r.name], outputs[r.name], cfg.b1_new_tokens, floor_ms) for r in runners}
    pd, hf = times["pdserve"], times["transformers"]
    goals = [
        Goal(f"{spec.name}: mixed-batch throughput, pdserve / transformers",
             Spread.of(h / p for p, h in zip(pd["mixed"], hf["mixed"])), 2.5, True),
        Goal(f"{spec.name}: batch-1 latency, transformers / pdserve",
             Spread.of(h / p for p, h in zip(pd["b1_full"], hf["b1_full"])), 1.5, True),
        Goal(f"{spec.name}: batch-1 decode step / memory floor",
             Spread.of(systems["pdserve"]["step_ms"].values[i] / floor_ms for i in range(cfg.repeats)), 3.0, False),
    ]
    return {
        "model": asdict(spec) | {"num_params": num_params, "param_bytes": param_bytes},
        "decode_floor_ms": floor_ms,
        "pdserve_startup_seconds": runners[0].startup_seconds,
        "systems": {name: {k: (v.as_dict() if isinstance(v, Spread) else v) for k, v in fig.items()}
                    for name, fig in systems.items()},
        "goals": [g.as_dict() for g in goals],
        "greedy_agreement": {kind: _agreement(outputs["pdserve"][kind], outputs["transformers"][kind])
                             for kind in ("b1_full", "mixed")},
        "mixed_workload": workload_summary(warm, cfg.hf_batch_size),
    }


def system_figures(times: dict[str, list[float]], outputs: dict[str, list[list[int]]], new_tokens: int,
                   floor_ms: float) -> dict:
    """Per-repeat figures of one system, as spreads."""
    steps = [(full - first) / (new_tokens - 1) * 1e3 for full, first in zip(times["b1_full"], times["b1_first"])]
    useful = sum(map(len, outputs["mixed"]))
    return {
        "b1_seconds": Spread.of(times["b1_full"]),
        "step_ms": Spread.of(steps),
        "step_vs_floor": Spread.of(s / floor_ms for s in steps),
        "mixed_tokens_per_s": Spread.of(useful / t for t in times["mixed"]),
        "mixed_useful_tokens": useful,
        "b1_tokens": sum(map(len, outputs["b1_full"])),
        "raw_seconds": times,
    }


def workload_summary(requests: list[Request], batch_size: int) -> dict:
    """The mixed batch, and the work static batching does for it: padded prompt tokens and
    generated tokens, useful or not. `static_batching_waste` is the throughput ratio an engine
    would get from skipping that work alone, at equal cost per token."""
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    useful = sum(r.max_tokens for r in requests)
    generated = sum(len(b) * max(r.max_tokens for r in b) for b in batches)
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    padded = sum(len(b) * max(len(r.prompt_token_ids) for r in b) for b in batches)
    return {"prompt_lens": [len(r.prompt_token_ids) for r in requests], "max_tokens": [r.max_tokens for r in requests],
            "prompt_tokens": prompt, "hf_padded_prompt_tokens": padded,
            "useful_tokens": useful, "hf_generated_tokens": generated,
            "static_batching_waste": (padded + generated) / (prompt + useful)}


def run_benchmark(cfg: BenchConfig, progress: bool = True) -> dict:
    """Every measurement of one run, as a JSON-ready dict."""
    torch.set_num_threads(cfg.threads)
    load_start = os.getloadavg()[0]
    bandwidth = measure_read_bandwidth(cfg.bandwidth_mb)
    total = len(cfg.models) * cfg.repeats * 3 * 2
    with tqdm(total=total, desc="offline throughput", unit="run", disable=not progress, leave=False) as bar:
        models = [bench_model(spec, cfg, bandwidth, bar) for spec in cfg.models]
    return {
        "benchmark": "offline_throughput",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "models"},
        "machine": machine() | {"load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0]},
        "read_bandwidth_gbps": bandwidth,
        "models": models,
    }


# ---- CLI -----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repeat, small model only; writes *_quick files")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, from {list(MODELS)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-lens", default="16,256", help="min,max prompt length of the mixed batch")
    p.add_argument("--max-tokens", default="8,128", help="min,max max_tokens of the mixed batch")
    p.add_argument("--b1-prompt-len", type=int, default=64)
    p.add_argument("--b1-new-tokens", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=None, help="transformers' static batch (default: all prompts)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both systems")
    p.add_argument("--graph-capture", default="compile", help="pdserve's graph_capture option")
    p.add_argument("--kv-cache-dtype", default="auto", help="pdserve's kv_cache_dtype option (auto: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--no-markdown", action="store_true", help="do not update BENCHMARKS.md")
    p.add_argument("--report-only", type=Path, default=None, metavar="JSON",
                   help="measure nothing: redraw the plot and BENCHMARKS.md from a saved result")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    lo_p, hi_p = (int(x) for x in args.prompt_lens.split(","))
    lo_t, hi_t = (int(x) for x in args.max_tokens.split(","))
    cfg = BenchConfig(
        models=tuple(MODELS[name] for name in args.models.split(",")), repeats=args.repeats,
        b1_prompt_len=args.b1_prompt_len, b1_new_tokens=args.b1_new_tokens, num_prompts=args.num_prompts,
        min_prompt_len=lo_p, max_prompt_len=hi_p, min_max_tokens=lo_t, max_max_tokens=hi_t,
        hf_batch_size=args.hf_batch_size or args.num_prompts, seed=args.seed, threads=args.threads,
        engine_options={"graph_capture": args.graph_capture,
                        **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {})})
    if args.quick:
        cfg = replace(cfg, models=(MODELS["llama-10m"],), repeats=1, b1_prompt_len=16, b1_new_tokens=8,
                      num_prompts=8, min_prompt_len=8, max_prompt_len=48, min_max_tokens=2, max_max_tokens=16,
                      hf_batch_size=8, bandwidth_mb=64, engine_options={"graph_capture": "off"})
    return cfg


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report_only:
        result = json.loads(args.report_only.read_text())
        write_plot(result, args.report_only.parent, args.report_only.stem)
        if not args.no_markdown:
            update_markdown(result, result["command"])
        print_summary(result, result["command"])
        return
    cfg = config_from_args(args)
    torch.manual_seed(cfg.seed)
    result = run_benchmark(cfg)
    command = "python benchmarks/offline_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result["command"] = command.strip()
    stem = "offline_throughput_quick" if args.quick else "offline_throughput"
    json_path = write_json(result, args.out_dir, stem)
    png_path = write_plot(result, args.out_dir, stem)
    if not (args.quick or args.no_markdown):
        update_markdown(result, result["command"])
    print_summary(result, result["command"])
    print(f"wrote {json_path}, {png_path.name}" + ("" if args.quick or args.no_markdown else ", BENCHMARKS.md"))


if __name__ == "__main__":
    main()
