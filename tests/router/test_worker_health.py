"""The router's health checks against a real gRPC server on loopback whose health answers can be
made slow: a worker too busy to answer in time stays in selection until `MAX_SLOW_CHECKS`
checks in a row time out; a refused connection takes it out at once."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.router.workers import MAX_SLOW_CHECKS, WorkerPool


class NotServingUntilAsked(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 that answers NOT_SERVING (the pool then asks nothing else), slowly when told."""

    def __init__(self):
        self.delay_s = 0.0

    async def Check(self, request, context):
        await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)


async def _scenario() -> list[bool]:
    server = grpc.aio.server()
    health = NotServingUntilAsked()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = WorkerPool(is_disaggregated=False, check_timeout_s=0.2)
    w = pool.add("d", "decode", f"127.0.0.1:{port}")
    seen = []
    try:
        w.healthy = True  # as if it had passed its checks
        health.delay_s = 1.0  # every check times out now
        for _ in range(MAX_SLOW_CHECKS):
            await pool.check(w)
            seen.append(w.healthy)
        w.healthy = True
        w.num_slow_checks = 0
        health.delay_s = 0.0
        await pool.check(w)  # a prompt NOT_SERVING: out at once
        seen.append(w.healthy)
        w.healthy = True
        await server.stop(0)
        await pool.check(w)  # nobody listens: out at once
        seen.append(w.healthy)
    finally:
        await server.stop(0)
        await w.channel.close()
    return seen


def test_slow_checks_take_a_worker_out_only_in_a_row_and_a_refusal_at_once():
    seen = asyncio.run(_scenario())
    assert seen == [True] * (MAX_SLOW_CHECKS - 1) + [False, False, False], seen
