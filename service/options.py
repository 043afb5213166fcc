"""Command-line options shared by the commands that run an engine, and the one place the config tree
is built from them. Every option can also come from a `MOECACHE_<OPTION>` environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from typing import Any

from engine.config import MISS_MODES, POLICIES, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def add_engine_options(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("-m", "--model", help="GGUF file (first file of a split model); default: the embedded model")
    m.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda when available)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    m.add_argument("-c", "--ctx-size", type=int, default=4096, help="context length per sequence")
    c = p.add_argument_group("expert placement and cache")
    c.add_argument("--cpu-moe", action="store_true", help="keep every routed expert in host RAM")
    c.add_argument("--n-cpu-moe", type=int, default=0, metavar="N", help="routed experts of the first N MoE "
                   "layers in host RAM")
    c.add_argument("--moe-cache-mib", type=int, default=None, metavar="MIB", help="GPU expert cache budget "
                   "(default: the free device memory after weights, KV cache and headroom)")
    c.add_argument("--cache-policy", default="lru", choices=POLICIES)
    c.add_argument("--miss-mode", default="cpu", choices=MISS_MODES,
                   help="where cache misses are computed: cpu, stream (device reads host memory) or hybrid")
    c.add_argument("--cache-promote-per-step", type=int, default=8, metavar="N",
                   help="uploads a step where misses do not land (cpu miss mode; decay and lfru)")
    c.add_argument("--cache-free-slots", type=int, default=0, metavar="N",
                   help="free slots each ring of the cache offers to landing misses (0: twice its recent misses)")
    c.add_argument("--cache-headroom-mib", type=int, default=1024, metavar="MIB")
    c.add_argument("--cache-profile", default=None, metavar="FILE", help="warm-start the cache from a profile")
    c.add_argument("--cache-profile-out", default=None, metavar="FILE", help="save a profile of expert use")
    c.add_argument("--record-trace", default=None, metavar="FILE", help="record the routing of every step")
    c.add_argument("--cpu-threads", type=int, default=None, metavar="N")
    s = p.add_argument_group("batching")
    s.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together")
    s.add_argument("--max-batch-tokens", type=int, default=512, help="tokens in one forward pass")
    s.add_argument("--routing", default="model", help=argparse.SUPPRESS)


def env_name(dest: str) -> str:
    return f"MOECACHE_{dest.upper()}"


def apply_env_defaults(p: argparse.ArgumentParser) -> None:
    """`MOECACHE_<DEST>` sets the default of option `--<dest>`; an empty value keeps the built-in default.

    The value is converted and checked against the choices only when this command's arguments are
    parsed, so a bad one is a usage error of that command naming the variable, not a crash of every
    command."""
    for action in p._actions:
        name = env_name(action.dest)
        value = os.environ.get(name, "")
        if not value or action.dest == "help":
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.lower() in ("1", "true", "yes", "on")
        else:
            # NOTE: argparse passes a string default through `type` at parse time.
            action.type = _checked(action.type if callable(action.type) else None, action.choices, name)
            action.default = value


def _checked(convert: Callable[[str], Any] | None, choices: Iterable[Any] | None,
             name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = convert(text) if convert else text
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} (from the flag or {name})") from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} (from the flag or {name}) is not one of "
                                             f"{', '.join(map(str, choices))}")
        return value

    return parse


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(args.model, args.device, args.dtype, args.ctx_size),
        cache=CacheConfig(policy=args.cache_policy, miss_mode=args.miss_mode, budget_mib=args.moe_cache_mib,
                          cpu_moe=args.cpu_moe, n_cpu_moe=args.n_cpu_moe,
                          promote_per_step=args.cache_promote_per_step, headroom_mib=args.cache_headroom_mib,
                          free_slots=args.cache_free_slots,
                          cpu_threads=args.cpu_threads, profile_in=args.cache_profile,
                          profile_out=args.cache_profile_out, record_trace=args.record_trace),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batch_tokens,
                                  max_model_len=args.ctx_size),
        routing=args.routing,
    )
