"""The OpenAI-compatible HTTP API (aiohttp) over the protocol of `service.openai`."""

from service.http.app import build_app

__all__ = ["build_app"]
