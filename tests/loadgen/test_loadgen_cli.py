"""`pdserve bench` from the shell: bad input is one line on stderr and exit status 2, with no
traceback; the rate flags parse as documented."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.loadgen.cli import parse_rates

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--prompt-len", "zipf:2"], "--prompt-len: unknown length distribution 'zipf'"),
    (["--request-rate", "-3"], "--request-rate: a request rate must be > 0"),
    (["--request-rates", "1,0"], "--request-rates: a request rate must be > 0"),
    (["--arrival", "weibull"], "--arrival: unknown value 'weibull'"),
    (["--arrival", "gamma", "--burstiness", "0"], "burstiness must be"),
    (["--goodput-search", "1:8"], "needs an SLO"),
    (["--workload", "jsonl"], "needs a dataset"),
    ([], "--target: cannot connect"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = subprocess.run([PDSERVE, "bench", "--target", f"127.0.0.1:{closed_port()}", "--num-requests", "2",
                          "--quiet", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr, out.stderr


def test_an_unreachable_http_target_is_bad_input_too():
    out = subprocess.run([PDSERVE, "bench", "--http", f"http://127.0.0.1:{closed_port()}", "--quiet"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot reach --http" in out.stderr and "Traceback" not in out.stderr


def test_rate_lists_and_ranges():
    assert parse_rates("1,2,4") == (1.0, 2.0, 4.0)
    assert parse_rates("1:3:0.5") == (1.0, 1.5, 2.0, 2.5, 3.0)
    assert parse_rates("1:16:x2") == (1.0, 2.0, 4.0, 8.0, 16.0)
    assert parse_rates("inf") == (float("inf"),)
    for bad in ("3:1:1", "1:4:x1", "1:2", "a,b"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_importing_the_load_generator_loads_no_heavy_dependency():
    """matplotlib, numpy, aiohttp, tqdm and tokenizers are imported only where they are used."""
    code = """
import importlib, pkgutil, sys
import pdserve.loadgen, pdserve.client
for pkg in (pdserve.loadgen, pdserve.client):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
heavy = [m for m in ("torch", "matplotlib", "numpy", "aiohttp", "tqdm", "tokenizers") if m in sys.modules]
assert not heavy, heavy
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
