"""HTTP requests of the fuzz test, sent to a real server, and the oracle that judges each answer: no 5xx,
an error is OpenAI's JSON error object (naming no exception class), an event stream ends properly
(`[DONE]`, `event: done` or `event: error`) with well-formed events and never holds a second response."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

STREAM_READ_S = 15.0  # a job's event stream may wait for the job; past this the client leaves
RAW_READ_S = 5.0
EXCEPTION_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception|Warning)\b|Traceback|<class ")
SSE_FIELDS = ("data:", "event:", "id:", "retry:", ":")


@dataclass(frozen=True)
class Expect:
    """What a corpus case must get besides passing the oracle."""

    status: tuple[int, ...] = ()
    json: dict[str, Any] = field(default_factory=dict)  # dotted path in the JSON body -> value


@dataclass(frozen=True)
class HttpCase:
    method: str
    path: str  # with its query, percent-encoded as sent
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None
    name: str = ""
    expect: Expect | None = None
    data: Any = None  # the JSON value the body was serialized from (what mutations change)
    leave_after: int | None = None  # read this many events of a stream, then go away
    hold: int = 0  # open this many of the stream at once (a cap on listeners)


@dataclass
class Outcome:
    case: HttpCase
    status: int = 0
    content_type: str = ""
    body: bytes = b""
    problems: list[str] = field(default_factory=list)
    has_left: bool = False  # the client went away before the end (by design)

    def describe(self) -> str:
        c = self.case
        return (f"{c.name or ''} {c.method} {c.path[:200]} headers={list(c.headers)[:6]} body={(c.body or b'')[:300]!r}"
                f" -> {self.status} {self.content_type} {self.body[:300]!r}: {'; '.join(self.problems)}")


async def send(session: aiohttp.ClientSession, base_url: str, case: HttpCase) -> Outcome:
    if case.hold:
        return await _send_held(session, base_url, case)
    outcome = Outcome(case)
    url = URL(base_url + case.path, encoded=True)
    try:
        async with session.request(case.method, url, data=case.body, headers=dict(case.headers),
                                   skip_auto_headers=("Content-Type",)) as response:
            outcome.status, outcome.content_type = response.status, response.content_type
            if response.content_type == "text/event-stream":
                await _read_stream(response, case, outcome)
            else:
                outcome.body = await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as error:
        outcome.problems.append(f"the connection broke: {type(error).__name__}: {error}")
        return outcome
    outcome.problems += judge(outcome)
    return outcome


async def _read_stream(response: aiohttp.ClientResponse, case: HttpCase, outcome: Outcome) -> None:
    deadline, body, events = time.monotonic() + STREAM_READ_S, bytearray(), 0
    while not response.content.at_eof():
        if case.leave_after is not None and events >= case.leave_after or time.monotonic() > deadline:
            outcome.has_left = True
            response.close()
            break
        try:
            chunk = await asyncio.wait_for(response.content.readany(), max(0.01, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            continue
        body += chunk
        events = body.count(b"\n\n")
    outcome.body = bytes(body)


async def _send_held(session: aiohttp.ClientSession, base_url: str, case: HttpCase) -> Outcome:
    """`hold` streams open at once: each is a 200 stream or a JSON error, and the cap answered 429."""
    responses = [await session.get(URL(base_url + case.path, encoded=True), headers=dict(case.headers))
                 for _ in range(case.hold)]
    try:
        statuses = [r.status for r in responses]
        outcome = Outcome(case, status=max(statuses), content_type=responses[-1].content_type,
                          body=await responses[-1].read() if responses[-1].status != 200 else b"", has_left=True)
    finally:
        for response in responses:
            response.close()
    outcome.problems += judge(outcome)
    return outcome


def judge(outcome: Outcome) -> list[str]:
    """What is wrong with an answer, whatever the request was."""
    if outcome.status >= 500:
        return [f"status {outcome.status}"]
    if outcome.status >= 400:
        return _judge_error(outcome)
    if outcome.content_type == "text/event-stream":
        return _judge_stream(outcome)
    if outcome.content_type == "application/json":
        return _judge_json(outcome.body)
    return []


def _judge_error(outcome: Outcome) -> list[str]:
    if outcome.content_type != "application/json":
        return [f"an error body of type {outcome.content_type!r}"]
    try:
        error = json.loads(outcome.body)["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return ["an error body that is not OpenAI's error object"]
    if EXCEPTION_NAME.search(error["message"]):
        return [f"an error message naming an exception: {error['message'][:200]!r}"]
    return []


def _judge_json(body: bytes) -> list[str]:
    try:
        json.loads(body)
    except ValueError:
        return ["a JSON response that does not parse"]
    return []


def _judge_stream(outcome: Outcome) -> list[str]:
    text = outcome.body.decode("utf-8", "replace")
    if "HTTP/1." in text:
        return ["a second HTTP response inside the event stream"]
    blocks = [b for b in text.replace("\r\n", "\n").split("\n\n") if b.strip()]
    problems = [p for block in blocks for p in _judge_event(block)]
    if not outcome.has_left and not text.endswith("\n\n"):
        problems.append("an event stream cut inside an event")
    elif not outcome.has_left and blocks and not _is_last_event(blocks[-1], outcome.case.path):
        problems.append(f"an event stream that ends without its last event: {blocks[-1][:200]!r}")
    return problems


def _judge_event(block: str) -> list[str]:
    for line in block.split("\n"):
        if not line.startswith(SSE_FIELDS):
            return [f"a malformed event line {line[:100]!r}"]
        if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
            try:
                json.loads(data)
            except ValueError:
                return [f"event data that is not JSON: {data[:100]!r}"]
    if block.startswith("event: error"):
        return _judge_error_event(block)
    return []


def _judge_error_event(block: str) -> list[str]:
    """An error event carries OpenAI's error object, and no server error (a 5xx sent in band)."""
    data = block.split("data:", 1)[-1].strip()
    try:
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return ["an error event without OpenAI's error object"]
    if error["type"] == "server_error":
        return [f"a server error inside an event stream: {error['message'][:200]!r}"]
    return []


