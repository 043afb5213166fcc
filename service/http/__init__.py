"""The OpenAI-compatible HTTP API (aiohttp)."""

from service.http.app import build_app
from service.http.limits import Admission, Limits
from service.http.state import AppState

__all__ = ["Admission", "AppState", "Limits", "build_app"]
