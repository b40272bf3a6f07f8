"""pdserve's inference engine, shared by the prefill pool, the decode pool and offline use.

`from pdserve.engine import LLM, SamplingParams`. Exports load lazily, so the torch-free modules
(`tokenizer`, `detokenizer`, `sampling_params`) import without torch.
"""
from __future__ import annotations

_EXPORTS = {
    "LLM": "pdserve.engine.llm",
    "LLMEngine": "pdserve.engine.llm_engine",
    "EngineConfig": "pdserve.engine.config",
    "SamplingParams": "pdserve.engine.sampling_params",
    "RequestOutput": "pdserve.engine.outputs",
    "FinishReason": "pdserve.engine.sequence",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")


__all__ = list(_EXPORTS)
