"""The host KV cache on memory that Linux may back with 2 MiB pages (`engine/huge_pages.py`)."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import huge_pages
from pdserve.engine.huge_pages import HUGE_PAGE, zeros_on_huge_pages

needs_madvise = pytest.mark.skipif(huge_pages._MADVISE is None,
                                   reason="no madvise to ask with here (not Linux, or huge pages set to never)")


def _vma_flags(address: int) -> dict[str, str]:
    """/proc/self/smaps's fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("shape,dtype", [((280, 16, 4, 32), torch.float32), ((600, 16, 2, 64), torch.bfloat16),
                                         ((3, 16, 4, 32), torch.float32)])
def test_zeros_are_zeros_of_the_shape_and_writable(shape, dtype):
    t = zeros_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert torch.count_nonzero(t) == 0
    t[-1, -1] = 1  # the last element is inside the memory asked for
    assert torch.count_nonzero(t) == t.shape[-1] * t.shape[-2]


@needs_madvise
def test_a_large_cache_starts_on_a_huge_page_and_is_eligible_for_them():
    t = zeros_on_huge_pages((280, 16, 4, 32), torch.float32)  # 2.2 MiB
    assert t.data_ptr() % HUGE_PAGE == 0
    flags = _vma_flags(t.data_ptr())
    assert flags.get("THPeligible") == "1", flags  # the madvise reached the mapping
    assert "hg" in flags.get("VmFlags", "").split(), flags


def test_a_small_tensor_is_an_ordinary_one():
    t = zeros_on_huge_pages((4, 16, 4, 32), torch.float32)  # 32 KiB: no whole huge page in it
    assert t.untyped_storage().nbytes() == t.numel() * 4


@needs_madvise
def test_the_engine_keeps_its_host_kv_cache_on_them(checkpoint):
    from pdserve.engine import LLM, SamplingParams

    path = checkpoint("llama", seed=5)
    llm = LLM(str(path), num_kv_blocks=4096, block_size=16)
    k, v = llm.engine.runner.kv_caches[0]
    assert k.numel() * k.element_size() >= HUGE_PAGE  # else the test would not test it
    assert k.data_ptr() % HUGE_PAGE == 0 and v.data_ptr() % HUGE_PAGE == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
