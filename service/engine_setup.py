"""What the command line decides for the engine: the model file when none is named (the embedded model,
generated on first use) and, for benchmarks, the router that replaces the model's (`--routing`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tools.embedded import embedded_model_path
from tools.routing import make_router

ROUTING_HELP = "model | trace:FILE | synthetic:qwen3 | synthetic:mixtral"


@dataclass(frozen=True)
class RoutingOptions:
    routing: str = field(default="model", metadata={"flag": "--routing", "hidden": True, "help": ROUTING_HELP})


def with_default_model(config: EngineConfig) -> EngineConfig:
    """`config` naming a model file: the embedded model when it names none."""
    if config.model.path is not None:
        return config
    return replace(config, model=replace(config.model, path=str(embedded_model_path())))


def install_router(engine: LLMEngine, routing: str) -> None:
    """Give the engine a fresh router of the `routing` spec: the model's own, or routing drawn per request
    (synthetic or a trace replayed), its streams started anew."""
    engine.set_router(make_router(routing, engine.weights, engine.scheduler.config.max_num_batched_tokens,
                                  engine.device))


def load_engine(config: EngineConfig, progress: Callable[[str, int, int], None] | None = None,
                routing: str = "model", capture_graphs: bool = False) -> LLMEngine:
    """The engine of a command: the default model when the config names none, the routing spec's router;
    `capture_graphs`: every decode graph captured before the first request (a server)."""
    engine = LLMEngine(with_default_model(config), progress)
    if routing != "model":
        install_router(engine, routing)
    if capture_graphs:
        engine.capture_graphs()
    return engine
