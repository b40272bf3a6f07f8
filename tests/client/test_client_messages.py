"""The client's records and their wire form: validation that names the field, unset optional
fields left unset, prompts as text or token ids, deltas from responses."""
from __future__ import annotations

import pytest

from pdserve.client import Completion, FinishReason, SamplingParams, Usage
from pdserve.client.messages import delta_from, make_request
from pdserve.v1 import generation_pb2 as gen


def test_unset_fields_stay_unset_on_the_wire():
    msg = SamplingParams(max_tokens=8).to_proto()
    assert msg.HasField("max_tokens") and msg.max_tokens == 8
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        assert not msg.HasField(name), name
    assert list(msg.stop) == [] and not msg.ignore_eos


def test_every_field_reaches_the_wire():
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, max_tokens=7, stop="\n\n",
                            stop_token_ids=[2, 3], seed=2**63, ignore_eos=True)
    msg = params.to_proto()
    assert msg.temperature == pytest.approx(0.5) and msg.top_p == pytest.approx(0.9) and msg.top_k == 40
    assert msg.min_p == pytest.approx(0.05) and msg.max_tokens == 7 and msg.seed == 2**63 and msg.ignore_eos
    assert list(msg.stop) == ["\n\n"] and list(msg.stop_token_ids) == [2, 3]
    assert params.stop == ("\n\n",)  # a single string is one stop string, not its characters


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2**32), "max_tokens"), (dict(max_tokens=1.5), "max_tokens"),
    (dict(seed=-1), "seed"), (dict(top_k=2**31), "top_k"), (dict(temperature="hot"), "temperature"),
    (dict(stop=[1]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(ignore_eos=1), "ignore_eos"),
    (dict(max_tokens=True), "max_tokens"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_sampling_option_is_a_type_error():
    with pytest.raises(TypeError):
        SamplingParams(temprature=0)


def test_prompts_as_text_or_token_ids():
    params = SamplingParams()
    assert make_request("hi", params, "r1").prompt == "hi"
    req = make_request([5, 6, 7], params)
    assert req.WhichOneof("input") == "token_ids" and list(req.token_ids.ids) == [5, 6, 7]
    assert len(req.request_id) == 32  # a fresh id when none is given
    for bad in (None, [1, -2], [1.0], 3, [2**32]):
        with pytest.raises(ValueError, match="prompt"):
            make_request(bad, params)


def test_deltas_and_completion():
    mid = delta_from(gen.GenerateResponse(request_id="r", token_ids=[1, 2], text="ab"))
    assert (mid.text, mid.token_ids, mid.finish_reason, mid.usage, mid.is_last) == ("ab", (1, 2), None, None, False)
    last = delta_from(gen.GenerateResponse(request_id="r", token_ids=[3], text="c", finish_reason=gen.LENGTH,
                                           usage=gen.Usage(prompt_tokens=4, completion_tokens=3)))
    assert last.finish_reason is FinishReason.LENGTH and last.usage == Usage(4, 3) and last.is_last
    out = Completion()
    out.add(mid)
    out.add(last)
    assert (out.text, out.token_ids, out.finish_reason, out.usage, out.request_id) == \
        ("abc", [1, 2, 3], FinishReason.LENGTH, Usage(4, 3), "r")
