"""A request as the router sees it: the validated request, and its life cycle.

    received ──a decode worker reserved its blocks──► admitted ──a prefill worker took it──►
        prefilling ──first token──► streaming ──► finished
    from any state ──► failed (a status for the client) | cancelled (the client went away)
    admitted, prefilling or streaming ──a worker failed──► re_admitted (failover: the prompt and
        the tokens already sent, on other workers) ──► prefilling ──► streaming (same client stream)

Colocated requests go from admitted straight to streaming (the decode worker prefills them), and
so do those whose reservation answered `prefills_here` (it held all but a short tail).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from pdserve.engine.sampling_params import SamplingParams


class RequestState(enum.Enum):
    RECEIVED = "received"
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    STREAMING = "streaming"
    # a worker failed mid-request: the prompt plus the tokens already sent are admitted again
    # on other workers and the same client stream continues
    RE_ADMITTED = "re_admitted"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RequestFailed(Exception):
    """A request ends with this status code and message for the client (`is_final`: whatever
    the code, failing over would not help)."""

    def __init__(self, code: grpc.StatusCode, message: str, is_final: bool = False):
        super().__init__(message)
        self.code = code
        self.is_final = is_final


@dataclass(frozen=True, slots=True)
class RouterRequest:
    req_id: str  # the router's own, unique; used with the workers
    client_request_id: str  # echoed back
    prompt_token_ids: list[int]
    params: SamplingParams  # seed always set
