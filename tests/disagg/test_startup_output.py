"""What a server prints while it starts, read from the shared cluster's logs: its progress
(loading the weights and allocating the KV cache, warming up), then one ready line with the
addresses it bound, and nothing else at the default log level."""
from __future__ import annotations

import re


def test_workers_report_loading_kv_and_warmup_then_one_ready_line(cluster):
    for name, role in (("P", "prefill"), ("D", "decode")):
        lines = cluster.procs[name].log.read_text().splitlines()
        ready = [i for i, line in enumerate(lines) if line.startswith(f"pdserve {role}-worker ready: grpc=")]
        assert len(ready) == 1, lines
        before = lines[:ready[0]]
        steps = [r"\] " + role + r" worker: loading .* and allocating the KV cache$",
                 r"\] " + role + r" worker: loaded in [\d.]+ s on cpu: KV cache 128 blocks of 16 tokens .*; "
                 r"projections: (packed (float32|bfloat16|float32 and bfloat16) panels|nn.Linear)",
                 r"\] " + role + r" worker: warmed up in [\d.]+ s$"]
        assert len(before) == len(steps) and all(re.search(p, line) for p, line in zip(steps, before)), before


def test_the_router_prints_only_its_ready_line(cluster):
    lines = cluster.procs["R"].log.read_text().splitlines()
    assert lines[0].startswith("pdserve router ready: grpc=") and "http=" in lines[0]
    assert not [line for line in lines if "Traceback" in line or "Event loop is closed" in line]
