"""The OpenAI API on router R (prefill P ──► decode D, speculating) as clients use it: the
official `openai` client for completions and chat, streaming and not, log-probabilities, n,
echo, penalties and its typed errors; raw HTTP for what the client cannot send (wrong JSON
types, deep nesting). Every generated text is checked against the offline engine."""
from __future__ import annotations

# `openai` is imported inside the tests, not at collection: it is a heavy import, and this test
# process also runs the client side of tests that compare latencies

import http.client
import json
import math

import pytest

from pdserve.engine import SamplingParams
from pdserve.router.chat_template import ChatMessage, ChatTemplate

PROMPT = "def fibonacci(n):"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fibonacci, please"}]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(cluster):
    import openai
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def chat_prompt(serving_model) -> str:
    return ChatTemplate.from_dir(serving_model).render([ChatMessage(**m) for m in CHAT])


def offline_out(offline, prompt, **params):
    return offline.generate(prompt, SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True,
                                                      **params}))[0]


def test_models_lists_the_served_name(client, model, serving_model):
    assert [m.id for m in client.models.list().data] == [model] == [serving_model.name]


def test_completion_and_its_stream_equal_the_offline_engine(client, model, offline):
    want = offline_out(offline, PROMPT)
    out = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == want.text


def test_chat_and_its_stream_use_the_models_template(client, model, offline, chat_prompt):
    want = offline_out(offline, chat_prompt)
    out = client.chat.completions.create(model=model, messages=CHAT, **GREEDY)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want.text
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_logprobs_are_the_engines(client, model, offline):
    want = offline_out(offline, PROMPT, logprobs=2)
    lp = client.completions.create(model=model, prompt=PROMPT, logprobs=2, **GREEDY).choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.text_offset) == 12
    for got, top, row in zip(lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert math.isclose(got, row[0][1], abs_tol=1e-4)
        assert len(top) <= 2 and math.isclose(max(top.values()), row[1][1], abs_tol=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streamed_and_not(client, model, offline, chat_prompt):
    want = offline_out(offline, chat_prompt, logprobs=3)
    out = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 12
    for entry, row in zip(content, want.logprobs):
        assert math.isclose(entry.logprob, row[0][1], abs_tol=1e-4) and len(entry.top_logprobs) == 3
        assert [math.isclose(t.logprob, lp, abs_tol=1e-4) for t, (_, lp) in zip(entry.top_logprobs, row[1:])] == [True] * 3
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    chunks = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, stream=True, **GREEDY)
    streamed = [e.logprob for c in chunks for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [round(x, 4) for x in streamed] == [round(e.logprob, 4) for e in content]


def test_n_choices_are_indexed_and_seeded(client, model):
    params = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    three = client.completions.create(n=3, **params)
    one = client.completions.create(**params)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text  # choice 0 keeps the request's seed
    assert len({c.text for c in three.choices}) > 1
    assert three.usage.completion_tokens == 36
    again = client.completions.create(n=3, **params)
    assert [c.text for c in again.choices] == [c.text for c in three.choices]
    streamed = list(client.chat.completions.create(model=model, messages=CHAT, n=2, stream=True, seed=5,
                                                   max_tokens=6, extra_body={"ignore_eos": True}))
    assert {c.choices[0].index for c in streamed} == {0, 1}


def test_echo_and_penalties(client, model, offline):
    want = offline_out(offline, PROMPT, frequency_penalty=1.5, presence_penalty=0.5)
    plain = offline_out(offline, PROMPT)
    out = client.completions.create(model=model, prompt=PROMPT, echo=True, frequency_penalty=1.5,
                                    presence_penalty=0.5, **GREEDY)
    assert out.choices[0].text == PROMPT + want.text and want.token_ids != plain.token_ids


@pytest.mark.parametrize("kwargs, param", [
    (dict(logit_bias={"5": 10}), "logit_bias"),
    (dict(max_tokens=100_000), "max_tokens"),
    (dict(top_p=3.0), "top_p"),
    (dict(logprobs=21), "logprobs"),
    (dict(n=99), "n"),
    (dict(best_of=3), "best_of"),
    (dict(suffix="x"), "suffix"),
    (dict(echo=True, logprobs=1), "echo"),
    (dict(extra_body={"foo": 1}), "foo"),
])
def test_bad_completion_parameters_are_400_naming_them(client, model, kwargs, param):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param and param in e.value.message


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
    (dict(response_format={"type": "json_object"}), "response_format"),
])
def test_bad_chat_parameters_are_400_naming_them(client, model, kwargs, param):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": model, "messages": CHAT, **kwargs})
    assert e.value.body["param"] == param


def test_an_unknown_model_is_404_not_another_model(client):
    import openai
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)


def post(cluster, path: str, raw: bytes):
    conn = http.client.HTTPConnection(cluster.http_address, timeout=30)
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, body = resp.status, json.loads(resp.read())
    conn.close()
    return status, body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value", [("stream", "no"), ("ignore_eos", "false"), ("max_tokens", 1.5),
                                          ("n", True), ("temperature", "1"), ("seed", -1), ("echo", 1),
                                          ("logprobs", "yes")])
def test_json_types_are_strict(cluster, path, field, value):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    if field == "echo" and path != "/v1/completions":
        field = "stream"
    status, err = post(cluster, path, json.dumps({**body, field: value}).encode())
    assert status == 400 and err["error"]["param"] == field, err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deep_nesting_is_400_not_500(cluster, path):
    for depth in (50, 100_000):
        status, err = post(cluster, path, b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
        assert status == 400 and "nests deeper" in err["error"]["message"]
