"""`moecache serve`: the OpenAI-compatible HTTP API, the gRPC API, durable jobs and batches, Prometheus
metrics, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio

from engine.config import EngineConfig
from service.http import Limits
from service.jobs.run import WorkerOptions
from service.jobs.runtime import JobOptions, default_jobs_db
from service.options import add_engine_options, engine_config
from service.progress import ProgressBar
from service.server import ServeOptions, serve


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API, the gRPC API and durable jobs")
    add_engine_options(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0: any free port (the log names it)")
    s.add_argument("--served-model-name", default=None, help="the model id of the API (default: the file name)")
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (also MOECACHE_API_KEY)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds for running requests to finish before they are aborted")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--grpc-port", type=int, default=50051, help="gRPC port on --host (0: any free port)")
    g.add_argument("--no-grpc", action="store_true", help="serve no gRPC API")
    j = p.add_argument_group("jobs and batches")
    j.add_argument("--jobs-db", default=None, metavar="URL", help="job store: sqlite:///PATH, or postgresql://... "
                   "shared by several replicas (default: sqlite:///<MOECACHE_CACHE_DIR or ~/.cache/moecache>/jobs.db)")
    j.add_argument("--job-concurrency", type=int, default=4, metavar="N", help="jobs this server runs at once")
    j.add_argument("--job-lease", type=float, default=30.0, metavar="S",
                   help="a crashed server's running jobs resume elsewhere after this many seconds")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-context", type=int, default=None, metavar="N", help="same as --ctx-size")
    lim.add_argument("--max-tokens-limit", type=int, default=4096, metavar="N",
                     help="the largest max_tokens a request may ask for")
    lim.add_argument("--max-concurrent-requests", type=int, default=64, metavar="N")
    lim.add_argument("--max-queued-requests", type=int, default=256, metavar="N",
                     help="requests waiting for a turn beyond the concurrent ones; more get 429")
    lim.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N")
    lim.add_argument("--max-stop-strings", type=int, default=16, metavar="N")
    lim.add_argument("--max-n", type=int, default=8, metavar="N", help="choices per request (n x prompts)")
    lim.add_argument("--max-queued-jobs", type=int, default=10_000, metavar="N", help="more submissions get 429")
    lim.add_argument("--max-file-bytes", type=int, default=200 << 20, metavar="N", help="larger uploads get 413")
    p.set_defaults(run=run)
    return p


def serve_options(args: argparse.Namespace) -> ServeOptions:
    limits = Limits(max_tokens=args.max_tokens_limit, max_concurrent_requests=args.max_concurrent_requests,
                    max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                    max_stop_strings=args.max_stop_strings, max_n=args.max_n)
    return ServeOptions(args.host, args.port, args.served_model_name, args.api_key, limits, args.shutdown_timeout,
                        grpc_port=None if args.no_grpc else args.grpc_port, jobs=job_options(args))


def job_options(args: argparse.Namespace) -> JobOptions:
    worker = WorkerOptions(concurrency=args.job_concurrency, lease_s=args.job_lease)
    return JobOptions(args.jobs_db or default_jobs_db(), worker, args.max_queued_jobs, args.max_file_bytes)


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config; --max-context, when given, is the engine's --ctx-size."""
    if args.max_context is not None:
        args = argparse.Namespace(**{**vars(args), "ctx_size": args.max_context})
    return engine_config(args)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve(serve_config(args), serve_options(args), ProgressBar()))
