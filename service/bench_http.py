"""HTTP overhead: time to first token, inter-token latency and aggregate decode speed through the HTTP
API (streaming, a real `moecache serve` process) against `LLMEngine.step` in process, on the same model.

    python -m service.bench_http [-m MODEL.gguf] [--clients 1,8,32] [--max-tokens 64]

Prints a Markdown table. ITL is per request: (last token time - first token time) / (tokens - 1), so
chunks that carry two tokens (held-back text) do not skew it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from service.engine_setup import load_engine

PAUSE_S = 1.0
PROMPT = "The history of the expert cache begins with a simple observation about routing:"


@dataclass(frozen=True)
class RequestTiming:
    start: float
    token_times: tuple[float, ...]  # when each token (or chunk of tokens) arrived
    num_tokens: int

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def itl(self) -> float:
        return (self.token_times[-1] - self.token_times[0]) / max(self.num_tokens - 1, 1)


@dataclass(frozen=True)
class Row:
    path: str
    clients: int
    ttft_ms: float  # median over requests
    itl_ms: float  # median over requests
    tokens_per_second: float  # all streams together

    def markdown(self) -> str:
        return (f"| {self.clients} | {self.path} | {self.ttft_ms:.1f} | {self.itl_ms:.1f} | "
                f"{self.tokens_per_second:.1f} |")


def summarize(path: str, timings: list[RequestTiming], wall: float) -> Row:
    return Row(path, len(timings), 1e3 * statistics.median(t.ttft for t in timings),
               1e3 * statistics.median(t.itl for t in timings), sum(t.num_tokens for t in timings) / wall)


# -- in process ----------------------------------------------------------------------------------------
def run_engine(engine: LLMEngine, clients: int, max_tokens: int) -> Row:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = tuple(engine.tokenizer.encode(PROMPT))
    start = time.perf_counter()
    times: dict[str, list[float]] = {f"r{i}": [] for i in range(clients)}
    for request_id in times:
        engine.add_request(Request(request_id, ids, params))
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request_id] += [now] * len(out.new_token_ids)
    wall = time.perf_counter() - start
    return summarize("in-process `LLMEngine.step`", [RequestTiming(start, tuple(t), len(t)) for t in times.values()],
                     wall)


# -- through HTTP --------------------------------------------------------------------------------------
async def stream_one(http: aiohttp.ClientSession, url: str, body: dict) -> RequestTiming:
    start = time.perf_counter()
    arrivals: list[float] = []
    num_tokens = 0
    async with http.post(url, json=body) as response:
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: "):])
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return RequestTiming(start, tuple(arrivals), num_tokens)


async def run_http(base_url: str, clients: int, max_tokens: int) -> Row:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        start = time.perf_counter()
        timings = await asyncio.gather(*(stream_one(http, f"{base_url}/v1/completions", body)
                                         for _ in range(clients)))
        wall = time.perf_counter() - start
    return summarize("HTTP streaming (aiohttp client)", list(timings), wall)


def http_row(base_url: str, clients: int, max_tokens: int) -> Row:
    return asyncio.run(run_http(base_url, clients, max_tokens))


class ServeProcess:
    """`moecache serve` on a free port, as its own process."""

    def __init__(self, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "service.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.port = 0
        self.ready = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if match := re.search(r"listening on http://[\d.]+:(\d+)", line):
                self.port = int(match.group(1))
            if "ready: model" in line:
                self.ready.set()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def engine_args(args: argparse.Namespace) -> list[str]:
    model = ["-m", args.model] if args.model else []
    return [*model, "--device", "cpu", "--ctx-size", str(args.ctx_size), "--max-num-seqs", str(max(args.clients))]


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=ModelConfig(args.model, device="cpu", max_context=args.ctx_size),
                        scheduler=SchedulerConfig(max_num_seqs=max(args.clients)))


def bench(args: argparse.Namespace) -> list[Row]:
    """Both paths, interleaved run by run so that both see the same load on the machine."""
    server = ServeProcess(engine_args(args))
    engine = load_engine(engine_config(args))
    try:
        if not server.ready.wait(300):
            raise RuntimeError("the server did not become ready")
        url = f"http://127.0.0.1:{server.port}"
        run_engine(engine, 1, 8), http_row(url, 1, 8)  # warm-up
        return [row for n in args.clients for row in best_rows(args.repeat, [
            functools.partial(run_engine, engine, n, args.max_tokens),
            functools.partial(http_row, url, n, args.max_tokens)])]
    finally:
        server.stop()
        engine.close()


def best_rows(repeat: int, runs: list[Callable[[], Row]]) -> list[Row]:
    """Per path, the run with the highest throughput: other load only ever slows a run down."""
    results = [[settled(run) for run in runs] for _ in range(repeat)]
    return [max(column, key=lambda row: row.tokens_per_second) for column in zip(*results)]


def settled(run: Callable[[], Row]) -> Row:
    # The other path's idle worker threads spin for a while after its run; on 2 cores they would
    # take CPU from this run.
    time.sleep(PAUSE_S)
    return run()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m service.bench_http", description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument("--clients", default="1,8,32", help="concurrent streams, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ctx-size", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3, help="runs per row; the fastest is reported")
    args = p.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = bench(args)
    print(f"max_tokens {args.max_tokens}, greedy, ignore_eos, one {len(PROMPT.split())}-word prompt, "
          f"best of {args.repeat} runs\n")
    print("| clients | path | TTFT p50 (ms) | ITL p50 (ms) | aggregate tokens/s |")
    print("|---:|---|---:|---:|---:|")
    for row in sorted(rows, key=lambda r: (r.clients, r.path)):
        print(row.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
