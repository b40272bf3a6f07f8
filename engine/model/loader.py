"""Loading Hugging Face safetensors checkpoints into `CausalLM`, strictly.

Every tensor the model needs must be present with its exact shape, and every tensor in the
checkpoint must be used (rotary `inv_freq` buffers and a tied `lm_head` excepted); otherwise a
`CheckpointError` names the tensor and both shapes.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.model.config import CheckpointError, ModelConfig
from pdserve.engine.model.llama import CausalLM, PackedLinear
from pdserve.kernels import KernelOps

_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed: {e!r}") from None
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = [model_dir / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{model_dir}: weight file {f.name} is missing")
    return files


def _destinations(model: CausalLM) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name -> the (slice of the) parameter it fills."""
    dests = {}
    for name, param in model.named_parameters():
        fused = next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None:
            dests[name] = param.data
            continue
        sizes = model.model.layers[0].self_attn.split if fused == "qkv_proj" else (param.shape[0] // 2,) * 2
        offset = 0
        for part, size in zip(_FUSED[fused], sizes):
            dests[name.replace(fused, part)] = param.data.narrow(0, offset, size)
            offset += size
    return dests


def _is_ignorable(name: str, cfg: ModelConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def load_weights(model: CausalLM, model_dir: Path) -> None:
    dests = _destinations(model)
    missing = set(dests)
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name not in dests:
                    if _is_ignorable(name, model.cfg):
                        continue
                    raise CheckpointError(f"{model_dir}: checkpoint tensor {name!r} does not belong to a {model.cfg.architecture}")
                tensor = f.get_tensor(name)
                dest = dests[name]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise CheckpointError(
                        f"{model_dir}: tensor {name!r} has shape {tuple(tensor.shape)} but the config expects {tuple(dest.shape)}")
                dest.copy_(tensor)
                missing.discard(name)
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint lacks tensors {sorted(missing)[:5]}{' …' if len(missing) > 5 else ''}")


def build_model(cfg: ModelConfig, model_dir: Path, ops: KernelOps, dtype: torch.dtype, device: torch.device,
                packed_linears: bool = False) -> CausalLM:
    """packed_linears: the projections become `PackedLinear`s (the native ops must be loaded, and
    the model float32 on the CPU: `kernels.native.resolve_linear`)."""
    with torch.device("meta"):
        model = CausalLM(cfg, ops)
    _materialize(model, device, dtype)
    model.tie_weights()
    load_weights(model, model_dir)
    if packed_linears:
        _pack_linears(model)
    elif device.type == "cpu" and dtype == torch.float32:
        _column_major_linears(model)
    model.init_rope(cfg.max_model_len, device)
    return model.eval().requires_grad_(False)


def _materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give each parameter built on the meta device uninitialized storage of `dtype` on `device`
    (the checkpoint fills it). `Module.to_empty` would do the same through `empty_like` of a meta
    tensor, whose reference implementation imports sympy: a second of every worker's start. A
    parameter shared by two modules (a tied `lm_head`) gets one storage, not one each."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                                     requires_grad=False)
            module._parameters[name] = made[id(param)]


def _column_major_linears(model: CausalLM) -> None:
    """Lay every projection's weight out column-major, [out, in] with strides (1, out): float32
    on the CPU only.

    `F.linear(x, W)` multiplies by W transposed; with W column-major that transpose is a plain
    row-major [in, out] matrix, and the CPU BLAS streams it about 20% faster in float32 when x
    has few rows (a decode step), and no slower for large prefill batches. In bfloat16 and
    float16 the same layout is about 5x slower, so half types keep the row-major layout. A tied
    `lm_head` keeps the embedding's row-major layout, which the row lookup needs.
    """
    for _, module in _projections(model):
        module.weight = torch.nn.Parameter(module.weight.data.t().contiguous().t(), requires_grad=False)


def _pack_linears(model: CausalLM) -> None:
    """Every projection becomes a `PackedLinear`, except a `lm_head` tied to the embedding (packing
    it would keep a second copy of the embedding)."""
    for name, module in _projections(model):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, PackedLinear(module))


def _projections(model: CausalLM) -> list[tuple[str, torch.nn.Linear]]:
    """Every `nn.Linear` by name, but a `lm_head` tied to the embedding: its layout is the
    embedding's, which the row lookup needs."""
    tied = model.cfg.tie_word_embeddings
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not (tied and name == "lm_head")]
