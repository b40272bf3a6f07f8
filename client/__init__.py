"""pdserve's public Python client of the gRPC API (`pdserve.v1.Generation`), sync and asyncio.

    from pdserve.client import Client

    with Client("127.0.0.1:50051") as client:
        for delta in client.generate("def fib(n):", max_tokens=32, temperature=0):
            print(delta.text, end="", flush=True)

Torch-free: it imports only grpc and the generated `pdserve.v1` modules.
"""
from pdserve.client.async_client import AsyncClient, AsyncStream
from pdserve.client.errors import (CancelledError, DeadlineExceededError, GenerationError, InvalidArgumentError,
                                   PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError,
                                   UnavailableError)
from pdserve.client.messages import Completion, Delta, FinishReason, SamplingParams, TokenLogprobs, Usage
from pdserve.client.retry import RetryPolicy
from pdserve.client.sync_client import Client, Stream

__all__ = ["Client", "AsyncClient", "Stream", "AsyncStream", "Delta", "Completion", "Usage", "FinishReason",
           "TokenLogprobs",
           "SamplingParams", "RetryPolicy", "GenerationError", "InvalidArgumentError", "ResourceExhaustedError",
           "UnavailableError", "DeadlineExceededError", "UnauthenticatedError", "PermissionDeniedError",
           "CancelledError"]
