"""The public gRPC API's optional additions, through `pdserve.client` against router R
(disaggregated, speculating): log-probabilities per token and presence/frequency penalties equal
the offline engine's; a client's `traceparent` in gRPC metadata is accepted."""
from __future__ import annotations

import math
import secrets

from pdserve.client import Client
from pdserve.engine import SamplingParams

PROMPT = "def fibonacci(n):"


def test_logprobs_and_penalties_over_grpc(cluster, offline):
    params = dict(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, presence_penalty=1.0,
                  frequency_penalty=0.5)
    want = offline.generate(PROMPT, SamplingParams(**params))[0]
    traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    with Client(cluster.address("R"), timeout=60, metadata={"traceparent": traceparent}) as client:
        out = client.complete(PROMPT, **params)
    assert out.token_ids == want.token_ids and len(out.logprobs) == 10
    for got, row in zip(out.logprobs, want.logprobs):
        assert math.isclose(got.logprob, row[0][1], abs_tol=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in row[1:]]
