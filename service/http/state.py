"""What the handlers of one server share, stored on the aiohttp application."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.gguf.tokenizer import Tokenizer
from service.http.limits import Admission, Limits
from service.metrics import Metrics

if TYPE_CHECKING:  # the jobs package builds on this module
    from service.jobs.runtime import Jobs


@dataclass(frozen=True)
class AppState:
    engine: AsyncEngine
    metrics: Metrics
    admission: Admission
    limits: Limits
    model_name: str
    version: str
    api_key: str | None = None
    created: int = 0  # unix time the server started (the model object's `created`)
    jobs: Jobs | None = None  # None: no job, file or batch API

    @property
    def fingerprint(self) -> str:
        return f"fp_moecache_{self.version}"

    @property
    def tokenizer(self) -> Tokenizer:
        """Only for handlers behind the readiness gate: the model is loaded."""
        assert self.engine.tokenizer is not None
        return self.engine.tokenizer


STATE = web.AppKey("state", AppState)


def app_state(request: web.Request) -> AppState:
    return request.app[STATE]
