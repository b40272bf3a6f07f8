"""What each request asks for: a prompt and how many tokens to generate.

Three sources, each a pure function of its config and seed (so a run repeats exactly):

- `random`: prompts of random token ids in [0, vocab_size), lengths from `prompt_len`;
- `code`: cuts of the Python standard library's own source (`sysconfig.get_paths()["stdlib"]`,
  present wherever Python is, no downloads). With a tokenizer (`tokenizer.json` or the model
  directory holding it) the cuts are exact token counts, sent as token ids; without one they
  are `prompt_len × chars_per_token` characters, sent as text;
- `jsonl`: a file with one JSON object per line: `{"prompt": "..." | [ids], "max_tokens": n}`
  (`max_tokens` optional: drawn from `output_len` when absent), taken in a seeded order.

Output lengths come from `output_len`; with `ignore_eos` (the bench default) a request
generates exactly that many tokens.
"""
from __future__ import annotations

import functools
import json
import random
import sysconfig
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from pdserve.loadgen.lengths import LengthDistribution

MAX_PICKS = 50  # files tried for one code cut before joining files to reach the length


class WorkloadKind(Enum):
    RANDOM = "random"
    CODE = "code"
    JSONL = "jsonl"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt: str | tuple[int, ...]
    max_tokens: int
    num_prompt_tokens: int | None = None  # known when the prompt is token ids


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    kind: WorkloadKind = WorkloadKind.CODE
    prompt_len: LengthDistribution = LengthDistribution.parse("uniform:32,256")
    output_len: LengthDistribution = LengthDistribution.parse("uniform:16,128")
    vocab_size: int = 256  # random prompts draw ids below this
    dataset: str | None = None  # the jsonl file
    tokenizer: str | None = None  # tokenizer.json, or a directory holding one (code workload)
    chars_per_token: float = 4.0  # code workload without a tokenizer

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")
        if self.kind is WorkloadKind.JSONL and not self.dataset:
            raise ValueError("the jsonl workload needs a dataset file")
        if self.dataset and not Path(self.dataset).is_file():
            raise ValueError(f"dataset {self.dataset} is not a file")


def build_workload(config: WorkloadConfig, num_requests: int, seed: int) -> list[RequestSpec]:
    """The requests, built once a process for each (config, count, seed): a sweep's rates, a
    goodput search's steps and the simulator's prediction for each ask for the same ones, and a
    code workload of 120 tokenized prompts took 1.3 s of CPU to build (the planner validation's
    load generator built its workload again for every rate it measured and predicted). A JSONL
    file is read each time: it may change between calls."""
    if config.kind is WorkloadKind.JSONL:
        return _jsonl_requests(config, num_requests, random.Random(seed))
    return list(_built(config, num_requests, seed))


@functools.lru_cache(maxsize=8)
def _built(config: WorkloadConfig, num_requests: int, seed: int) -> tuple[RequestSpec, ...]:
    rng = random.Random(seed)
    if config.kind is WorkloadKind.RANDOM:
        return tuple(_random_request(config, rng) for _ in range(num_requests))
    return tuple(_cutter(config).requests(num_requests, rng))


@functools.lru_cache(maxsize=2)
def _cutter(config: WorkloadConfig) -> "CodeCutter":
    """One `CodeCutter` a config: the files it tokenized stay tokenized for the next seed."""
    return CodeCutter(config)


def _random_request(config: WorkloadConfig, rng: random.Random) -> RequestSpec:
    n = config.prompt_len.sample(rng)
    ids = tuple(rng.randrange(config.vocab_size) for _ in range(n))
    return RequestSpec(ids, config.output_len.sample(rng), n)


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, in a fixed order (third-party folders left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"tokenizer: {p} is not a file")
    return Tokenizer.from_file(str(p))


class CodeCutter:
    """Cuts of standard-library files, in tokens (with a tokenizer) or characters."""

    def __init__(self, config: WorkloadConfig):
        self.config = config
        self.files = stdlib_sources()
        if not self.files:
            raise ValueError("no standard library sources found under sysconfig's stdlib path")
        self.tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        self._cache: dict[Path, object] = {}

    def _units(self, path: Path):
        """A file's text (no tokenizer) or its token ids."""
        if path not in self._cache:
            text = path.read_text(encoding="utf-8", errors="replace")
            self._cache[path] = tuple(self.tokenizer.encode(text).ids) if self.tokenizer else text
        return self._cache[path]

    def requests(self, num: int, rng: random.Random) -> list[RequestSpec]:
        out = []
        for _ in range(num):
            num_tokens = self.config.prompt_len.sample(rng)
            size = num_tokens if self.tokenizer else max(1, round(num_tokens * self.config.chars_per_token))
            cut = self.cut(size, rng)
            prompt = tuple(cut) if self.tokenizer else cut
            out.append(RequestSpec(prompt, self.config.output_len.sample(rng),
                                   len(cut) if self.tokenizer else None))
        return out

    def cut(self, size: int, rng: random.Random):
        """`size` tokens (or characters, without a tokenizer) of one file, or of files joined."""
        for _ in range(MAX_PICKS):
            units = self._units(self.files[rng.randrange(len(self.files))])
            if len(units) >= size:
                start = rng.randrange(len(units) - size + 1)
                return units[start:start + size]
        joined = self._units(self.files[rng.randrange(len(self.files))])
        while len(joined) < size:  # a length longer than most files: join files
            joined = joined + self._units(self.files[rng.randrange(len(self.files))])
        return joined[:size]


def _jsonl_requests(config: WorkloadConfig, num: int, rng: random.Random) -> list[RequestSpec]:
    entries = read_jsonl(Path(config.dataset))
    order = list(range(len(entries)))
    rng.shuffle(order)
    out = []
    for i in range(num):
        prompt, max_tokens = entries[order[i % len(order)]]
        out.append(RequestSpec(prompt, max_tokens or config.output_len.sample(rng),
                               len(prompt) if isinstance(prompt, tuple) else None))
    return out


def read_jsonl(path: Path) -> list[tuple[str | tuple[int, ...], int | None]]:
    """(prompt, max_tokens or None) per line; ValueError names the line that is wrong."""
    entries = []
    for num, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{num}: not JSON ({e.msg})") from None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            prompt = tuple(prompt)
        if not isinstance(prompt, (str, tuple)) or not prompt:
            raise ValueError(f"{path}:{num}: 'prompt' must be a non-empty string or list of token ids")
        max_tokens = obj.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
            raise ValueError(f"{path}:{num}: 'max_tokens' must be an integer >= 1")
        entries.append((prompt, max_tokens))
    if not entries:
        raise ValueError(f"{path}: no requests in the file")
    return entries
