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

from service.options import apply_env_defaults  # noqa: E402

COMMANDS = ("generate", "perplexity", "synth", "plan", "serve", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moecache", description="Mixture-of-Experts inference with a GPU "
                                     "expert cache: experts in host RAM, the hot ones on the GPU.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:  # a command whose optional dependencies are missing stays out; the others still run
            command = importlib.import_module(f"service.commands.{name}")
        except ImportError as exc:
            sub.add_parser(name, help=f"unavailable: {exc}").set_defaults(run=_unavailable(name, exc))
            continue
        apply_env_defaults(command.register(sub))
    return parser


def _unavailable(name: str, exc: ImportError):  # noqa: ANN202
    def run(args: argparse.Namespace) -> int:
        print(f"moecache: `{name}` needs a package that is not installed: {exc}", file=sys.stderr)
        return 2
    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
