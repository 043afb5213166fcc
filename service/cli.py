"""The `moecache` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Idle OpenMP threads sleep instead of spinning: torch's ops and the native expert kernel share one
# OpenMP runtime, and spinning threads starve the thread that has work (10x slower decode measured on a
# 2-core machine). Must be set before torch loads libgomp; the user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import importlib  # noqa: E402
from collections.abc import Callable  # noqa: E402
from types import ModuleType  # noqa: E402

COMMANDS = ("generate", "perplexity", "synth", "plan", "serve", "bench", "bench-serve")
OWN_PACKAGES = ("engine", "ops", "service", "tools")
# Import names whose distribution is named otherwise, for the message of a command that cannot load.
DISTRIBUTIONS = {"grpc": "grpcio", "grpc_health": "grpcio-health-checking", "grpc_reflection": "grpcio-reflection",
                 "grpc_tools": "grpcio-tools", "google": "protobuf", "prometheus_client": "prometheus-client",
                 "yaml": "PyYAML", "psycopg": "psycopg[binary]"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moecache", description="Mixture-of-Experts inference with a GPU "
                                     "expert cache: experts in host RAM, the hot ones on the GPU.")
    parser.add_argument("-v", "--verbose", action="store_true")
    from service.options import apply_env_defaults  # imports the engine: torch, gguf

    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:  # a command whose optional dependencies are missing stays out; the others still run
            command = import_command(name)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] in OWN_PACKAGES:
                raise  # a bug of ours, not a missing package
            message = unavailable_message(name, exc)
            p = sub.add_parser(name, help=f"unavailable: {missing_package(exc)} is not installed",
                               description=message)
            p.set_defaults(run=_unavailable(message), is_unavailable=True)
            continue
        apply_env_defaults(command.register(sub))
    return parser


def import_command(name: str) -> ModuleType:
    return importlib.import_module(f"service.commands.{name.replace('-', '_')}")


def missing_package(exc: ImportError) -> str:
    """The distribution to install for a failed import (`grpc` -> `grpcio`)."""
    top = (exc.name or "").split(".")[0]
    return DISTRIBUTIONS.get(top, top.replace("_", "-")) or "a package"


def unavailable_message(name: str | None, exc: ImportError) -> str:
    package, command = missing_package(exc), f"moecache {name}" if name else "moecache"
    return (f"`{command}` needs the Python package {package}, which is not installed ({exc}); "
            f"install it with: pip install '{package}'")


def _unavailable(message: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"moecache: {message}", file=sys.stderr)
        return 2
    return run


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a command that cannot load takes any arguments, so that its message is the one
    shown (not argparse's "unrecognized arguments" for options it no longer knows)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "is_unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
    except ImportError as exc:  # a package every command needs
        if (exc.name or "").split(".")[0] in OWN_PACKAGES:
            raise
        print(f"moecache: {unavailable_message(None, exc)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)
    try:
        return args.run(args)
    except (ValueError, OSError) as exc:  # bad files, budgets, configs (GGUFError, CacheBudgetError, ...)
        if args.verbose:
            raise
        print(f"moecache: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
