"""Transfer tickets: what a decode worker's reservation answers, and what a prefill worker and a
K/V push must present.

A ticket names the request, the decode worker's address and when it expires, with a random
nonce, under a MAC keyed by the cluster's secret:

    v1.<base64url(JSON {r: req_id, a: address, n: nonce, e: expiry[, c: cached tokens]})>.<base64url(HMAC-SHA256)>

So a prefill worker can check one without asking anyone, and sends K/V only to the address a
decode worker reserved blocks at, for that request; and nobody without the secret can forge
one, or guess one (it is not the public request id). `c`, when the decode worker holds the
prompt's first tokens already (its prefix cache), says how many: the push carries the K/V of the
tokens after them only. Without a cluster secret the MAC is empty
and only the nonce's randomness protects a reservation (the processes warn at start).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

_VERSION = "v1"


class TicketError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Ticket:
    req_id: str
    address: str  # the decode worker's, where the K/V must go
    nonce: str
    expires_at: float  # unix seconds
    cached_tokens: int = 0  # the prompt's leading tokens whose K/V the decode worker holds: not pushed


def ticket_key(cluster_token: str | None) -> bytes | None:
    """The MAC key, derived from the cluster's secret (None without one)."""
    return hashlib.sha256(b"pdserve transfer tickets\0" + cluster_token.encode()).digest() if cluster_token else None


def issue(key: bytes | None, req_id: str, address: str, ttl_s: float, cached_tokens: int = 0) -> tuple[str, Ticket]:
    ticket = Ticket(req_id, address, secrets.token_urlsafe(18), time.time() + ttl_s, cached_tokens)
    fields = {'r': req_id, 'a': address, 'n': ticket.nonce, 'e': ticket.expires_at}
    if cached_tokens:
        fields['c'] = cached_tokens
    payload = f"{_VERSION}.{_b64(json.dumps(fields).encode())}"
    return f"{payload}.{_b64(_mac(key, payload))}", ticket


def verify(key: bytes | None, text: str, now: float | None = None) -> Ticket:
    """The ticket `text` stands for; TicketError saying why it is not valid."""
    parts = text.split(".")
    if len(parts) != 3 or parts[0] != _VERSION:
        raise TicketError("not a transfer ticket")
    payload = f"{parts[0]}.{parts[1]}"
    if not hmac.compare_digest(parts[2], _b64(_mac(key, payload))):
        raise TicketError("the ticket's signature does not match (not issued by this cluster's decode workers)")
    try:
        fields = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        ticket = Ticket(str(fields["r"]), str(fields["a"]), str(fields["n"]), float(fields["e"]), int(fields.get("c", 0)))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise TicketError("the ticket's contents are malformed") from None
    if ticket.cached_tokens < 0:
        raise TicketError("the ticket's contents are malformed")
    if (time.time() if now is None else now) > ticket.expires_at:
        raise TicketError("the ticket has expired")
    return ticket


def _mac(key: bytes | None, payload: str) -> bytes:
    return hmac.new(key, payload.encode(), hashlib.sha256).digest() if key else b""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
