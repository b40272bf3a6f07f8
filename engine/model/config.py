"""`ModelConfig`: the parts of a Hugging Face `config.json` that the engine runs on.

Reads Llama 2/3, Qwen2 and Mistral configs in both the transformers 4 spelling (`rope_theta`,
`rope_scaling`, `torch_dtype`) and the transformers 5 one (`rope_parameters`, `dtype`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing files, bad config, mismatched weights."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...] | None  # frozen dict, None = default rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    config_dtype: str

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def max_model_len(self) -> int:
        """Context limit. Mistral's sliding window is not implemented, so contexts stay inside it."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def identity_hash(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _require(cfg: dict, key: str, path: Path) -> object:
    if key not in cfg:
        raise CheckpointError(f"{path}: config.json has no {key!r}")
    return cfg[key]


def _positive_int(cfg: dict, key: str, path: Path) -> int:
    value = _require(cfg, key, path)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{path}: config.json {key!r} must be a positive integer, got {value!r}")
    return value


def _rope(cfg: dict, path: Path) -> tuple[float, dict | None]:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"{path}: rope type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    merged["rope_type"] = rope_type
    needed = ("factor", "original_max_position_embeddings") if rope_type == "llama3" else ("factor",)
    for key in needed:
        if key not in merged:
            raise CheckpointError(f"{path}: rope scaling {rope_type!r} needs {key!r}")
    return theta, merged


def _eos_ids(cfg: dict, gen_cfg: dict) -> tuple[int, ...]:
    eos = gen_cfg.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def parse_config(cfg: dict, path: Path, gen_cfg: dict | None = None) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    hidden = _positive_int(cfg, "hidden_size", path)
    num_heads = _positive_int(cfg, "num_attention_heads", path)
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    theta, scaling = _rope(cfg, path)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    window = cfg.get("sliding_window") if (arch == "MistralForCausalLM" or cfg.get("use_sliding_window")) else None
    return ModelConfig(
        architecture=arch,
        vocab_size=_positive_int(cfg, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size", path),
        num_layers=_positive_int(cfg, "num_hidden_layers", path),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
        o_bias=(not is_qwen2) and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=int(window) if window else None,
        eos_token_ids=_eos_ids(cfg, gen_cfg or {}),
        bos_token_id=cfg.get("bos_token_id"),
        config_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json")
    gen_path = path / "generation_config.json"
    gen_cfg = _read_json(gen_path) if gen_path.is_file() else {}
    return parse_config(_read_json(path / "config.json"), path, gen_cfg)


def check_draft_matches(target: ModelConfig, draft: ModelConfig, target_dir: Path, draft_dir: Path) -> None:
    """A draft model must share the target's vocabulary and tokenizer (ValueError otherwise)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model vocab_size {draft.vocab_size} differs from the target's {target.vocab_size}")
    paths = [target_dir / "tokenizer.json", draft_dir / "tokenizer.json"]
    if all(p.is_file() for p in paths) and paths[0].read_bytes() != paths[1].read_bytes():
        raise ValueError("draft model's tokenizer.json differs from the target's: they must share one tokenizer")
