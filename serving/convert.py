"""Wire <-> plain-value conversions shared by every server edge. Imports no pdserve package,
so each side builds its own dataclasses from these values (`SamplingParams(**sampling_kwargs(m))`)."""
from __future__ import annotations

from pdserve.v1 import generation_pb2 as gen_pb2
from pdserve.v1 import worker_pb2

# The OpenAI defaults for unset optional fields; max_tokens 16 as in OpenAI's completions API.
_OPTIONAL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 16, "seed": None}

FINISH_REASONS = {"stop": gen_pb2.STOP, "length": gen_pb2.LENGTH, "abort": gen_pb2.ABORT}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_kwargs(msg: gen_pb2.SamplingParams) -> dict:
    """Keyword arguments for `engine.SamplingParams`, unset fields at their defaults."""
    kwargs = {name: (getattr(msg, name) if msg.HasField(name) else default)
              for name, default in _OPTIONAL_DEFAULTS.items()}
    kwargs.update(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos)
    return kwargs


def sampling_message(temperature: float, top_p: float, top_k: int, min_p: float, max_tokens: int,
                     stop: list[str], stop_token_ids: list[int], seed: int | None,
                     ignore_eos: bool) -> gen_pb2.SamplingParams:
    msg = gen_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                 max_tokens=max_tokens, stop=stop, stop_token_ids=stop_token_ids,
                                 ignore_eos=ignore_eos)
    if seed is not None:
        msg.seed = seed
    return msg


def worker_info(role: str, desc) -> worker_pb2.WorkerInfo:
    """A WorkerInfo from any object with its fields as attributes (`engine.disagg.WorkerDescription`)."""
    msg = worker_pb2.WorkerInfo(role=role)
    for field in worker_pb2.WorkerInfo.DESCRIPTOR.fields:
        if field.name == "kv_groups":
            msg.kv_groups.extend(worker_pb2.KVGroupLayout(name=g.name, num_layers=g.num_layers,
                                                          num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)
                                 for g in desc.kv_groups)
        elif field.name != "role":
            value = getattr(desc, field.name)
            if isinstance(value, tuple):
                getattr(msg, field.name).extend(value)
            else:
                setattr(msg, field.name, value)
    return msg
