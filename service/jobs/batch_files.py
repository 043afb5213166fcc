"""The OpenAI Batch file formats: input lines (`custom_id`, `method`, `url`, `body`) become jobs, one
bad line becomes one error (with its line number) instead of failing the batch; finished jobs become
output lines (`id`, `custom_id`, `response: {status_code, request_id, body}`, `error`) and error lines."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.types import RequestError
from service.jobs.records import Job, JobKind, NewJob
from service.openai.body import decode_object
from service.openai.errors import ApiError, from_exception
from service.openai.kinds import ENDPOINT_KINDS

JsonObject = dict[str, Any]
MAX_CUSTOM_ID_CHARS = 512
Validate = Callable[[JobKind, JsonObject], None]  # raises ApiError/RequestError as the endpoint would


class LineError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass(frozen=True)
class ParsedInput:
    jobs: tuple[NewJob, ...]
    errors: tuple[JsonObject, ...]  # OpenAI BatchError objects: code, message, param, line

    @property
    def num_requests(self) -> int:
        return len(self.jobs) + len(self.errors)


def parse_input(data: bytes, endpoint: str, batch_id: str, validate: Validate) -> ParsedInput:
    jobs: list[NewJob] = []
    errors: list[JsonObject] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            jobs.append(parse_line(raw, endpoint, batch_id, seen, validate))
        except LineError as error:
            errors.append({"code": error.code, "message": error.message, "param": error.param, "line": number})
    return ParsedInput(tuple(jobs), tuple(errors))


def parse_line(raw: bytes, endpoint: str, batch_id: str, seen: set[str], validate: Validate) -> NewJob:
    line = _json_object(raw)
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS or "\x00" in custom_id:
        raise LineError("invalid_custom_id", f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters "
                        "without NUL", "custom_id")
    if custom_id in seen:
        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appears more than once", "custom_id")
    seen.add(custom_id)
    if line.get("method") != "POST":
        raise LineError("invalid_method", "method must be POST", "method")
    if line.get("url") != endpoint:
        raise LineError("mismatched_endpoint", f"url must be the batch's endpoint {endpoint}", "url")
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "body must be a JSON object", "body")
    kind = ENDPOINT_KINDS[endpoint]
    try:
        validate(kind, body)
    except (ApiError, RequestError) as error:
        refused = from_exception(error)
        raise LineError("invalid_request", refused.message, refused.param) from None
    return NewJob(kind, body, batch_id, custom_id)


def _json_object(raw: bytes) -> JsonObject:
    try:
        return decode_object(raw)
    except ApiError as error:
        raise LineError("invalid_json", error.message.replace("the body", "the line")) from None


def custom_id_at(data: bytes, number: int) -> str | None:
    """The custom_id of input line `number` (1-based), when the line has a readable one."""
    lines = data.splitlines()
    try:
        custom_id = decode_object(lines[number - 1]).get("custom_id")
    except (ApiError, IndexError):
        return None
    return custom_id if isinstance(custom_id, str) else None


def output_line(job: Job) -> JsonObject:
    response = {"status_code": 200, "request_id": job.id, "body": job.result}
    return {"id": _line_id(job), "custom_id": job.custom_id, "response": response, "error": None}


def error_line(job: Job, batch_status: str) -> JsonObject:
    if job.status == "failed":
        code, message = "request_failed", job.error or "the request failed"
    elif batch_status == "expired":
        code, message = "batch_expired", "the batch expired before the request finished"
    else:
        code, message = "batch_cancelled", "the batch was cancelled before the request finished"
    return {"id": _line_id(job), "custom_id": job.custom_id, "response": None,
            "error": {"code": code, "message": message}}


def input_error_line(error: JsonObject, data: bytes) -> JsonObject:
    line = int(error["line"])
    return {"id": f"batch_req_line_{line}", "custom_id": custom_id_at(data, line), "response": None,
            "error": {"code": error["code"], "message": f"line {line}: {error['message']}"}}


def _line_id(job: Job) -> str:
    return f"batch_req_{job.id.removeprefix('job_')}"


def jsonl(lines: Sequence[JsonObject]) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
