"""`LLM`: the offline API — a batch of prompts in, finished outputs back (or a stream)."""
from __future__ import annotations

import itertools
from typing import Iterator, Sequence as Seq

from tqdm import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM("models/demo", draft_model="models/demo-draft", num_speculative_tokens=4)`; any
    `EngineConfig` field is an option."""

    def __init__(self, model: str, **options):
        self.engine = LLMEngine(EngineConfig(model=str(model), **options))
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = self._params_list(params, len(prompts))
        seqs = [self.engine.make_sequence(f"offline-{next(self._ids)}", p, sp) for p, sp in zip(prompts, params_list)]
        if len({s.req_id for s in seqs}) != len(seqs):
            raise ValueError("duplicate request ids")
        for seq in seqs:
            self.engine.add_sequence(seq)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(seqs), disable=not use_tqdm, desc="generate", unit="req") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.req_id] = out
                        bar.update(1)
        return [done[s.req_id] for s in seqs]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields one delta per step that produced tokens; the last one has `finished` set."""
        seq = self.engine.add_request(f"stream-{next(self._ids)}", prompt, params or SamplingParams())
        try:
            while not seq.is_finished:
                for out in self.engine.step():
                    if out.req_id == seq.req_id:
                        yield out
        finally:
            self.engine.abort(seq.req_id)

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params
