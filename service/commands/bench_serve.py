"""`moecache bench-serve`: throughput and latency as served. A real `moecache serve` process (or the server
at `--url`), 1/8/32 concurrent streaming clients over HTTP (server-sent events) and gRPC `Generate`,
beside the in-process engine's decode speed for the same batch on the same model and options."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.gguf.reader import GGUFFile
from engine.gguf.tokenizer import Tokenizer
from engine.llm_engine import resolve_device
from service.bench.report import describe_machine
from service.bench.runner import GivenPrompts, RunSettings, decode_phases
from service.bench.server_process import ServerProcess
from service.bench.serving import (
    EngineFigures,
    ServeBenchReport,
    ServedFigures,
    ServeSettings,
    engine_figures,
    format_table,
    median_run,
    served_figures,
    server_side,
    write_json,
)
from service.bench.streams import (
    GRPC,
    HTTP,
    PATHS,
    SERVER_HISTOGRAMS,
    Client,
    GrpcClients,
    HttpClients,
    Load,
    run_clients,
)
from service.bench.sweep import comma_list
from service.engine_setup import RoutingOptions, load_engine, with_default_model
from service.options import add_engine_options, engine_config, env_name, options_of

PROMPT = "The history of the expert cache begins with a simple observation about routing:"
ENGINE_OPTIONS = (ModelConfig, CacheConfig, SchedulerConfig, RoutingOptions)


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("bench-serve", help="measure throughput, TTFT and inter-token latency through a real "
                       "server (HTTP and gRPC streams) beside the in-process engine")
    add_engine_options(p)
    r = p.add_argument_group("runs")
    r.add_argument("--clients", type=comma_list(int), default="1,8,32", help="concurrent streams")
    r.add_argument("--paths", type=comma_list(str, PATHS), default=",".join(PATHS), help="transports")
    r.add_argument("--gen-len", type=int, default=64, help="tokens each stream generates")
    r.add_argument("--prompt", default=PROMPT, help="the prompt of the streams: stream i sends it followed by "
                   "\" (i)\"")
    r.add_argument("--same-prompt", action="store_true", help="every stream sends the prompt itself (greedy, they "
                   "then decode the same tokens: every row of a step picks the same experts)")
    r.add_argument("--repeats", type=int, default=3, help="runs per row after one warm-up run (median)")
    r.add_argument("--join", type=int, default=0, metavar="N", help="requests that join runs of their own once "
                   "every stream decodes (their prompts' prefill beside the running decodes)")
    r.add_argument("--join-prompt-len", type=int, default=256, metavar="TOKENS", help="prompt of a joining request")
    r.add_argument("--join-every-ms", type=float, default=20.0, help="time between two joining requests")
    r.add_argument("--no-engine", action="store_true", help="no in-process engine figure")
    r.add_argument("--json", default=None, metavar="FILE", help="every figure with the settings and the machine")
    t = p.add_argument_group("target (default: a `moecache serve` process started with the options above)")
    t.add_argument("--url", default=None, help="measure the server at this URL (HTTP) instead")
    t.add_argument("--grpc-target", default=None, metavar="HOST:PORT", help="its gRPC address (with --url)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    fit_sequences(args)
    config = with_default_model(engine_config(args))
    check_batches(args, config)
    tokenizer = Tokenizer.from_metadata(GGUFFile(str(config.model.path)).metadata)
    loads, joining = stream_loads(args), joining_load(args, tokenizer)
    prompts = GivenPrompts([tuple(tokenizer.encode(load.prompt)) for load in loads])
    settings = ServeSettings(tuple(args.clients), tuple(args.paths), args.gen_len, len(prompts.prompts[0]),
                             args.repeats, args.join, args.join_prompt_len if args.join else 0,
                             args.join_every_ms if args.join else 0.0, args.same_prompt)
    served, server = measure_served(args, config, settings, loads, joining)
    engine = () if args.no_engine else measure_engine(config, args.routing, settings, prompts)
    machine = describe_machine(resolve_device(config.model.device))
    report = ServeBenchReport(str(config.model.path), server, machine, settings, served, engine)
    if args.json:
        write_json(report, args.json)
    print(format_table(report))
    return 0


def fit_sequences(args: argparse.Namespace) -> None:
    """Where --max-num-seqs keeps its default, the server takes every stream and joining request at once."""
    needed = max(args.clients) + args.join
    if args.url is None and args.max_num_seqs == SchedulerConfig.max_num_seqs < needed:
        args.max_num_seqs = needed
        print(f"--max-num-seqs {needed}: {max(args.clients)} clients and {args.join} joining requests at once",
              file=sys.stderr)


def check_batches(args: argparse.Namespace, config: EngineConfig) -> None:
    needed = max(args.clients) + args.join
    if args.url is None and needed > config.scheduler.max_num_seqs:
        raise ValueError(f"{max(args.clients)} clients and {args.join} joining requests need --max-num-seqs {needed}")
    if args.gen_len < 2 or args.repeats < 1 or min(args.clients) < 1:
        raise ValueError("--gen-len must be >= 2, --repeats and --clients >= 1")
    if args.url is not None and GRPC in args.paths and args.grpc_target is None:
        raise ValueError("--url measures gRPC at --grpc-target HOST:PORT (or give --paths http)")
    if args.url is None and args.grpc_target is not None:
        raise ValueError("--grpc-target goes with --url")


def stream_loads(args: argparse.Namespace) -> tuple[Load, ...]:
    """A load for each of the most clients: the prompt numbered, each stream its own. NOTE: greedy streams of one
    prompt decode the same tokens, so every row of a step would pick the same experts, as no set of users does
    (`--same-prompt` measures that)."""
    return tuple(Load(args.prompt if args.same_prompt else f"{args.prompt} ({i + 1})", args.gen_len)
                 for i in range(max(args.clients)))


def joining_load(args: argparse.Namespace, tokenizer: Tokenizer) -> Load | None:
    """A prompt of about `--join-prompt-len` tokens: the prompt's text repeated."""
    if not args.join:
        return None
    text, unit = args.prompt, " " + args.prompt
    while len(tokenizer.encode(text)) < args.join_prompt_len:
        text += unit
    return Load(text, 2)


