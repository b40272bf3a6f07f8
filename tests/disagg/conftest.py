"""One shared set of real processes on loopback for every serving test.

    prefill P ──► decode D   ◄── router R  (disaggregated; R3: same pair, no admission queue;
                                           D never prefills a request itself, however much of
                                           its prompt it holds: every request is pushed)
                  decode D2  ◄── router R2 (colocated; block size 8, so D2 never pairs with P)

Started once per session (workers in parallel, then routers), each binding port 0 and waited
for until it prints its ready line; torn down with SIGTERM (then SIGKILL). A process's log is
shown when it fails to start. Each serves Prometheus /metrics (`Cluster.metrics`).
"""
from __future__ import annotations

import pytest

from procs import MAX_NUM_SEQS, MAX_PROMPT_CHARS, NUM_KV_BLOCKS, Cluster, wait_ready


@pytest.fixture(scope="session")
def cluster(serving_model, tmp_path_factory) -> Cluster:
    c = Cluster(serving_model, tmp_path_factory.mktemp("logs"))
    worker = ["--num-threads", "1", "--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", str(NUM_KV_BLOCKS),
              "--kv-transfer-timeout", "20", "--metrics-port", "0"]
    # P and D speculate (the model drafting for itself, fixed depth: every draft accepted, so
    # steps emit several tokens); the colocated D2 does not
    draft = ["--draft-model", str(serving_model)]
    try:
        wait_ready(c.start("P", "prefill-worker", *worker, *draft, "--max-num-batched-tokens", "256"),
                   c.start("D", "decode-worker", *worker, *draft, "--num-speculative-tokens", "3", "--no-spec-adaptive",
                           "--local-prefill-tokens", "0"),
                   c.start("D2", "decode-worker", *worker, "--block-size", "8"))
        common = ["--max-prompt-chars", str(MAX_PROMPT_CHARS), "--health-interval", "0.5", "--metrics-port", "0"]
        wait_ready(c.start_router("R", "--prefill", c.address("P"), "--decode", c.address("D"), "--queue-timeout", "60",
                                  "--http-port", "0", *common),
                   c.start_router("R2", "--decode", c.address("D2"), *common),
                   c.start_router("R3", "--prefill", c.address("P"), "--decode", c.address("D"),
                                  "--max-queued-requests", "0", *common))
        yield c
    finally:
        c.stop()
