"""`Sampler`: turns logits rows into tokens under each request's own `SamplingParams`.

Filtering and the draw run through the selected `KernelOps`; the uniforms come from `rng`,
keyed by each row's request seed and the position the sampled token will occupy.
"""
from __future__ import annotations

import torch

from pdserve.engine import rng
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels import KernelOps


def param_tensors(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-row (temperature, top_k, top_p, min_p) tensors for the sampling ops."""
    return (
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
    )


class Sampler:
    def __init__(self, ops: KernelOps):
        self.ops = ops

    def sample(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
    ) -> list[int]:
        if not params:
            return []
        if all(p.is_greedy for p in params):  # one-hot rows: the draw is the argmax whatever u is
            return logits.argmax(-1).tolist()
        u = rng.uniforms(seeds, positions).to(logits.device)
        return self.ops.sample(logits, *param_tensors(params, logits.device), u).tolist()

    @staticmethod
    def top_logprobs(logits: torch.Tensor, token_ids: list[int], num: int) -> list[list[tuple[int, float]]]:
        """The sampled token's log-prob first, then the top `num`, from the raw model logits."""
        logp = logits.float().log_softmax(-1)
        top = logp.topk(num, dim=-1) if num else None
        out = []
        for i, tok in enumerate(token_ids):
            row = [(tok, float(logp[i, tok]))]
            if top is not None:
                row += list(zip(top.indices[i].tolist(), top.values[i].tolist()))
            out.append(row)
        return out
