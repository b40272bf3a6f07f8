"""Shared fixtures: tiny random-weight checkpoints saved with `transformers`, cached per session.
The builders live in `tinymodels.py` (importable from any test: `tests` is on pythonpath)."""
from __future__ import annotations

import json
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests run tiny models, often beside server processes on 2 cores: one intra-op thread each
# avoids OpenMP spin-waiting under oversubscription (a 30 us op took 8 ms with 2 threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from tinymodels import build_checkpoint, build_tokenizer

torch.set_num_threads(1)
# Without CUDA the Triton kernels run interpreted. The variable is read when triton is first
# imported, and `import torch` does not import it, so this is early enough.
if not torch.cuda.is_available():
    import sys

    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET could be set"
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(items):
    """`@pytest.mark.gpu` tests, wherever they live, skip on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(arch="llama", seed=0, **config_overrides) -> path, built once per argument set."""
    cache = {}

    def make(arch: str = "llama", seed: int = 0, **overrides):
        key = json.dumps([arch, seed, overrides], sort_keys=True)
        if key not in cache:
            cache[key] = build_checkpoint(tmp_path_factory.mktemp(arch), arch, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """A tiny Llama with a real byte-level BPE tokenizer (EOS = id 1)."""
    path = tmp_path_factory.mktemp("text_llama")
    tok = build_tokenizer(path)
    build_checkpoint(path, "llama", vocab_size=tok.get_vocab_size(), eos_token_id=1)
    return path
