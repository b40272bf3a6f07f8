"""A request as the router sees it: the validated request, and its life cycle.

    received ──a decode worker reserved its blocks──► admitted ──a prefill worker took it──►
        prefilling ──first token──► streaming ──► finished
    from any state ──► failed (a status for the client) | cancelled (the client went away)

Colocated requests go from admitted straight to streaming (the decode worker prefills them).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams


class RequestState(enum.Enum):
    RECEIVED = "received"
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    STREAMING = "streaming"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class RouterRequest:
    req_id: str  # the router's own, unique; used with the workers
    client_request_id: str  # echoed back
    prompt_token_ids: list[int]
    params: SamplingParams  # seed always set
