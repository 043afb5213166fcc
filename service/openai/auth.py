"""The API key as OpenAI clients send it: `Authorization: Bearer <key>` (the scheme in any case)."""

from __future__ import annotations

import hmac


def is_authorized(authorization: str | bytes | None, api_key: str) -> bool:
    """Whether an Authorization value (an HTTP header, gRPC metadata) carries `api_key`."""
    if authorization is None:
        return False
    raw = authorization if isinstance(authorization, bytes) else authorization.encode("utf-8", "surrogateescape")
    scheme, _, token = raw.strip().partition(b" ")
    # NOTE: constant time, so the key cannot be guessed byte by byte from response times.
    is_key = hmac.compare_digest(token.strip(), api_key.encode())
    return scheme.lower() == b"bearer" and is_key
