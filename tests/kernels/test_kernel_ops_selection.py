"""select_ops wiring: every Triton launcher keeps its reference's signature."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from pdserve.kernels import TORCH_OPS, select_ops


# ops the Triton backend runs through torch's reference, because its kernel was slower on the
# H200 (kernels/triton_ops.py says by how much)
REFERENCE_ON_TRITON = {"sample", "filter_probs"}


def test_triton_backend_has_every_op_with_the_reference_signature():
    ops = select_ops("triton", torch.device("cpu"))
    assert ops.name == "triton"
    for field in dataclasses.fields(ops):
        if field.name == "name":
            continue
        ref, fast = getattr(TORCH_OPS, field.name), getattr(ops, field.name)
        assert (fast is ref) == (field.name in REFERENCE_ON_TRITON), field.name
        assert list(inspect.signature(fast).parameters) == list(inspect.signature(ref).parameters), field.name


def test_auto_picks_torch_on_cpu():
    assert select_ops("auto", torch.device("cpu")) is TORCH_OPS


@pytest.mark.gpu
def test_auto_picks_triton_on_cuda():
    assert select_ops("auto", torch.device("cuda")).name == "triton"
