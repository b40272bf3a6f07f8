"""What the benchmark smoke tests share: loading a script of benchmarks/ as a module."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark("cpu_linear"): benchmarks/cpu_linear.py, imported under a name of its own
    (registered in sys.modules, where dataclasses look their module up)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module

    return load
