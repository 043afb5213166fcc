"""What the HTTP API, the gRPC API and the jobs of one server share: the engine, its metrics, the
admission of requests, the limits, and the model's name."""

from __future__ import annotations

from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from engine.gguf.tokenizer import Tokenizer
from service.metrics import Metrics
from service.openai.limits import Admission, Limits
from service.openai.requests import ServedModel


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    metrics: Metrics
    admission: Admission
    limits: Limits
    model_name: str
    version: str
    api_key: str | None = None
    created: int = 0  # unix time the server started (the model object's `created`)

    @property
    def fingerprint(self) -> str:
        return f"fp_moecache_{self.version}"

    @property
    def tokenizer(self) -> Tokenizer:
        """Only once the model is loaded (behind the readiness checks of the APIs)."""
        assert self.engine.tokenizer is not None
        return self.engine.tokenizer

    @property
    def model(self) -> ServedModel:
        """Only once the model is loaded."""
        return ServedModel(self.model_name, self.tokenizer, self.engine.max_model_len, self.limits)


def engine_status(state: ServerState) -> tuple[str, str]:
    """(status, why) as /health reports it."""
    engine = state.engine
    if engine.is_dead:
        return "dead", "the engine stopped after an error"
    if not engine.is_ready:
        return "loading", "the model is still loading"
    if not engine.is_accepting:
        return "draining", "the server is shutting down"
    return "ok", ""
