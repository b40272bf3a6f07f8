"""`AdmissionQueue`: requests that no decode worker could take wait here, first come first
served, bounded in length and in time.

A waiter is woken when capacity may have freed (a request finished) or when the one ahead of it
was admitted (so admissions chain while there is room); it also retries on its own every
`poll_s`, in case capacity freed somewhere the router did not see.
"""
from __future__ import annotations

import asyncio
from collections import deque


class QueueFull(Exception):
    pass


class AdmissionQueue:
    def __init__(self, max_waiting: int, poll_s: float = 1.0):
        self.max_waiting = max_waiting
        self.poll_s = poll_s
        self._waiters: deque[asyncio.Future] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, timeout_s: float) -> None:
        """Wait for a wake-up (or the poll interval, or `timeout_s`); QueueFull if too many wait."""
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull(f"{len(self._waiters)} requests are already waiting for a decode worker")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), min(timeout_s, self.poll_s))
        except asyncio.TimeoutError:
            pass
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
