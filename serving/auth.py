"""Who may call what: the cluster's credentials on the internal RPCs, API keys on the public
ones, and TLS for either.

- **Cluster credentials**: one secret per deployment. Every internal call (router → workers,
  prefill → decode) carries it as `pdserve-cluster-token` metadata, and `ClusterAuth`, a server
  interceptor, refuses a call without it (UNAUTHENTICATED) before any servicer code runs. gRPC
  health and server reflection need none: probes send none. `pdserve serve` generates the secret
  and hands it to its workers; standalone processes read `--cluster-token-file` or
  `PDSERVE_CLUSTER_TOKEN`, and without either they accept anyone, saying so loudly at start.
- **TLS**: `TLSFiles` for a server's certificate and key, and, for mutual TLS between the
  processes, the CA that every peer's certificate must chain to.

Torch-free: the router imports it.
"""
from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("pdserve.auth")

CLUSTER_TOKEN_METADATA = "pdserve-cluster-token"
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
# calls any caller may make: probes and service discovery
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def load_cluster_token(path: str | None) -> str | None:
    """The cluster secret from a file (first line) or PDSERVE_CLUSTER_TOKEN; ValueError when the
    file is unusable or the secret too short to be one."""
    token = None
    if path is not None:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"--cluster-token-file {path}: {e.strerror}") from None
    else:
        token = os.environ.get(TOKEN_ENV) or None
    if token is not None and len(token) < 16:
        raise ValueError("the cluster token must be at least 16 characters")
    return token


def warn_if_open(token: str | None, role: str) -> None:
    if token is None:
        log.warning("NO CLUSTER CREDENTIALS: this %s accepts internal calls from anyone who can reach its port "
                    "(set --cluster-token-file or %s)", role, TOKEN_ENV)


class ClusterAuth(grpc.aio.ServerInterceptor):
    """Refuses internal calls without the cluster's secret, before any handler runs."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get(CLUSTER_TOKEN_METADATA, "")
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._token):
            return await continuation(details)
        return _refusal(await continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                        "this internal service needs the cluster's credentials")


def _refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only answers `code`."""
    async def refuse(request, context):
        await context.abort(code, message)

    async def refuse_stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)


def cluster_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """What an internal call sends."""
    return ((CLUSTER_TOKEN_METADATA, token),) if token else ()


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files. `ca`, when set, is what peers' certificates must chain to (mutual TLS)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    # clients check the peer's certificate for this name instead of the address's host: one
    # certificate (SAN pdserve-internal, say) then serves every worker whatever its address
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a TLS certificate and its key go together: give both or neither")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"TLS {name} file {path} does not exist")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return Path(path).read_bytes() if path else None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._read("key"), self._read("cert"))], root_certificates=self._read("ca"),
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's: trusts `ca`, and presents the certificate (mutual TLS)."""
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca"), private_key=self._read("key"),
                                            certificate_chain=self._read("cert"))

    def ssl_context(self):
        """For the HTTP server."""
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        if self.ca:
            ctx.load_verify_locations(self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass(frozen=True, slots=True)
class ClusterSecurity:
    """What every internal connection uses: the shared secret, and mutual TLS when configured."""

    token: str | None = None
    tls: TLSFiles = TLSFiles()

    def channel(self, address: str, options: list[tuple]) -> grpc.aio.Channel:
        if self.tls.enabled:
            if self.tls.server_name:
                options = [*options, ("grpc.ssl_target_name_override", self.tls.server_name)]
            return grpc.aio.secure_channel(address, self.tls.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(address, options=options)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return cluster_metadata(self.token)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [ClusterAuth(self.token)] if self.token else []
