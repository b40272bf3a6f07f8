"""Log-probabilities and penalties through the disaggregated path (router, prefill worker, KV
transfer, decode worker in one process): the first token's log-probs travel from the prefill
worker in the KV trailer, the rest on the decode stream, and both equal the offline engine's;
a failed-over continuation keeps counting the tokens already sent for the penalties."""
from __future__ import annotations

import asyncio
import math

from inprocess import InProcessSystem
from pdserve.engine import LLM, SamplingParams
from pdserve.router.request import RouterRequest
from pdserve.router.server import Router
from pdserve.router.stream import ClientStream

PROMPT = "def fibonacci(n):"


def test_logprobs_and_penalties_equal_the_offline_engine(text_checkpoint):
    params = dict(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, presence_penalty=0.8,
                  frequency_penalty=0.4)
    want = LLM(text_checkpoint).generate(PROMPT, SamplingParams(**params))[0]

    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            return await system.generate(PROMPT, 10, logprobs=3, presence_penalty=0.8, frequency_penalty=0.4)

    msgs = asyncio.run(asyncio.wait_for(scenario(), 120))
    tokens = [t for m in msgs for t in m.token_ids]
    rows = [lp for m in msgs for lp in m.logprobs]
    assert tokens == want.token_ids and len(rows) == len(tokens)
    for row, tok, expected in zip(rows, tokens, want.logprobs):
        assert expected[0][0] == tok and not math.isnan(row.logprob)
        assert math.isclose(row.logprob, expected[0][1], abs_tol=1e-4)
        assert list(row.top_token_ids) == [t for t, _ in expected[1:]]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, (_, b) in zip(row.top_logprobs, expected[1:]))


def test_a_continuation_counts_the_sent_tokens_for_the_penalties(text_checkpoint):
    """What failover sends the new workers (prompt + sent tokens, `num_output_tokens_in_prompt`)
    continues exactly as the uninterrupted request would have."""
    llm = LLM(text_checkpoint)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0, presence_penalty=1.0)
    whole = llm.generate(PROMPT, params)[0]
    prompt_ids, sent = whole.prompt_token_ids, whole.token_ids[:5]
    req = RouterRequest("r", "client", prompt_ids, params)
    stream = ClientStream(req, None)
    stream.sent_ids = list(sent)
    work = Router._work(req, stream, attempt=1)
    assert work.num_output_tokens_in_prompt == 5 and list(work.prompt_token_ids) == prompt_ids + sent
    from pdserve.serving.convert import parse_work_request

    _, ids, cont_params = parse_work_request(work)
    rest = llm.generate(ids, cont_params)[0].token_ids
    assert sent + rest == whole.token_ids
    forgetful = llm.generate(ids, SamplingParams(**{**_fields(cont_params), "num_output_tokens_in_prompt": 0}))[0]
    assert sent + forgetful.token_ids != whole.token_ids  # the test can tell the difference


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__slots__}
