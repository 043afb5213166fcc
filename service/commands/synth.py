"""`moecache synth`: write a random-weight GGUF model at a named size preset."""

from __future__ import annotations

import argparse
from dataclasses import replace

from ops.quants import QType
from service.progress import ProgressBar
from tools.embedded_vocab import build_vocab
from tools.synth import PRESETS, with_overrides, write_synth


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("synth", help="write a random-weight GGUF model for tests and benchmarks",
                       description="Presets: " + "; ".join(f"{n}: {p.description}" for n, p in PRESETS.items()))
    p.add_argument("output", help="path of the .gguf file to write")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--experts", type=int, default=None, help="override the number of experts")
    p.add_argument("--top-k", type=int, default=None, help="override the experts used per token")
    p.add_argument("--expert-type", default=None, choices=["Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"],
                   help="quant type of the routed experts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split-mib", type=int, default=0, help="split into files of at most this size")
    p.add_argument("--device", default="cpu", help="draw the random blocks here (cuda: much faster)")
    p.add_argument("--sparse", action="store_true", help="shapes only: tensor data left as a hole of zeros "
                   "(enough for `moecache plan`, not for generation)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    preset = with_overrides(PRESETS[args.preset], num_layers=args.layers, num_experts=args.experts,
                            top_k=args.top_k)
    if args.expert_type:
        preset = replace(preset, expert_type=QType.__members__[args.expert_type])
    bar = ProgressBar()
    paths = write_synth(args.output, preset, build_vocab(preset.vocab), seed=args.seed,
                        split_max_bytes=args.split_mib << 20, progress=lambda d, t: bar("writing", d, t),
                        sparse=args.sparse, device=args.device)
    for path in paths:
        print(path)
    return 0
