"""`moecache perplexity`: perplexity over a text, and KL divergence against a base run, as llama.cpp's
`llama-perplexity` computes them, so a user can check that two runs of their own model (an expert cache
against none, `cpu` against `stream` misses, moecache against llama.cpp) give the same outputs.

The text is tokenized (BOS as the vocabulary says) and cut into chunks of `-c` tokens; each chunk is
scored on its own, a BOS in its first place where the vocabulary adds one, and the tokens of its second
half count (each position predicts the next token). `--kl-divergence-base FILE` saves the run's
log-probabilities in llama.cpp's file format; with `--kl-divergence` the run is compared with FILE
(written by moecache or by llama.cpp) on the chunks FILE holds; `--sweep` compares every miss mode and
cache policy (experts in host RAM behind `--moe-cache-mib`) with the model loaded once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from engine.config import MISS_MODES, EngineConfig
from engine.llm_engine import LLMEngine
from service.commands.kld import Divergence, Perplexity, report
from service.commands.logits_file import BaseFile, encode_rows, open_base, write_header
from service.engine_setup import load_engine
from service.options import add_engine_options, engine_config
from service.progress import ProgressBar

DEFAULT_CTX = 512  # llama-perplexity's default
SWEEP_POLICIES = ("lru", "decay", "lfru")  # "static" needs a profile


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("perplexity", help="perplexity of a text, or KL divergence against a base run",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(p)
    p.set_defaults(ctx_size=DEFAULT_CTX, max_num_seqs=1)  # one sequence at a time: one KV slot
    p.add_argument("-f", "--file", help="the text (not needed with --kl-divergence: FILE holds the tokens)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    p.add_argument("--kl-divergence-base", metavar="FILE", default=None,
                   help="save this run's log-probabilities to FILE (llama.cpp's format), or with "
                        "--kl-divergence read the base run from FILE")
    p.add_argument("--kl-divergence", action="store_true", help="compare this run with --kl-divergence-base")
    p.add_argument("--sweep", action="store_true", help="with --kl-divergence: compare every miss mode and cache "
                   "policy, experts in host RAM behind --moe-cache-mib, the model loaded once")
    p.add_argument("--json", action="store_true", help="print the final figures as one JSON object")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.kl_divergence:
        if not args.kl_divergence_base:
            raise ValueError("--kl-divergence needs --kl-divergence-base FILE (the base run)")
        return compare(args)
    if not args.file:
        raise ValueError("give the text with -f FILE")
    return score_text(args)


def make_engine(args: argparse.Namespace, num_ctx: int) -> LLMEngine:
    config: EngineConfig = engine_config(args)
    model = replace(config.model, max_context=max(config.model.max_context, num_ctx))
    config = replace(config, model=model)
    engine = load_engine(config, ProgressBar(sys.stderr), args.routing)
    print(engine.cache.describe(), file=sys.stderr, flush=True)
    if engine.tokenizer.spec.add_eos:
        raise ValueError("the vocabulary adds EOS to every text: chunks cannot be scored as llama.cpp does")
    return engine


def chunk_ids(engine: LLMEngine, tokens: np.ndarray) -> list[int]:
    """A chunk as scored: BOS in the first place where the vocabulary adds one (llama.cpp does too)."""
    ids = tokens.tolist()
    if engine.tokenizer.spec.add_bos and engine.tokenizer.bos_id is not None:
        ids[0] = engine.tokenizer.bos_id
    return ids


def text_chunks(engine: LLMEngine, path: str, num_ctx: int, max_chunks: int | None) -> np.ndarray:
    tokens = engine.tokenizer.encode(Path(path).read_text(encoding="utf-8"))
    if len(tokens) < 2 * num_ctx:
        raise ValueError(f"{path} tokenizes to {len(tokens)} tokens; a context of {num_ctx} needs at least "
                         f"{2 * num_ctx} (use a smaller -c)")
    num_chunks = len(tokens) // num_ctx if max_chunks is None else min(max_chunks, len(tokens) // num_ctx)
    return np.asarray(tokens[:num_chunks * num_ctx], dtype=np.int32).reshape(num_chunks, num_ctx)


def score_text(args: argparse.Namespace) -> int:
    num_ctx = args.ctx_size
    engine = make_engine(args, num_ctx)
    chunks = text_chunks(engine, args.file, num_ctx, args.chunks)
    first, ppl = num_ctx // 2, Perplexity()
    base = open(args.kl_divergence_base, "wb") if args.kl_divergence_base else None  # noqa: SIM115
    try:
        if base is not None:
            write_header(base, num_ctx, engine.weights.hparams.vocab_size, chunks)
        for i, tokens in enumerate(chunks):
            logprobs = engine.score(chunk_ids(engine, tokens), first).numpy()
            ppl.add(logprobs, tokens[first + 1:])
            if base is not None:
                base.write(encode_rows(logprobs).tobytes())
            print(f"[{i + 1}]{ppl.value:.4f},", end="", flush=True)
    finally:
        if base is not None:
            base.close()
        engine.close()
    print()
    if args.json:
        print(json.dumps({"tokens": len(ppl.nll), "ppl": ppl.value, "ppl_unc": ppl.uncertainty}))
    else:
        print(f"Final estimate: PPL = {ppl.value:.4f} +/- {ppl.uncertainty:.5f}")
    return 0


def compare(args: argparse.Namespace) -> int:
    base = open_base(args.kl_divergence_base)
    engine = make_engine(args, base.num_ctx)
    if base.num_vocab != engine.weights.hparams.vocab_size:
        raise ValueError(f"{args.kl_divergence_base} has a vocabulary of {base.num_vocab} tokens, the model "
                         f"{engine.weights.hparams.vocab_size}")
    num_chunks = base.num_chunks if args.chunks is None else min(args.chunks, base.num_chunks)
    try:
        if args.sweep:
            sweep(engine, base, num_chunks, args.json)
            return 0
        summary = divergence(engine, base, num_chunks, progress=True)
    finally:
        engine.close()
    print(json.dumps(summary) if args.json else "\n" + report(summary))
    return 0


def divergence(engine: LLMEngine, base: BaseFile, num_chunks: int, progress: bool = False) -> dict[str, float]:
    first, stats = base.num_ctx // 2, Divergence()
    if progress:
        print("chunk   PPL(Q)      ln(PPL(Q)/PPL(base))   KL divergence   same top p")
    for i in range(num_chunks):
        tokens = base.tokens[i]
        stats.add(engine.score(chunk_ids(engine, tokens), first).numpy(), base.chunk(i), tokens[first + 1:])
        if progress:
            s = stats.summary()
            print(f"{i + 1:5d}   {s['ppl']:9.4f}   {s['ln_ppl_ratio']:10.5f}             {s['mean_kld']:10.6f}"
                  f"      {100 * s['same_top']:6.2f} %", flush=True)
    return stats.summary()


def sweep(engine: LLMEngine, base: BaseFile, num_chunks: int, as_json: bool) -> None:
    if not as_json:
        print("miss mode  policy   mean KLD     max KLD      max |Δ log p|  same top p   hit ratio")
    for mode, policy in itertools.product(MISS_MODES, SWEEP_POLICIES):
        engine.reconfigure_cache(replace(engine.config.cache, cpu_moe=True, miss_mode=mode, policy=policy))
        s = {**divergence(engine, base, num_chunks), "hit_ratio": engine.cache.snapshot().hit_ratio()}
        if as_json:
            print(json.dumps({"miss_mode": mode, "policy": policy, **s}), flush=True)
        else:
            print(f"{mode:9s}  {policy:6s}   {s['mean_kld']:.3e}    {s['max_kld']:.3e}    "
                  f"{s['max_abs_dlogprob']:.3e}      {100 * s['same_top']:6.2f} %     {100 * s['hit_ratio']:5.1f} %",
                  flush=True)
