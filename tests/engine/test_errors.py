"""Every bad input gets a ValueError that names the problem."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model.config import CheckpointError


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(logprobs=99), "logprobs"),
    (dict(max_tokens=2.5), "max_tokens"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)


@pytest.fixture()
def ckpt(checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama"), dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(ckpt)


def test_malformed_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        LLM(ckpt)


def test_unsupported_architecture(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*not supported"):
        LLM(ckpt)


def test_unsupported_rope_type(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(CheckpointError, match="yarn"):
        LLM(ckpt)


def test_missing_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hidden_size"):
        LLM(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        LLM(ckpt)


def test_weight_shape_mismatch_names_tensor_and_shapes(ckpt):
    edit_config(ckpt, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \(\d+, \d+\) but the config expects"):
        LLM(ckpt)


def test_missing_and_unexpected_tensors(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks tensors.*model.norm.weight"):
        LLM(ckpt)
    tensors["model.norm.weight"] = torch.ones(64)
    tensors["model.extra.weight"] = torch.ones(3)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        LLM(ckpt)


def test_sharded_checkpoint_loads(ckpt, checkpoint):
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, ckpt / fname)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert LLM(ckpt).generate([[1, 2, 3]], greedy)[0].token_ids == \
        LLM(checkpoint("llama")).generate([[1, 2, 3]], greedy)[0].token_ids


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama"), max_model_len=64, num_kv_blocks=8)


@pytest.mark.parametrize("prompt, match", [
    ([], "prompt is empty"),
    ([1, 2, 999], r"token ids must be integers in \[0, 211\)"),
    ([1, -1], "token ids"),
    (list(range(64)), "64 tokens; the model's context is 64"),
    ("hello", "no tokenizer.json: pass prompts as token ids"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()


def test_request_bigger_than_cache(checkpoint):
    llm = LLM(checkpoint("llama"), num_kv_blocks=2)
    with pytest.raises(ValueError, match="needs 3 KV blocks but the cache has 2"):
        llm.generate([list(range(40))], SamplingParams(max_tokens=4))


def test_wrong_number_of_params(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize("option, value, match", [
    ("dtype", "float64", "EngineConfig.dtype"),
    ("kernel_backend", "cuda", "EngineConfig.kernel_backend"),
    ("block_size", 0, "EngineConfig.block_size"),
    ("speculative_method", "medusa", "EngineConfig.speculative_method"),
])
def test_bad_engine_options(checkpoint, option, value, match):
    with pytest.raises(ValueError, match=match):
        LLM(checkpoint("llama"), **{option: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda(checkpoint):
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(checkpoint("llama"), device="cuda")
