"""`moecache serve`: the OpenAI-compatible HTTP API, the gRPC API, durable jobs and batches, Prometheus
metrics, drain on SIGTERM. Its options come from the fields of the config dataclasses."""

from __future__ import annotations

import argparse
import asyncio
import functools

from engine.config import EngineConfig
from service.engine_setup import load_engine
from service.jobs.run import WorkerOptions
from service.jobs.runtime import JobOptions, default_jobs_db
from service.openai.limits import Limits
from service.options import add_engine_options, add_options, engine_config, from_options
from service.progress import ProgressBar
from service.server import DEFAULT_GRPC_PORT, ServeOptions, serve


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API, the gRPC API and durable jobs")
    add_engine_options(p)
    s = p.add_argument_group("server")
    add_options(s, ServeOptions)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT,
                   help=f"gRPC port on --host (0: any free port; default: {DEFAULT_GRPC_PORT})")
    g.add_argument("--no-grpc", action="store_true", help="serve no gRPC API")
    j = p.add_argument_group("jobs and batches")
    add_options(j, JobOptions)
    add_options(j, WorkerOptions)
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-context", type=int, default=None, metavar="N", help="same as --ctx-size")
    add_options(lim, Limits)
    p.set_defaults(run=run)
    return p


def serve_options(args: argparse.Namespace) -> ServeOptions:
    grpc_port = None if args.no_grpc else args.grpc_port
    return from_options(ServeOptions, args, limits=from_options(Limits, args), grpc_port=grpc_port,
                        jobs=job_options(args))


def job_options(args: argparse.Namespace) -> JobOptions:
    return from_options(JobOptions, args, db_url=args.jobs_db or default_jobs_db(),
                        worker=from_options(WorkerOptions, args))


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config; --max-context, when given, is the engine's --ctx-size."""
    if args.max_context is not None:
        args = argparse.Namespace(**{**vars(args), "ctx_size": args.max_context})
    return engine_config(args)


def run(args: argparse.Namespace) -> int:
    load = functools.partial(load_engine, routing=args.routing, capture_graphs=True)
    return asyncio.run(serve(serve_config(args), serve_options(args), ProgressBar(), load))
