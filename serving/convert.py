"""Wire <-> engine-value conversions shared by every server edge (torch-free: the router uses
them too)."""
from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as gen_pb2
from pdserve.v1 import worker_pb2

# The OpenAI defaults for unset optional fields; max_tokens 16 as in OpenAI's completions API.
_OPTIONAL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 16, "seed": None,
                      "logprobs": None, "presence_penalty": 0.0, "frequency_penalty": 0.0}

FINISH_REASONS = {"stop": gen_pb2.STOP, "length": gen_pb2.LENGTH, "abort": gen_pb2.ABORT}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}
# The trailing metadata of a failed call whose tokens went on a token stream: how many of its
# tokens the stream carried before the failure, which the router reads before it fails the call
# (the call and the stream are two HTTP/2 streams, so the failure may come first).
STREAM_TOKENS_METADATA = "pdserve-stream-tokens"


# Stop conditions are checked against every token on the hot path: bounded wherever a request
# enters (the router, and each worker, which may be called directly).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


def check_stop_limits(stop, stop_token_ids) -> None:
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ValueError(f"sampling_params.stop allows {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"sampling_params.stop_token_ids allows {MAX_STOP_TOKEN_IDS} ids")


def sampling_kwargs(msg: gen_pb2.SamplingParams) -> dict:
    """Keyword arguments for `engine.SamplingParams`, unset fields at their defaults."""
    kwargs = {name: (getattr(msg, name) if msg.HasField(name) else default)
              for name, default in _OPTIONAL_DEFAULTS.items()}
    kwargs.update(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos)
    return kwargs


def sampling_message(p: SamplingParams) -> gen_pb2.SamplingParams:
    msg = gen_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                                 max_tokens=p.max_tokens, stop=p.stop, stop_token_ids=p.stop_token_ids,
                                 ignore_eos=p.ignore_eos)
    for name in ("seed", "logprobs"):
        if getattr(p, name) is not None:
            setattr(msg, name, getattr(p, name))
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(p, name):
            setattr(msg, name, getattr(p, name))
    return msg


def work_request_message(req_id: str, prompt_token_ids: list[int], params: SamplingParams) -> worker_pb2.WorkRequest:
    """What the router sends a worker: a validated, tokenized, seeded request."""
    return worker_pb2.WorkRequest(req_id=req_id, prompt_token_ids=prompt_token_ids,
                                  sampling_params=sampling_message(params),
                                  num_output_tokens_in_prompt=params.num_output_tokens_in_prompt)


def parse_work_request(msg: worker_pb2.WorkRequest) -> tuple[str, list[int], SamplingParams]:
    """A worker's side of `work_request_message`; ValueError naming the field."""
    if not msg.req_id:
        raise ValueError("req_id is empty")
    check_stop_limits(msg.sampling_params.stop, msg.sampling_params.stop_token_ids)
    if msg.num_output_tokens_in_prompt > len(msg.prompt_token_ids):
        raise ValueError("num_output_tokens_in_prompt is longer than the prompt")
    params = SamplingParams(**sampling_kwargs(msg.sampling_params),
                            num_output_tokens_in_prompt=msg.num_output_tokens_in_prompt)
    return msg.req_id, list(msg.prompt_token_ids), params


# the engine's log-probs of one token: (token id, logprob) of the generated token, then the top N
TokenLogprobs = list[tuple[int, float]]


def logprobs_message(row: TokenLogprobs) -> gen_pb2.TokenLogprobs:
    (_, logprob), top = row[0], row[1:]
    return gen_pb2.TokenLogprobs(logprob=logprob, top_token_ids=[t for t, _ in top],
                                 top_logprobs=[lp for _, lp in top])


def parse_logprobs(msg: gen_pb2.TokenLogprobs, token_id: int) -> TokenLogprobs:
    return [(token_id, msg.logprob), *zip(msg.top_token_ids, msg.top_logprobs)]


# WorkerInfo fields the worker itself sets, not the engine's description
WORKERS_OWN = ("role", "shm_probe", "shm_probe_nonce", "kv_dist_backends", "kv_target_ready", "token_streams")


def worker_info(role: str, desc) -> worker_pb2.WorkerInfo:
    """A WorkerInfo from any object with its fields as attributes (`engine.disagg.WorkerDescription`)."""
    msg = worker_pb2.WorkerInfo(role=role)
    for field in worker_pb2.WorkerInfo.DESCRIPTOR.fields:
        if field.name == "kv_groups":
            msg.kv_groups.extend(worker_pb2.KVGroupLayout(name=g.name, num_layers=g.num_layers,
                                                          num_kv_heads=g.num_kv_heads, head_dim=g.head_dim)
                                 for g in desc.kv_groups)
        elif field.name not in WORKERS_OWN:
            value = getattr(desc, field.name)
            if isinstance(value, tuple):
                getattr(msg, field.name).extend(value)
            else:
                setattr(msg, field.name, value)
    return msg
