"""Transfer tickets (serving/tickets.py): what a decode worker signs, a prefill worker and a push
read back, the prompt's cached tokens among it."""
from __future__ import annotations

import base64
import json

import pytest

from pdserve.serving.tickets import TicketError, issue, ticket_key, verify

KEY = ticket_key("a cluster secret")


def test_a_ticket_carries_the_decode_workers_cached_tokens_under_its_signature():
    text, ticket = issue(KEY, "req-1", "10.0.0.2:5000", 30.0, cached_tokens=48)
    assert verify(KEY, text) == ticket and ticket.cached_tokens == 48
    text, ticket = issue(KEY, "req-2", "10.0.0.2:5000", 30.0)
    assert verify(KEY, text).cached_tokens == 0 and '"c"' not in base64.urlsafe_b64decode(text.split(".")[1] + "==").decode()
    # changed in flight (more tokens skipped than the decode worker holds): the signature fails
    version, payload, mac = issue(KEY, "req-3", "10.0.0.2:5000", 30.0, cached_tokens=16)[0].split(".")
    fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    forged = base64.urlsafe_b64encode(json.dumps({**fields, "c": 64}).encode()).rstrip(b"=").decode()
    with pytest.raises(TicketError, match="signature"):
        verify(KEY, f"{version}.{forged}.{mac}")


@pytest.mark.parametrize("cached", [-16, "sixteen", [16]])
def test_a_malformed_cached_count_is_refused(cached):
    payload = base64.urlsafe_b64encode(json.dumps({"r": "x", "a": "h:1", "n": "n", "e": 2e9, "c": cached}).encode())
    with pytest.raises(TicketError, match="malformed"):
        verify(None, f"v1.{payload.rstrip(b'=').decode()}.")  # no cluster secret: an empty MAC
