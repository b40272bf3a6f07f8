"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before `triton` is first imported (it is read at import time); the
root `tests/conftest.py` sets it before any test module imports `kernels`. On a CUDA machine the
kernels run compiled instead.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE

