"""The open-loop driver: sends each request at its arrival time, whether or not earlier ones
have finished, optionally under a cap on requests in flight.

    arrival times ──sleep until each──► task per request ──(cap: wait for a slot)──► backend.send

One asyncio loop sends and reads everything; the records say how late each request left
(`client_wait_s`: the cap, or a loop too busy to keep up).
"""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

from pdserve.loadgen.records import RequestRecord
from pdserve.loadgen.workload import RequestSpec


class Backend(Protocol):
    name: str

    async def check(self) -> None: ...

    async def send(self, spec: RequestSpec, rec: RequestRecord, t0: float) -> None: ...

    async def close(self) -> None: ...


async def run_requests(backend: Backend, specs: list[RequestSpec], arrival_times: list[float],
                       max_concurrency: int | None = None, progress=None) -> list[RequestRecord]:
    """Send `specs[i]` at `arrival_times[i]` seconds from now; records in the same order.
    `progress`: anything with `update(n)` (a tqdm bar), told of each request that ends."""
    if len(specs) != len(arrival_times):
        raise ValueError(f"{len(specs)} requests but {len(arrival_times)} arrival times")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(i, at, spec.max_tokens, spec.num_prompt_tokens)
               for i, (spec, at) in enumerate(zip(specs, arrival_times))]
    t0 = time.perf_counter()

    async def one(spec: RequestSpec, rec: RequestRecord) -> None:
        if slots is not None:
            await slots.acquire()
        try:
            rec.sent_s = time.perf_counter() - t0
            await backend.send(spec, rec, t0)
        finally:
            if slots is not None:
                slots.release()
            if progress is not None:
                progress.update(1)

    tasks = []
    try:
        for spec, rec in zip(specs, records):
            delay = t0 + rec.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, rec)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return records
