"""What the HTTP and gRPC job APIs share: a job's request body, checked exactly as the generation
endpoint of its kind checks it, paging and resuming arguments, and the JSON form of a job."""

from __future__ import annotations

import re
from typing import Any

from service.jobs.records import JOB_STATUSES, Job, JobKind
from service.openai.body import INT64_MAX
from service.openai.errors import ApiError, bad_request
from service.openai.requests import Generation, ServedModel, read_generation

MAX_PAGE = 100
DEFAULT_PAGE = 20
MAX_SEQ = INT64_MAX  # chunk numbers are 64-bit signed integers in the store
# Every id the store makes (job_<hex>, file-<hex>, batch_<hex>) matches; what does not names nothing, and
# is never sent to the database (PostgreSQL text cannot even hold a NUL).
ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_job(kind: JobKind, body: dict[str, Any], model: ServedModel) -> Generation:
    """The job's generation; ApiError (400/404) names what is wrong, as the HTTP endpoints do."""
    return _runnable_as_job(read_generation(kind, body, model))


def parse_job(kind: JobKind, body: dict[str, Any], model: ServedModel) -> Generation:
    """Parse a stored request (no model check: any replica serving the job's model may run it)."""
    return _runnable_as_job(read_generation(kind, body, model, any_model=True))


def _runnable_as_job(generation: Generation) -> Generation:
    if generation.stream:
        raise bad_request("jobs do not stream; read GET /v1/jobs/{id}/events instead", "stream")
    if generation.num_choices != 1:
        raise bad_request("a job generates one choice: one prompt and n = 1", "n")
    if generation.params.logprobs is not None or generation.params.prompt_logprobs is not None:
        raise bad_request("jobs do not keep logprobs", "logprobs")
    if generation.echo:
        raise bad_request("jobs do not echo the prompt", "echo")
    return generation


def is_id(text: str) -> bool:
    return ID.fullmatch(text) is not None


def check_cursor(after: str | None, name: str = "after") -> str | None:
    """A page's `after`: the id of the last item of the previous page."""
    if after is not None and not is_id(after):
        raise bad_request(f"{name} must be the id of the last item of a page (got {after[:40]!r})", name)
    return after


def not_found(job_id: str) -> ApiError:
    return ApiError(404, f"no job {job_id[:100]!r}", "id", "not_found")


def check_page(limit: int, after: str | None, status: str | None) -> None:
    check_cursor(after)
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit must be in [1, {MAX_PAGE}] (got {limit})", "limit")
    if status is not None and status not in JOB_STATUSES:
        raise bad_request(f"status must be one of {', '.join(JOB_STATUSES)} (got {status[:40]!r})", "status")


def check_after(after_seq: int, name: str) -> int:
    if not 0 <= after_seq <= MAX_SEQ:
        raise bad_request(f"{name} must be a chunk number from 0 to {MAX_SEQ} (got {after_seq})", name)
    return after_seq


def job_object(job: Job) -> dict[str, Any]:
    return {
        "id": job.id, "object": "job", "kind": job.kind, "status": job.status, "created_at": job.created_at,
        "started_at": job.started_at, "finished_at": job.finished_at, "progress_tokens": job.progress_tokens,
        "text": job.text, "result": job.result, "error": job.error, "attempts": job.attempts,
        "cancel_requested": job.cancel_requested, "batch_id": job.batch_id, "custom_id": job.custom_id,
    }
