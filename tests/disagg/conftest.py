"""One shared set of real processes on loopback for every serving test.

    prefill P ──► decode D   ◄── router R  (disaggregated; R3: same pair, no admission queue)
                  decode D2  ◄── router R2 (colocated; block size 8, so D2 never pairs with P)

Started once per session, in parallel, each waited for until grpc.health.v1 says SERVING;
torn down with SIGTERM (then SIGKILL). A process's log is shown when it fails to start. Each
serves Prometheus /metrics on a port of its own (`Proc.metrics_address`, `Cluster.metrics`).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from procs import MAX_NUM_SEQS, MAX_PROMPT_CHARS, NUM_KV_BLOCKS, START_TIMEOUT_S, Cluster, Proc, free_port, wait_serving
from tinymodels import build_tokenizer


@pytest.fixture(scope="session")
def serving_model(checkpoint) -> Path:
    """A tiny random Llama with a tokenizer beside it."""
    path = Path(checkpoint("llama", seed=3, vocab_size=320))
    if not (path / "tokenizer.json").is_file():  # eos "</s>" = id 2, as in the checkpoint's config
        build_tokenizer(path, specials=(("pad_token", "<pad>"), ("bos_token", "<s>"), ("eos_token", "</s>")))
    return path


@pytest.fixture(scope="session")
def offline(serving_model):
    """The offline engine on the serving model: what every served request must equal."""
    from pdserve.engine import LLM

    return LLM(str(serving_model), num_kv_blocks=256)


@pytest.fixture(scope="session")
def cluster(serving_model, tmp_path_factory) -> Cluster:
    logs = tmp_path_factory.mktemp("logs")
    c = Cluster(serving_model)
    worker = ["--model", str(serving_model), "--num-threads", "1", "--max-num-seqs", str(MAX_NUM_SEQS),
              "--num-kv-blocks", str(NUM_KV_BLOCKS), "--kv-transfer-timeout", "20"]
    # P and D speculate (the model drafting for itself, fixed depth: every draft accepted, so
    # steps emit several tokens); the colocated D2 does not
    draft = ["--draft-model", str(serving_model)]
    specs = {"P": ["prefill-worker", *worker, *draft, "--max-num-batched-tokens", "256"],
             "D": ["decode-worker", *worker, *draft, "--num-speculative-tokens", "3", "--no-spec-adaptive"],
             "D2": ["decode-worker", *worker, "--block-size", "8"]}
    for name, args in specs.items():
        port, metrics_port = free_port(), free_port()
        c.procs[name] = Proc(name, [*args, "--port", str(port), "--metrics-port", str(metrics_port)],
                             logs / f"{name}.log", f"127.0.0.1:{port}", f"127.0.0.1:{metrics_port}")
    http_port = free_port()
    c.http_address = f"127.0.0.1:{http_port}"
    routers = {"R": ["--prefill", c.address("P"), "--decode", c.address("D"), "--queue-timeout", "60",
                     "--http-port", str(http_port)],
               "R2": ["--decode", c.address("D2")],
               "R3": ["--prefill", c.address("P"), "--decode", c.address("D"), "--max-queued-requests", "0"]}
    try:
        for proc in c.procs.values():
            proc.start()
        for name, args in routers.items():
            metrics_port = free_port()
            c.start_router(name, *args, "--max-prompt-chars", str(MAX_PROMPT_CHARS), "--health-interval", "0.5",
                           "--metrics-port", str(metrics_port)).metrics_address = f"127.0.0.1:{metrics_port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        for proc in c.procs.values():
            wait_serving(proc, deadline)
        yield c
    finally:
        for ch in c.channels.values():
            ch.close()
        for proc in reversed(list(c.procs.values())):
            proc.stop()
