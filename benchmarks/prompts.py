"""The speculation benchmarks' prompts: cuts of this repository's own Python sources, tokenized,
the same on every run (spec_decode.py, draft_passes.py, spec_by_revision.py)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT_SOURCES = ("engine", "kernels")


def code_prompts(tokenizer, num: int, min_len: int = 64, max_len: int = 128) -> list[list[int]]:
    """`num` cuts of 64–128 tokens from this repository's own sources, round-robin over files."""
    files = sorted(p for d in PROMPT_SOURCES for p in (REPO / d).rglob("*.py"))
    per_file = [tokenizer.encode(p.read_text()) for p in files]
    prompts, offset, i = [], 0, 0
    while len(prompts) < num:
        ids = per_file[i % len(per_file)]
        length = min_len + (len(prompts) * 37) % (max_len - min_len + 1)
        start = offset * 211
        if start + length <= len(ids):
            prompts.append(ids[start:start + length])
        i += 1
        if i % len(per_file) == 0:
            offset += 1
            if offset * 211 > max(map(len, per_file)):
                raise ValueError(f"not enough source text for {num} prompts")
    return prompts
