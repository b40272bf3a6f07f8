"""The whole serving path in this process: a prefill worker and a decode worker (real servicers
and engines on real grpc.aio servers on loopback, port 0) behind a real `Router`, with the K/V
carried by `InProcessTransport` (or a test's wrapper of it: `InterceptingTransport`,
`FaultyTransport`). Fast enough to start per test. With the helpers the tests that use it share."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.decode_worker.server import DecodeServerConfig, DecodeWorkerServicer
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tokenizer import Tokenizer
from pdserve.decode_worker import LOCAL_PREFILL_TOKENS
from pdserve.prefill_worker.server import PrefillServerConfig, PrefillWorkerServicer
from pdserve.router.admission import AdmissionQueue
from pdserve.router.server import Router, RouterPolicy
from pdserve.router.validate import Validator
from pdserve.router.workers import WorkerPool
from pdserve.serving.engine_thread import EngineLoop
from pdserve.serving.grpc_server import AioServer
from pdserve.serving.kv_transfer import InProcessTransport, KVTransport
from pdserve.v1 import generation_pb2 as gen


@dataclass
class InProcessSystem:
    model: Path
    num_prefill: int = 1
    num_decode: int = 1
    num_kv_blocks: int = 64
    max_queued_requests: int = 16
    queue_timeout_s: float = 10.0
    kv_transfer_timeout_s: float = 10.0
    max_failovers: int = 0
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS  # the decode workers' (0: every request to a prefill worker)
    merge_backlog: bool = True  # the decode workers'
    token_streams: bool = True  # the router's (RouterPolicy.token_streams)
    engine_options: dict = field(default_factory=dict)  # more EngineConfig fields, for every worker
    transport: KVTransport | None = None  # default: a plain InProcessTransport
    inproc: InProcessTransport = field(default_factory=InProcessTransport)
    servers: list[AioServer] = field(default_factory=list)

    async def __aenter__(self) -> InProcessSystem:
        engine_config = EngineConfig(model=str(self.model), num_kv_blocks=self.num_kv_blocks, max_num_seqs=8,
                                     **self.engine_options)
        self.prefills = [PrefillWorkerServicer(PrefillServerConfig(self.kv_transfer_timeout_s),
                                               self.transport or self.inproc) for _ in range(self.num_prefill)]
        self.decodes = [DecodeWorkerServicer(DecodeServerConfig(self.kv_transfer_timeout_s, stream_timeout_s=30,
                                                                    local_prefill_tokens=self.local_prefill_tokens,
                                                                    merge_backlog=self.merge_backlog))
                        for _ in range(self.num_decode)]
        prefill_addresses = [await self._start(s, engine_config) for s in self.prefills]
        decode_addresses = [await self._start(s, engine_config) for s in self.decodes]
        for address, service in zip(decode_addresses, self.decodes):
            self.inproc.register(address, service)
        self.prefill, self.decode = self.prefills[0], self.decodes[0]
        pool = WorkerPool.static(prefill_addresses, decode_addresses)
        await pool.connect(30)
        tokenizer = Tokenizer.from_dir(str(self.model))
        self.router = Router(pool, Validator(tokenizer, 10000, pool.limits), tokenizer,
                             AdmissionQueue(self.max_queued_requests, poll_s=0.2),
                             RouterPolicy(rpc_timeout_s=60, queue_timeout_s=self.queue_timeout_s,
                                          max_failovers=self.max_failovers, token_streams=self.token_streams))
        return self

    async def _start(self, service, engine_config: EngineConfig) -> str:
        server = AioServer("127.0.0.1", 0, extra_options=service.server_options())
        service.add_to(server)
        await server.start()
        service.advertised_address = server.address
        engine = await asyncio.to_thread(LLMEngine, engine_config)
        loop = EngineLoop(engine, asyncio.get_running_loop(), f"{service.role}-engine")
        service.attach(loop, "test")
        loop.start()
        await server.set_serving(True)
        self.servers.append(server)
        return server.address

    async def __aexit__(self, *exc) -> None:
        self.router.calls.close()
        for server in self.servers:
            await server.stop(grace=0.5)
        for service in (*self.prefills, *self.decodes):
            service.loop.stop()
            service.close()
        await self.prefill.transport.close()

    async def generate(self, prompt: str | list[int], max_tokens: int = 8, **params) -> list[gen.GenerateResponse]:
        sampling = gen.SamplingParams(**{"temperature": 0, "ignore_eos": True, **params, "max_tokens": max_tokens})
        msg = (gen.GenerateRequest(prompt=prompt, sampling_params=sampling) if isinstance(prompt, str) else
               gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), sampling_params=sampling))
        req = self.router.validator.parse(msg)
        return [resp async for resp in self.router.generate(req)]

    async def held_blocks(self) -> dict[str, int]:
        """Blocks and sequences each worker still holds (engine thread's view)."""
        def count(e: LLMEngine) -> int:
            s = e.scheduler
            return e.block_manager.num_blocks - e.block_manager.num_free_blocks + len(s.running) + len(s.waiting) + len(s.held)

        pools = {"prefill": self.prefills, "decode": self.decodes}
        return {f"{role}-{i}": await s.loop.call(count) for role, ss in pools.items() for i, s in enumerate(ss)}

    async def wait_all_free(self, timeout_s: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any((held := await self.held_blocks()).values()):
            assert asyncio.get_running_loop().time() < deadline, f"still held: {held}"
            await asyncio.sleep(0.05)


PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "héllo wörld", "class Foo:\n    pass"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def joined(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


class InterceptingTransport:
    """The in-process transport, with `intercept(header, messages)` deciding what follows the
    header of each stream (a fault, a wait)."""

    def __init__(self, inner):
        self.inner = inner

    async def intercept(self, header, messages):
        return messages

    async def push(self, address, messages, timeout_s):
        header = await anext(messages)
        rest = await self.intercept(header, messages)

        async def stream():
            yield header
            async for m in rest:
                yield m

        return await self.inner.push(address, stream(), timeout_s)

    async def close(self):
        pass


class FaultyTransport(InterceptingTransport):
    """One fault applied to the streams of prompts of one length (the first `times` of them)."""

    def __init__(self, inner, fault, num_tokens: int, times: int = 1 << 30):
        super().__init__(inner)
        self.fault, self.num_tokens, self.times = fault, num_tokens, times

    async def intercept(self, header, messages):
        if header.num_tokens == self.num_tokens and self.times > 0:
            self.times -= 1
            return self.fault(messages)
        return messages


def system_tokenizer(path) -> Tokenizer:
    return Tokenizer.from_dir(str(path))