# -- through a server ------------------------------------------------------------------------------------
def measure_served(args: argparse.Namespace, config: EngineConfig, settings: ServeSettings,
                   loads: tuple[Load, ...], joining: Load | None) -> tuple[tuple[ServedFigures, ...], str]:
    if args.url is not None:
        return asyncio.run(measure_paths(args.url, args.grpc_target, settings, loads, joining)), args.url
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(server_settings(args, config),
                                                             Path(tmp) / "jobs.db") as server:
        print(f"server: {server.url}, gRPC {server.grpc_target}", file=sys.stderr, flush=True)
        figures = asyncio.run(measure_paths(server.url, server.grpc_target, settings, loads, joining))
    return figures, describe_options(server_settings(args, config))


def server_settings(args: argparse.Namespace, config: EngineConfig) -> dict[str, str]:
    """The engine options that differ from their defaults, as the server's `MOECACHE_*` variables, and the
    model file."""
    found = {env_name(o.dest): _env_value(getattr(args, o.dest)) for cls in ENGINE_OPTIONS for o in options_of(cls)
             if getattr(args, o.dest) != o.default}
    return found | {"MOECACHE_MODEL": str(config.model.path)}


def _env_value(value: object) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def describe_options(settings: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(settings.items()) if k != "MOECACHE_MODEL") or "defaults"


async def measure_paths(url: str, grpc_target: str | None, settings: ServeSettings, loads: tuple[Load, ...],
                        joining: Load | None) -> tuple[ServedFigures, ...]:
    figures: list[ServedFigures] = []
    async with HttpClients(url) as scraper:  # the server's own histograms around each run
        for path in settings.paths:
            async with (HttpClients(url) if path == HTTP else GrpcClients(grpc_target or "")) as clients:
                for num_clients in settings.clients:
                    figures.append(await measure_row(path, clients.stream, scraper.totals, settings,
                                                     loads[:num_clients], joining))
                    print(f"{path} x{num_clients}: {figures[-1].tokens_per_second:.1f} tok/s", file=sys.stderr,
                          flush=True)
    return tuple(figures)


async def measure_row(path: str, client: Client, totals: Callable[[], Awaitable[dict[str, float] | None]],
                      settings: ServeSettings, loads: tuple[Load, ...], joining: Load | None) -> ServedFigures:
    """A warm-up run, then `repeats` runs: the run of median decode speed, with the server's mean queue time and
    TTFT of its requests (`totals`: its histograms); with joining requests, as many runs again with them, whose
    latencies while they join are added to it."""
    plain = []
    for _ in range(settings.repeats + 1):
        before = await totals()
        figures = served_figures(path, await run_clients(client, loads))
        plain.append(replace(figures, server=server_side(before, await settled_totals(totals, before, len(loads)))))
    figures = median_run(plain[1:])
    if joining is None:
        return figures
    joined = [served_figures(path, await run_clients(client, loads, joining, settings.num_joining,
                                                     settings.joining_every_ms / 1e3))
              for _ in range(settings.repeats)]
    middle = median_run(joined)
    return replace(figures, itl_joining=middle.itl_joining, ttft_joining=middle.ttft_joining)


async def settled_totals(totals: Callable[[], Awaitable[dict[str, float] | None]], before: dict[str, float] | None,
                         num_requests: int) -> dict[str, float] | None:
    """The totals once the server counted the run's requests (it records a request as its stream ends, just after
    the client reads the last token), waiting at most a second."""
    key = f"{SERVER_HISTOGRAMS[1]}_count"
    for _ in range(20):
        after = await totals()
        if before is None or after is None or after.get(key, 0.0) - before.get(key, 0.0) >= num_requests:
            return after
        await asyncio.sleep(0.05)
    return after


# -- in process ------------------------------------------------------------------------------------------
def measure_engine(config: EngineConfig, routing: str, settings: ServeSettings,
                   prompts: GivenPrompts) -> tuple[EngineFigures, ...]:
    """Bench's decode runs (`service.bench.runner`) on the streams' prompts, after the server stopped."""
    run_settings = RunSettings(settings.prompt_tokens, settings.prompt_tokens, settings.gen_len, settings.clients,
                               settings.repeats)
    engine = load_engine(config, routing=routing)
    try:
        phases = [phase for run in range(run_settings.repeats + 1) for batch in run_settings.batches
                  for phase in decode_phases(engine, prompts, run_settings, batch, run)]
    finally:
        engine.close()
    return tuple(engine_figures(phases, batch, settings.gen_len) for batch in settings.clients)
