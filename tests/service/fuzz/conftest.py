"""Fixtures of the fuzz test: `moecache serve` as a real process (HTTP, gRPC, an API key, a job store on
SQLite and then on the session's real PostgreSQL) over a tiny GGUF, the ids of a job, files and a batch
made on it, and the seed corpus."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine.gguf.embedded_vocab import build_embedded_vocab
from engine.synth import PRESETS, write_synth

FUZZ = Path(__file__).resolve().parent
CORPUS = FUZZ / "corpus"
sys.path.insert(0, str(FUZZ))
sys.path.insert(0, str(FUZZ.parent))
from fuzz_http import Expect, HttpCase  # noqa: E402
from job_servers import ServeProcess  # noqa: E402
from mutations import serialize  # noqa: E402
from pg_server import PostgresServer, postgres_server  # noqa: E402, F401  (fixture)

API_KEY = "fuzz-s3cret-key"
SERVER_ARGS = ("--api-key", API_KEY, "--max-tokens-limit", "32", "--job-concurrency", "2", "--max-queued-jobs", "64",
               "--job-lease", "5")
BACKENDS = {"sqlite": 1.0, "postgresql": 0.35}  # job store -> its share of the mutations' budget


@dataclass(frozen=True)
class FuzzServer:
    process: ServeProcess
    ids: dict[str, str]  # job_id, file_id, bad_file_id, batch_id
    share: float  # of the requests and time the mutations may take

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.process.port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.process.grpc_port}"


@pytest.fixture(scope="session")
def fuzz_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fuzz-model") / "tiny.gguf"
    write_synth(path, PRESETS["tiny"], build_embedded_vocab(), seed=7)
    return path


@pytest.fixture(scope="module", params=list(BACKENDS))
def fuzz_server(request: pytest.FixtureRequest, fuzz_gguf: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzServer]:
    pg: PostgresServer | None = request.getfixturevalue("postgres_server") if request.param == "postgresql" else None
    store = pg.create_schema() if pg else f"sqlite:///{tmp_path_factory.mktemp('fuzz-jobs') / 'jobs.db'}"
    process = ServeProcess(fuzz_gguf, store, *SERVER_ARGS).wait_ready(120)
    try:
        ids = asyncio.run(make_ids(f"http://127.0.0.1:{process.port}"))
        yield FuzzServer(process, ids, BACKENDS[request.param])
    finally:
        process.proc.send_signal(signal.SIGTERM)
        process.proc.wait(60)
        if pg:
            pg.drop_schema(store)


async def make_ids(base_url: str) -> dict[str, str]:
    """A job, a valid and a bad batch input file, and a batch, for the corpus' `{job_id}` and the others."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(base_url, headers=headers) as http:
        async with http.post("/v1/jobs", json={"prompt": "Once upon", "max_tokens": 4}) as r:
            ids = {"job_id": (await r.json())["id"]}
        for key, name in (("file_id", "valid.jsonl"), ("bad_file_id", "bad_lines.jsonl")):
            form = aiohttp.FormData({"purpose": "batch"})
            form.add_field("file", (CORPUS / name).read_bytes(), filename=name)
            async with http.post("/v1/files", data=form) as r:
                ids[key] = (await r.json())["id"]
        body = {"input_file_id": ids["file_id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        async with http.post("/v1/batches", json=body) as r:
            ids["batch_id"] = (await r.json())["id"]
    return ids


def fill(value: Any, ids: dict[str, str]) -> Any:
    """The corpus' `{key}`, `{job_id}`, ... replaced in every string of a JSON value."""
    if isinstance(value, str):
        for name, given in {"key": API_KEY, **ids}.items():
            value = value.replace("{" + name + "}", given)
        return value
    if isinstance(value, list):
        return [fill(v, ids) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, ids) for k, v in value.items()}
    return value


def corpus_lines(name: str, ids: dict[str, str]) -> list[dict[str, Any]]:
    lines = [json.loads(raw) for raw in (CORPUS / name).read_text().splitlines() if raw.strip()]
    return [{**line, **{k: fill(v, ids) for k, v in line.items() if k in ("path", "headers", "json", "text", "raw",
                                                                           "message")}} for line in lines]


def http_case(line: dict[str, Any]) -> HttpCase:
    headers = {"Authorization": f"Bearer {API_KEY}", **line.get("headers", {})}
    body = None
    if "json" in line:
        body = serialize(line["json"])
        headers.setdefault("Content-Type", "application/json")
    elif "text" in line:
        body = line["text"].encode()
    expect = line.get("expect")
    return HttpCase(line["method"], line["path"], tuple(headers.items()), body, name=line["name"],
                    expect=Expect(tuple(expect.get("status", ())), expect.get("json", {})) if expect else None,
                    data=line.get("json"), leave_after=line.get("leave_after"), hold=line.get("hold", 0))
