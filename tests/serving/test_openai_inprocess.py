"""The OpenAI app over an in-process system, where a test chooses what the router serves: a
model without a chat template (chat is a clear 400, completions still work) under a served
model name (what /v1/models lists and what requests must name)."""
from __future__ import annotations

# `openai` is imported inside the tests, not at collection: it is a heavy import, and this test
# process also runs the client side of tests that compare latencies

import asyncio

import pytest
from aiohttp.test_utils import TestServer

from inprocess import InProcessSystem
from pdserve.router.http import OpenAIApp


def test_served_name_and_no_chat_template(text_checkpoint):
    import openai

    async def scenario():
        async with InProcessSystem(text_checkpoint) as system:
            server = TestServer(OpenAIApp(system.router, "my-model", chat_template=None).app(), host="127.0.0.1")
            await server.start_server()
            try:
                async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as c:
                    models = [m.id async for m in c.models.list()]
                    # a random checkpoint may sample EOS at any step: three tokens are asked for outright
                    out = await c.completions.create(model="my-model", prompt="import os", max_tokens=3,
                                                     extra_body={"ignore_eos": True})
                    with pytest.raises(openai.NotFoundError):
                        await c.completions.create(model=text_checkpoint.name, prompt="import os", max_tokens=3)
                    with pytest.raises(openai.BadRequestError) as e:
                        await c.chat.completions.create(model="my-model", max_tokens=3,
                                                        messages=[{"role": "user", "content": "hi"}])
                    return models, out, e.value
            finally:
                await server.close()

    models, out, err = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert models == ["my-model"] and out.model == "my-model" and out.usage.completion_tokens == 3
    assert err.body["code"] == "no_chat_template" and "chat template" in err.message
