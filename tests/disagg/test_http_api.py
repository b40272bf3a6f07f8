"""The OpenAI-compatible HTTP API on router R: completions (plain and streamed as server-sent
events), bad input as HTTP 400 naming the field, a vanished client freeing its blocks; and, on a
router of its own with short timeouts, clients that stall: every wait on them ends."""
from __future__ import annotations

import http.client
import json
import socket

import pytest
from procs import wait_ready

from pdserve.engine import SamplingParams

PROMPT = "def fibonacci(n):"


def post(cluster, body, raw: bytes | None = None):
    conn = http.client.HTTPConnection(cluster.http_address, timeout=60)
    conn.request("POST", "/v1/completions", body=raw if raw is not None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp, conn


def sse_events(resp) -> list[dict | str]:
    events = []
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture(scope="module")
def offline_text(offline):
    out = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    return out


def test_completion_matches_offline(cluster, offline_text):
    status, resp, conn = post(cluster, {"prompt": PROMPT, "max_tokens": 20, "temperature": 0,  # no model: the served one
                                        "ignore_eos": True})
    body = json.loads(resp.read())
    conn.close()
    assert status == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == offline_text.text and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(offline_text.prompt_token_ids), "completion_tokens": 20,
                             "total_tokens": len(offline_text.prompt_token_ids) + 20}


def test_streamed_completion_concatenates_to_the_full_text(cluster, offline_text):
    status, resp, conn = post(cluster, {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                                        "stream": True})
    assert status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = sse_events(resp)
    conn.close()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2  # the first token alone, the rest in one chunk or more (a stream behind its engine merges)
    assert "".join(c["choices"][0]["text"] for c in chunks) == offline_text.text
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == offline_text.token_ids
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 20
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.parametrize("body, field", [
    (None, "body is not valid JSON"),
    ({"max_tokens": 4}, "prompt must be"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of is not supported"),
    ({"prompt": "hi", "stream": "no"}, "stream must be a boolean"),
    ({"prompt": "hi", "stop": [3]}, "stop must be"),
    ({"prompt": [1, 2, 99999]}, "token_ids contains unknown token ids"),
    ({"prompt": "lazy dog " * 2000}, "prompt has"),
    ([1, 2], "body must be a JSON object"),
])
def test_bad_input_is_400_naming_the_field(cluster, body, field):
    status, resp, conn = post(cluster, body, raw=b"{nope" if body is None else None)
    err = json.loads(resp.read())["error"]
    conn.close()
    assert status == 400 and err["type"] == "invalid_request_error"
    assert field in err["message"], err
    if isinstance(body, dict) and "token ids" in field:
        assert err["param"] == "prompt"  # OpenAI's name for it, not the gRPC API's


def test_models_and_health(cluster):
    conn = http.client.HTTPConnection(cluster.http_address, timeout=10)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    conn.request("GET", "/health")
    health = conn.getresponse()
    assert models["data"][0]["object"] == "model" and health.status == 200
    conn.close()


def test_vanished_streaming_client_frees_blocks(cluster):
    status, resp, conn = post(cluster, {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                                        "stream": True})
    assert status == 200
    assert resp.readline().startswith(b"data: ")  # generation is under way
    conn.sock.close()  # gone without a word
    conn.close()
    cluster.wait_all_free()
    # and the router still serves; ignore_eos: at the default temperature a random model can sample EOS first
    status, resp, conn = post(cluster, {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2
    conn.close()


@pytest.fixture
def impatient_router(cluster):
    """A router over D2 whose HTTP API closes a connection idle for 2 s and waits 1 s for a body."""
    proc = cluster.start_router("R-impatient", "--decode", cluster.address("D2"), "--http-port", "0",
                                "--metrics-port", "0", "--http-idle-timeout", "2", "--http-body-timeout", "1")
    try:
        wait_ready(proc)
        yield proc.addresses["http"]
    finally:
        proc.stop()
        del cluster.procs["R-impatient"]


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)  # no wait below is longer


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it does not)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _read_response(sock: socket.socket) -> tuple[bytes, dict]:
    """One response, read to the end of its body (Content-Length): its head and JSON body. Not
    to the connection's close: after an error the server reads what is left of the body a while."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += sock.recv(65536) or pytest.fail(f"closed before a response's head: {out!r}")
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail(f"closed inside a response's body: {out!r}")
    return head, json.loads(body)


def test_a_stalled_client_is_answered_or_dropped_not_waited_for(impatient_router):
    # a body that stops short of its Content-Length: 408 once the body timeout is up, and closed
    stalled = _connect(impatient_router)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    # a Content-Length over the limit: 413 at once, none of the body read
    huge = _connect(impatient_router)
    huge.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 200000000\r\n\r\n{")
    # no request at all, and a request whose headers never end: closed after the idle timeout
    silent, half = _connect(impatient_router), _connect(impatient_router)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    head, body = _read_response(stalled)
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head, head  # the connection goes too
    error = body["error"]
    assert error["code"] == "request_timeout" and "did not arrive within 1 s" in error["message"], error
    head, body = _read_response(huge)
    assert head.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in head, head
    assert body["error"]["code"] == "request_too_large"
    assert _read_all(silent) == b"" and _read_all(half) == b""
    for sock in (stalled, huge, silent, half):
        sock.close()
    # a client that takes its time between requests, not within one, is served as before
    conn = http.client.HTTPConnection(impatient_router, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}))
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2
    conn.close()
