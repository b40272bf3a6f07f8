"""Shared fixtures: tiny random-weight checkpoints saved with `transformers`, cached per session.
The builders live in `tinymodels.py` (importable from any test: `tests` is on pythonpath)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests run tiny models, often beside server processes on 2 cores: one intra-op thread each
# avoids OpenMP spin-waiting under oversubscription (a 30 us op took 8 ms with 2 threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from native_variants import Builder
from tinymodels import build_checkpoint, build_tokenizer

torch.set_num_threads(1)
# Without CUDA the Triton kernels run interpreted. The variable is read when triton is first
# imported, and `import torch` does not import it, so this is early enough.
if not torch.cuda.is_available():
    import sys

    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET could be set"
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests, wherever they live, skip on a machine without CUDA. When a
    selected test builds a native variant, the background build starts now (`native_variants.py`)."""
    if any("native_variant" in item.fixturenames for item in items):
        config._pdserve_native_builder = Builder(Path(tempfile.mkdtemp(prefix="pdserve-native-variants-")))
        config._pdserve_native_builder.start()
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config):
    builder = getattr(config, "_pdserve_native_builder", None)
    if builder is not None:
        builder.stop()
        shutil.rmtree(builder.build_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def native_variant(request):
    """native_variant(name) -> its op namespace (`native_variants.VARIANTS`), built beside the suite."""
    from pdserve.kernels import native

    assert native.load(), native.error()
    builder = getattr(request.config, "_pdserve_native_builder", None)
    assert builder is not None, "the background build starts when a collected test uses this fixture"
    return builder.ops


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


@pytest.fixture(scope="session")
def serving_model(checkpoint) -> Path:
    """A tiny random Llama with a tokenizer beside it."""
    path = Path(checkpoint("llama", seed=3, vocab_size=320))
    if not (path / "tokenizer.json").is_file():  # eos "</s>" = id 2, as in the checkpoint's config
        build_tokenizer(path, specials=(("pad_token", "<pad>"), ("bos_token", "<s>"), ("eos_token", "</s>")))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg))
    return path


# ChatML-style, with the checks real templates make (raise_exception) and the bos token
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] not in ['system', 'user', 'assistant', 'developer'] %}"
                 "{{ raise_exception('unknown role ' ~ m['role']) }}{% endif %}"
                 "{{ '<|' ~ m['role'] ~ '|>' ~ m['content'] ~ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


@pytest.fixture(scope="session")
def offline(serving_model):
    """The offline engine on the serving model: what every served request must equal."""
    from pdserve.engine import LLM

    return LLM(str(serving_model), num_kv_blocks=256)
