"""router/http.py's `writer`: a streamed response whose client reads nothing gives up within its
timeout instead of waiting on the connection for good. A real aiohttp server on loopback and a
client socket that never reads; the response is far larger than any socket buffer can hold."""
from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from pdserve.router.http import writer
from pdserve.serving.metrics import start_http_app

CHUNK = b"x" * (64 << 10)
TOTAL = 256 << 20  # far beyond a loopback connection's buffers (a few MiB on these hosts)


def test_a_stream_to_a_client_that_reads_nothing_times_out():
    async def scenario():
        ended: asyncio.Future = asyncio.get_running_loop().create_future()

        async def handler(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            write, sent = writer(resp, 1.0), 0
            try:
                while sent < TOTAL:
                    await write(CHUNK)
                    sent += len(CHUNK)
                ended.set_result(("finished", sent))
            except TimeoutError:
                ended.set_result(("timed out", sent))
                request.transport.close()
            return resp

        app = web.Application()
        app.router.add_get("/stream", handler)
        runner, port = await start_http_app(app, "127.0.0.1", 0)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            await asyncio.get_running_loop().sock_sendall(sock, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            return await asyncio.wait_for(ended, 60)  # reading nothing meanwhile
        finally:
            sock.close()
            await runner.cleanup()

    outcome, sent = asyncio.run(scenario())
    assert outcome == "timed out" and 0 < sent < TOTAL, (outcome, sent)
