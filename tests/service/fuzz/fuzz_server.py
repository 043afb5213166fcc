"""The server of the fuzz test and its seed corpus: `moecache serve` as a real process (HTTP, gRPC, an API
key, a job store), the ids of a job, files and a batch made on it, and the corpus' cases."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from fuzz_http import Expect, HttpCase
from job_servers import ServeProcess
from mutations import serialize

CORPUS = Path(__file__).resolve().parent / "corpus"

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
