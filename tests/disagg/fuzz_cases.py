"""Hypothesis strategies for what a hostile or careless client sends, and the one check every
answer must pass: a clear 4xx-class answer or a normal stream, never a server error. Shared by
the fuzz tests (a thousand cases in `make test`) and `benchmarks/fuzz.py` (tens of thousands)."""
from __future__ import annotations

import json
import http.client

import grpc
from hypothesis import strategies as st

from pdserve.v1 import generation_pb2 as gen
from pdserve.v1 import generation_pb2_grpc

# answers that say the request was handled: accepted, or refused with a reason
GOOD_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.NOT_FOUND}
GOOD_HTTP = {200, 400, 401, 404, 413, 422, 429}

FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.5, 1.0, 2.0]))
UINT32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 4, 16, 2**31, 2**32 - 1]))
TEXT = st.one_of(st.text(max_size=40), st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=400),
                 st.sampled_from(["", " ", "\x00", "def f():", "é" * 300]))


@st.composite
def sampling_params(draw) -> gen.SamplingParams:
    sp = gen.SamplingParams()
    for name in ("temperature", "top_p", "min_p"):
        if draw(st.booleans()):
            setattr(sp, name, draw(FLOATS))
    if draw(st.booleans()):
        sp.top_k = draw(st.integers(-2**31, 2**31 - 1))
    if draw(st.booleans()):
        sp.max_tokens = draw(UINT32)
    if draw(st.booleans()):
        sp.seed = draw(st.integers(0, 2**64 - 1))
    sp.stop.extend(draw(st.lists(TEXT, max_size=20)))
    sp.stop_token_ids.extend(draw(st.lists(UINT32, max_size=300)))
    sp.ignore_eos = draw(st.booleans())
    return sp


@st.composite
def generate_requests(draw) -> gen.GenerateRequest:
    req = gen.GenerateRequest(request_id=draw(st.one_of(st.text(max_size=20), st.text(min_size=250, max_size=300))))
    which = draw(st.sampled_from(["prompt", "token_ids", "none"]))
    if which == "prompt":
        req.prompt = draw(TEXT)
    elif which == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(UINT32, max_size=600)))
    if draw(st.booleans()):
        req.sampling_params.CopyFrom(draw(sampling_params()))
    return req


@st.composite
def raw_requests(draw) -> bytes:
    """Random bytes, or a valid request with some bytes flipped, cut or repeated."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    data = bytearray(draw(generate_requests()).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "cut", "dup", "utf8"]))
        if op == "flip":
            data[i] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[i:]
        elif op == "dup":
            data[i:i] = data[i:i + draw(st.integers(1, 8))]
        else:
            data[i:i + 1] = b"\xff"
    return bytes(data)


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), TEXT)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)
OPENAI_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                 "seed", "stream", "ignore_eos", "n", "logprobs", "top_logprobs", "echo", "presence_penalty",
                 "frequency_penalty", "user", "best_of", "logit_bias", "suffix"]


@st.composite
def http_bodies(draw) -> bytes:
    """JSON objects with OpenAI's field names and any values, deep nesting, and non-JSON."""
    kind = draw(st.sampled_from(["object", "object", "object", "deep", "garbage"]))
    if kind == "garbage":
        return draw(st.binary(max_size=100))
    if kind == "deep":
        depth = draw(st.integers(100, 5000))
        return ('{"prompt": ' + "[" * depth + "]" * depth + "}").encode()
    body = draw(st.dictionaries(st.sampled_from(OPENAI_FIELDS), JSON_VALUES, max_size=8))
    if draw(st.booleans()):  # often enough a plausible request, so the paths past validation run too
        body.setdefault("prompt", draw(TEXT))
        body.setdefault("messages", [{"role": "user", "content": draw(TEXT)}])
        body.setdefault("max_tokens", draw(st.integers(1, 4)))
    return json.dumps(body).encode(errors="surrogatepass")


# ---- sending, and the verdict ----------------------------------------------------------------
def send_grpc(channel: grpc.Channel, request) -> grpc.StatusCode:
    """The call's status after at most its first message (a good stream is then cancelled)."""
    if isinstance(request, bytes):
        call = channel.unary_stream("/pdserve.v1.Generation/Generate")(request, timeout=30)
    else:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)
    try:
        next(call)
        call.cancel()
        return grpc.StatusCode.OK
    except StopIteration:
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def send_http(address: str, path: str, body: bytes) -> int:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read(64)  # the status and the start are enough; closing cancels a long stream
        return resp.status
    finally:
        conn.close()
