"""The open-loop driver, with a stand-in server (an in-test backend that answers after a short
sleep and counts what is in flight): every request is sent once, in arrival order, never more
than the cap at once, and the records keep the workload's order."""
from __future__ import annotations

import asyncio

from pdserve.loadgen.runner import run_requests
from pdserve.loadgen.workload import RequestSpec


class CountingBackend:
    name = "counting"

    def __init__(self):
        self.in_flight = self.max_in_flight = 0
        self.sent: list[int] = []

    async def check(self) -> None:
        pass

    async def send(self, spec, rec, t0) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.sent.append(spec.max_tokens)
        try:
            await asyncio.sleep(0.01)
            rec.add_delta(rec.sent_s + 0.005, 1)
            rec.add_delta(rec.sent_s + 0.01, spec.max_tokens - 1)
        finally:
            self.in_flight -= 1
            rec.end_s = rec.sent_s + 0.01

    async def close(self) -> None:
        pass


def test_every_request_is_sent_once_under_the_cap():
    backend = CountingBackend()
    specs = [RequestSpec((1, 2), max_tokens=i + 2) for i in range(12)]
    times = [0.0] * 6 + [0.001 * i for i in range(6)]
    records = asyncio.run(run_requests(backend, specs, times, max_concurrency=3))
    assert backend.max_in_flight <= 3 and sorted(backend.sent) == [s.max_tokens for s in specs]
    assert [r.index for r in records] == list(range(12))
    assert all(r.is_ok and r.num_output_tokens == s.max_tokens for r, s in zip(records, specs))
    assert all(r.sent_s >= r.scheduled_s for r in records)


def test_without_a_cap_arrivals_do_not_wait_for_each_other():
    backend = CountingBackend()
    specs = [RequestSpec((1,), max_tokens=2) for _ in range(8)]
    asyncio.run(run_requests(backend, specs, [0.0] * 8))
    assert backend.max_in_flight == 8
