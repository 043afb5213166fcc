"""`moecache serve`: the OpenAI-compatible HTTP API, Prometheus metrics, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio

from engine.config import EngineConfig
from service.http import Limits
from service.options import add_engine_options, engine_config
from service.progress import ProgressBar
from service.server import ServeOptions, serve


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_options(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0: any free port (the log names it)")
    s.add_argument("--served-model-name", default=None, help="the model id of the API (default: the file name)")
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (also MOECACHE_API_KEY)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds for running requests to finish before they are aborted")
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
    p.set_defaults(run=run)
    return p


def serve_options(args: argparse.Namespace) -> ServeOptions:
    limits = Limits(max_tokens=args.max_tokens_limit, max_concurrent_requests=args.max_concurrent_requests,
                    max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                    max_stop_strings=args.max_stop_strings, max_n=args.max_n)
    return ServeOptions(args.host, args.port, args.served_model_name, args.api_key, limits, args.shutdown_timeout)


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config; --max-context, when given, is the engine's --ctx-size."""
    if args.max_context is not None:
        args = argparse.Namespace(**{**vars(args), "ctx_size": args.max_context})
    return engine_config(args)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve(serve_config(args), serve_options(args), ProgressBar()))
