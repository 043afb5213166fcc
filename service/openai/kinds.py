"""The two kinds of generation request and the endpoint of each (jobs and batch lines are one or the other)."""

from __future__ import annotations

from typing import Any, Literal, get_args

Kind = Literal["completion", "chat"]
KINDS: tuple[str, ...] = get_args(Kind)
ENDPOINT_KINDS: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def request_kind(body: dict[str, Any]) -> Kind:
    """A chat request has `messages`; anything else is a completion request."""
    return "chat" if "messages" in body else "completion"
