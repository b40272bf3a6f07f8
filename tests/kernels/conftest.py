"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before `triton` is first imported (it is read at import time), so it
is set here, at conftest import, before any test module imports `kernels`. `import torch` does
not import triton, so asking torch about CUDA first is safe. On a CUDA machine the kernels run
compiled instead.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET"
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    here = os.path.dirname(__file__)
    for item in items:
        if "gpu" in item.keywords and str(item.path).startswith(here):
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE
