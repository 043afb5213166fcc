"""`moecache generate`: stream a completion to the terminal, then prompt and decode speed."""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from dataclasses import replace

from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from service.engine_setup import load_engine
from service.options import add_engine_options, engine_config
from service.progress import ProgressBar


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text from a prompt in the terminal")
    add_engine_options(p)
    p.add_argument("-p", "--prompt", default="Once upon a time", help="the prompt (or the user message)")
    p.add_argument("-n", "--max-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--temperature", "--temp", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(run=run)
    return p


def prompt_ids(engine: LLMEngine, args: argparse.Namespace) -> list[int]:
    tok = engine.tokenizer
    if not args.chat:
        return tok.encode(args.prompt)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    return tok.encode(tok.apply_chat_template(messages), add_special=False, parse_special=True)


def run(args: argparse.Namespace) -> int:
    config = engine_config(args)  # one prompt: one KV slot
    config = replace(config, scheduler=replace(config.scheduler, max_num_seqs=1))
    engine = load_engine(config, ProgressBar(), args.routing)
    print(engine.cache.describe(), file=sys.stderr, flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    ids = prompt_ids(engine, args)
    engine.add_request(Request(uuid.uuid4().hex, tuple(ids), params))
    start, first, generated = time.perf_counter(), None, 0
    while engine.has_unfinished():
        for out in engine.step():
            first = first or time.perf_counter()
            generated += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    prefill = (first or end) - start
    decode = end - (first or end)
    print(f"prompt: {len(ids)} tokens, {len(ids) / prefill:.1f} tokens/s | decode: {generated} tokens, "
          f"{max(generated - 1, 0) / decode if decode > 0 else 0:.1f} tokens/s", file=sys.stderr)
    engine.close()
    return 0
