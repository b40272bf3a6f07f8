"""Typed exceptions for a `Generate` call that ended with a gRPC status other than OK.

Every one is a `GenerationError` carrying the status `code` (a `grpc.StatusCode`), the server's
`details` and the number of `attempts` made; the common codes have their own subclasses so
callers can catch, say, overload (`ResourceExhaustedError`) without inspecting codes.
"""
from __future__ import annotations

import grpc


class GenerationError(Exception):
    """A Generate call failed with `code`; `details` is the server's (or gRPC's) message."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1):
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details
        self.attempts = attempts


class InvalidArgumentError(GenerationError):
    """The request was refused as malformed; the message names the field."""


class ResourceExhaustedError(GenerationError):
    """The system is full (no decode worker could admit the request, or the router's queue is full)."""


class UnavailableError(GenerationError):
    """The server could not be reached, or no worker could serve; retried before any token arrived."""


class DeadlineExceededError(GenerationError):
    """The call's deadline (`timeout`) passed before it finished."""


class UnauthenticatedError(GenerationError):
    """The API key was missing or wrong."""


class PermissionDeniedError(GenerationError):
    """The API key may not make this call."""


class CancelledError(GenerationError):
    """The call was cancelled by the server (a call this client cancels ends quietly instead)."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.CANCELLED: CancelledError,
}


def error_for(code: grpc.StatusCode, details: str, attempts: int = 1) -> GenerationError:
    """The typed exception for a status code (`GenerationError` itself for codes without one)."""
    return _BY_CODE.get(code, GenerationError)(code, details, attempts)


def from_rpc_error(e: grpc.RpcError, attempts: int = 1) -> GenerationError:
    """Convert what grpc raised (sync `RpcError` or aio `AioRpcError`) into our exception."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "", attempts)
