"""pdserve's inference engine, shared by the prefill pool, the decode pool and offline use.

`from engine import LLM, SamplingParams`. Exports load lazily, so the torch-free modules
(`engine.tokenizer`, `engine.detokenizer`, `engine.sampling_params`) import without torch.
"""
from __future__ import annotations

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "FinishReason": "engine.sequence",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = list(_EXPORTS)
