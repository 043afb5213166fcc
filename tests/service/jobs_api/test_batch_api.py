"""The OpenAI Batch API end to end with the official `openai` client, on SQLite and on PostgreSQL:
upload, create, poll, download the output and error files; bad lines are reported per line; cancel."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from job_servers import ServerThread, greedy, poll
from openai import AsyncOpenAI, NotFoundError
from openai.types import Batch

CHAT = "/v1/chat/completions"


@pytest.fixture
async def client(server: ServerThread) -> AsyncIterator[AsyncOpenAI]:
    oai = AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60)
    yield oai
    await oai.close()


def line(custom_id: str, max_tokens: int, url: str = CHAT, **body: Any) -> bytes:
    request = greedy(max_tokens, messages=[{"role": "user", "content": f"Say {custom_id}"}], **body)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": request}).encode()


async def run_until(client: AsyncOpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 60) -> Batch:
    async def finished() -> Batch | None:
        batch = await client.batches.retrieve(batch_id)
        return batch if batch.status in statuses else None

    result: Batch = await poll(finished, timeout, every=0.1)
    return result


async def jsonl(client: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    content = await client.files.content(file_id)
    return [json.loads(raw) for raw in content.text.splitlines()]


async def test_a_batch_runs_end_to_end_and_bad_lines_go_to_the_error_file(client: AsyncOpenAI) -> None:
    lines = [line("a", 4), b"{not json", line("b", 3), line("c", 4, url="/v1/completions"),
             line("d", 2, top_p=0), line("e", 5)]
    uploaded = await client.files.create(file=("requests.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(b"\n".join(lines)) + 1
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                        metadata={"run": "e2e"})
    assert batch.status in ("in_progress", "completed") and batch.metadata == {"run": "e2e"}
    done = await run_until(client, batch.id, ("completed", "failed"))
    assert done.status == "completed" and done.completed_at is not None
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (6, 3, 3)
    assert done.errors is not None and [e.line for e in done.errors.data or []] == [2, 4, 5]
    output = {o["custom_id"]: o for o in await jsonl(client, done.output_file_id)}
    assert sorted(output) == ["a", "b", "e"]
    for custom_id, tokens in (("a", 4), ("b", 3), ("e", 5)):
        response = output[custom_id]["response"]
        assert output[custom_id]["error"] is None and response["status_code"] == 200
        assert response["request_id"].startswith("job_") and output[custom_id]["id"].startswith("batch_req_")
        assert response["body"]["object"] == "chat.completion"
        assert response["body"]["usage"]["completion_tokens"] == tokens
    errors = await jsonl(client, done.error_file_id)
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [
        (None, None, "invalid_json"), ("c", None, "mismatched_endpoint"), ("d", None, "invalid_request")]
    assert errors[2]["error"]["message"].startswith("line 5: ") and "top_p" in errors[2]["error"]["message"]
    listed = await client.batches.list(limit=100)
    assert done.id in [b.id for b in listed.data]


async def test_cancelling_a_batch_stops_its_jobs(client: AsyncOpenAI, server: ServerThread) -> None:
    data = b"\n".join(line(f"long{i}", 200) for i in range(3))
    uploaded = await client.files.create(file=("long.jsonl", data), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    await poll(lambda: _value(server.engine.num_running > 0), timeout=10)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await run_until(client, batch.id, ("cancelled",), timeout=20)
    counts = done.request_counts
    assert counts is not None and counts.total == 3 and counts.completed + counts.failed == 3
    errors = await jsonl(client, done.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(errors) == counts.failed


async def _value(value: bool) -> bool:
    return value


async def test_files_and_batches_that_do_not_exist(client: AsyncOpenAI) -> None:
    with pytest.raises(NotFoundError):
        await client.files.retrieve("file-missing")
    with pytest.raises(NotFoundError):
        await client.batches.retrieve("batch_missing")
    with pytest.raises(NotFoundError):
        await client.batches.create(input_file_id="file-missing", endpoint=CHAT, completion_window="24h")


async def test_an_empty_input_file_fails_the_batch(client: AsyncOpenAI) -> None:
    uploaded = await client.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None
    assert [e.code for e in batch.errors.data or []] == ["empty_file"]