def _is_last_event(block: str, path: str) -> bool:
    if block.startswith("event: error"):
        return True
    if "/events" in path.split("?")[0]:
        return block.startswith("event: done") or path.startswith("/v1/cache/")
    return block == "data: [DONE]"


def check_expect(outcome: Outcome) -> list[str]:
    expect = outcome.case.expect
    if expect is None:
        return []
    problems = []
    if expect.status and outcome.status not in expect.status:
        problems.append(f"status {outcome.status}, expected {expect.status}")
    for path, value in expect.json.items():
        found = _at(outcome.body, path)
        if found != value:
            problems.append(f"{path} is {found!r}, expected {value!r}")
    return problems


def _at(body: bytes, path: str) -> Any:
    try:
        value: Any = json.loads(body)
        for key in path.split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
    except (ValueError, KeyError, IndexError, TypeError):
        return "<missing>"
    return value


async def send_raw(host: str, port: int, data: bytes, name: str = "raw") -> Outcome:
    """Bytes as sent, read back as received (until the server closes, or RAW_READ_S): one answer, not a 5xx,
    and never a second status line inside the first response."""
    outcome = Outcome(HttpCase("RAW", "", body=data, name=name))
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        outcome.body = await _read_all(reader)
    finally:
        writer.close()
    statuses = re.findall(rb"^HTTP/1\.[01] (\d{3})", outcome.body, re.M)
    outcome.status = int(statuses[0]) if statuses else 0
    if not statuses or outcome.status >= 500:
        outcome.problems.append("no answer, or a 5xx")
    if len(statuses) > 1:
        outcome.problems.append("a second HTTP response inside the first")
    return outcome


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    answer, deadline = bytearray(), time.monotonic() + RAW_READ_S
    while time.monotonic() < deadline:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            break
        if not chunk:
            break
        answer += chunk
    return bytes(answer)
