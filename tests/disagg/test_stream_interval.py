"""A decode worker with `--stream-interval 6` sends a request's tokens six or more at a time, its first
and last at once, through a router disaggregated (the prefill worker's first token ahead) and
colocated: the client gets the offline engine's tokens, with their logprobs, in those groups.
Real processes: the shared prefill worker P, a decode worker of its own (with P's draft, which
pairing asks for, at a fixed depth: a step emits 1 to DEPTH + 1 tokens), and three routers over it.
The decode worker runs with --no-merge-backlog: a stream that fell behind its engine would merge
groups (tests/serving/test_merge_backlog.py), and the groups' exact sizes are what is checked here,
on a router with --no-token-streams (each request's groups on its own call). A router reading a
token stream (the default) merges the whole groups that wait for a slow client into one message
(router/token_streams.py), so there a message holds one group or more, never part of one."""
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
    disagg = ["--prefill", cluster.address("P"), "--decode", cluster.address("D-grouped")]
    wait_ready(cluster.start_router("R-grouped", *disagg, *common),
               cluster.start_router("R-grouped-own-calls", *disagg, "--no-token-streams", *common),
               cluster.start_router("R-grouped-colocated", "--decode", cluster.address("D-grouped"), *common))
    yield cluster
    for name in ("R-grouped", "R-grouped-own-calls", "R-grouped-colocated", "D-grouped"):
        cluster.procs.pop(name).stop()


@pytest.mark.parametrize("router", ["R-grouped", "R-grouped-own-calls", "R-grouped-colocated"])
def test_tokens_come_in_groups_of_the_interval_first_and_last_at_once(grouped, offline, router):
    prompt = [7 + (i * 13) % 200 for i in range(30)]
    msgs = list(grouped.generation(router).Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=prompt), sampling_params=gen.SamplingParams(
            temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)), timeout=60))
    sizes = [len(m.token_ids) for m in msgs if m.token_ids]
    # the first at once; then each group once INTERVAL are new (a step adds up to DEPTH + 1 to the
    # INTERVAL - 1 held); the rest with the finish
    # (colocated, the first token is the decode worker's first delta, which a token stream's
    # router merges with the groups that wait behind it; disaggregated, the prefill worker's goes first)
    assert (sizes[0] == 1 or router == "R-grouped-colocated" and sizes[0] >= 1 + INTERVAL) and sum(sizes) == NUM_TOKENS, sizes
    assert all(INTERVAL <= n for n in sizes[1:-1]) and sizes[-1] >= 1, sizes  # never part of a group
    assert len(sizes) <= 2 + (NUM_TOKENS - 1) // INTERVAL, sizes
    if router == "R-grouped-own-calls":  # nothing merges groups: each message is one
        assert all(n <= INTERVAL + DEPTH for n in sizes[1:]), sizes
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
