"""`keep_freed_memory`: a worker's large message buffers are reused instead of page-faulted in
afresh each time (counted in a fresh process, by its minor page faults). glibc's own dynamic
thresholds already reuse one buffer freed and allocated again; what they return to the system
is a push's worth of buffers alive together (more than twice the last freed one)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, sys
from pdserve.serving.allocator import keep_freed_memory
tuned = sys.argv[1] == "tuned" and keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def fill(n):  # a 4 MiB message, written through (as a chunk made in its message is)
    b = bytearray(n)
    b[::4096] = b"x" * len(b[::4096])
    return b
def push():  # a long prompt's 64 MiB of chunks, alive together until sent
    return [fill(4 << 20) for _ in range(16)]
push()
before = faults()
for _ in range(5):
    push()
print(tuned, faults() - before)
"""


def _faults(mode: str, env: dict | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **(env or {})}, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_buffers_are_reused_once_freed():
    tuned, tuned_faults = _faults("tuned")
    _, plain_faults = _faults("plain")
    assert tuned == "True"
    pages = 5 * 16 * 1024  # five pushes of sixteen 4 MiB buffers
    assert plain_faults > pages // 2  # about one fault per 4 KiB page of every buffer
    assert tuned_faults < pages // 10  # the same pages again


def test_a_deployments_own_malloc_settings_are_left_alone():
    tuned, _ = _faults("tuned", {"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert tuned == "False"
