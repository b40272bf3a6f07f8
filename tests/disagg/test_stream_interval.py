"""A decode worker with `--stream-interval 6` sends a request's tokens six or more at a time, its first
and last at once, through a router disaggregated (the prefill worker's first token ahead) and
colocated: the client gets the offline engine's tokens, with their logprobs, in those groups.
Real processes: the shared prefill worker P, a decode worker of its own (with P's draft, which
pairing asks for, at a fixed depth: a step emits 1 to DEPTH + 1 tokens), and two routers over it.
The decode worker runs with --no-merge-backlog: a stream that fell behind its engine would merge
groups (tests/serving/test_merge_backlog.py), and the groups' exact sizes are what is checked here."""
from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.v1 import generation_pb2 as gen
from procs import MAX_NUM_SEQS, MAX_PROMPT_CHARS, NUM_KV_BLOCKS, wait_ready

INTERVAL = 6  # not a multiple of a whole step's DEPTH + 1 tokens (the draft is the target: all accepted)
DEPTH = 3
NUM_TOKENS = 18


@pytest.fixture(scope="module")
def grouped(cluster, serving_model):
    worker = ["--num-threads", "1", "--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", str(NUM_KV_BLOCKS),
              "--metrics-port", "0"]
    wait_ready(cluster.start("D-grouped", "decode-worker", *worker, "--stream-interval", str(INTERVAL),
                             "--no-merge-backlog",
                             "--draft-model", str(serving_model), "--num-speculative-tokens", str(DEPTH),
                             "--no-spec-adaptive"))
    common = ["--max-prompt-chars", str(MAX_PROMPT_CHARS), "--health-interval", "0.5", "--metrics-port", "0"]
    wait_ready(cluster.start_router("R-grouped", "--prefill", cluster.address("P"), "--decode",
                                    cluster.address("D-grouped"), *common),
               cluster.start_router("R-grouped-colocated", "--decode", cluster.address("D-grouped"), *common))
    yield cluster
    for name in ("R-grouped", "R-grouped-colocated", "D-grouped"):
        cluster.procs.pop(name).stop()


@pytest.mark.parametrize("router", ["R-grouped", "R-grouped-colocated"])
def test_tokens_come_in_groups_of_the_interval_first_and_last_at_once(grouped, offline, router):
    prompt = [7 + (i * 13) % 200 for i in range(30)]
    msgs = list(grouped.generation(router).Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=prompt), sampling_params=gen.SamplingParams(
            temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)), timeout=60))
    sizes = [len(m.token_ids) for m in msgs if m.token_ids]
    # the first at once; then each group once INTERVAL are new (a step adds up to DEPTH + 1 to the
    # INTERVAL - 1 held); the rest with the finish
    assert sizes[0] == 1 and sum(sizes) == NUM_TOKENS, sizes
    assert all(INTERVAL <= n <= INTERVAL + DEPTH for n in sizes[1:-1]) and 1 <= sizes[-1] <= INTERVAL + DEPTH, sizes
    assert len(sizes) <= 2 + (NUM_TOKENS - 1) // INTERVAL, sizes
    assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))[0]
    assert [t for m in msgs for t in m.token_ids] == want.token_ids
    assert msgs[-1].finish_reason == gen.LENGTH
    grouped.wait_all_free(("P", "D-grouped"))


def test_a_stream_interval_below_one_is_refused_by_name():
    from pdserve.decode_worker.server import DecodeServerConfig

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
            DecodeServerConfig(stream_interval=bad)
