"""How a client reaches the server: target, TLS credentials, and per-call metadata.

`ConnectionOptions` is built once per client; `Client` and `AsyncClient` open their channels
from it (`open_channel` / `open_aio_channel`). An API key travels as `authorization: Bearer
<key>` on every call, beside any metadata the caller adds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

# Generous message limits: a prompt can be long (the router bounds it itself).
CHANNEL_OPTIONS = (("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20))


@dataclass(frozen=True, slots=True)
class ConnectionOptions:
    target: str  # "host:port"
    api_key: str | None = None
    tls: bool = False  # True with no root_certificates: the system's roots
    root_certificates: bytes | None = None  # PEM; implies tls
    metadata: tuple[tuple[str, str], ...] = ()
    channel_options: tuple[tuple[str, object], ...] = field(default=CHANNEL_OPTIONS)

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target or ":" not in self.target:
            raise ValueError(f"target must be 'host:port', got {self.target!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string")
        for key, value in self.metadata:
            if not isinstance(key, str) or key != key.lower() or not isinstance(value, str):
                raise ValueError(f"metadata keys must be lower-case strings with string values, got {key!r}")
            if key == "authorization" and self.api_key is not None:
                raise ValueError("metadata has 'authorization' and api_key is set too: give one")

    @classmethod
    def build(cls, target: str, api_key: str | None = None, tls: bool = False,
              root_certificates: bytes | str | Path | None = None,
              metadata: dict[str, str] | list[tuple[str, str]] | None = None) -> "ConnectionOptions":
        """From the clients' keyword arguments: `root_certificates` may be PEM bytes or a path."""
        roots = root_certificates
        if isinstance(roots, (str, Path)):
            try:
                roots = Path(roots).read_bytes()
            except OSError as e:
                raise ValueError(f"root_certificates: cannot read {roots}: {e.strerror}") from None
        pairs = tuple((metadata or {}).items()) if isinstance(metadata, dict) or metadata is None else tuple(metadata)
        return cls(target, api_key, tls or roots is not None, roots, tuple((k, v) for k, v in pairs))

    @property
    def is_secure(self) -> bool:
        return self.tls or self.root_certificates is not None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        auth = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        return auth + self.metadata


def open_channel(opts: ConnectionOptions) -> grpc.Channel:
    if opts.is_secure:
        return grpc.secure_channel(opts.target, opts.credentials(), options=opts.channel_options)
    return grpc.insecure_channel(opts.target, options=opts.channel_options)


def open_aio_channel(opts: ConnectionOptions) -> grpc.aio.Channel:
    """Must be called inside the event loop that will use the channel."""
    if opts.is_secure:
        return grpc.aio.secure_channel(opts.target, opts.credentials(), options=opts.channel_options)
    return grpc.aio.insecure_channel(opts.target, options=opts.channel_options)
