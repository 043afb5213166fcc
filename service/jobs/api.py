"""What the HTTP and gRPC job APIs share: a job's request body, checked exactly as the generation
endpoint of its kind checks it, and the JSON form of a job."""

from __future__ import annotations

from typing import Any

from service.http.errors import ApiError, bad_request
from service.http.params import Body, Generation, check_model, parse_chat, parse_completion
from service.http.state import AppState
from service.jobs.store import JOB_STATUSES, Job, JobKind

ENDPOINT_KINDS: dict[str, JobKind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
MAX_PAGE = 100


def job_kind(body: dict[str, Any]) -> JobKind:
    """A chat request has `messages`; anything else is a completion request."""
    return "chat" if "messages" in body else "completion"


def check_job(kind: JobKind, body: dict[str, Any], state: AppState) -> Generation:
    """The job's generation; ApiError(400/404) names what is wrong, as the HTTP endpoints do."""
    check_model(Body(body), state.model_name)
    return parse_job(kind, body, state)


def parse_job(kind: JobKind, body: dict[str, Any], state: AppState) -> Generation:
    """Parse a stored request (no model check: any replica serving the job's model may run it)."""
    if kind == "chat":
        generation = parse_chat(Body(body), state.tokenizer, state.limits, state.engine.max_model_len)
    else:
        generation = parse_completion(Body(body), state.tokenizer, state.limits)
    _check_runnable_as_job(generation)
    return generation


def _check_runnable_as_job(generation: Generation) -> None:
    if generation.stream:
        raise bad_request("jobs do not stream; read GET /v1/jobs/{id}/events instead", "stream")
    if generation.num_choices != 1:
        raise bad_request("a job generates one choice: one prompt and n = 1", "n")
    if generation.params.logprobs is not None or generation.params.prompt_logprobs is not None:
        raise bad_request("jobs do not keep logprobs", "logprobs")
    if generation.echo:
        raise bad_request("jobs do not echo the prompt", "echo")


def not_found(job_id: str) -> ApiError:
    return ApiError(404, f"no job {job_id!r}", "id", "not_found")


def check_page(limit: int, status: str | None) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit must be in [1, {MAX_PAGE}] (got {limit})", "limit")
    if status is not None and status not in JOB_STATUSES:
        raise bad_request(f"status must be one of {', '.join(JOB_STATUSES)} (got {status!r})", "status")


def job_object(job: Job) -> dict[str, Any]:
    return {
        "id": job.id, "object": "job", "kind": job.kind, "status": job.status, "created_at": job.created_at,
        "started_at": job.started_at, "finished_at": job.finished_at, "progress_tokens": job.progress_tokens,
        "text": job.text, "result": job.result, "error": job.error, "attempts": job.attempts,
        "cancel_requested": job.cancel_requested, "batch_id": job.batch_id, "custom_id": job.custom_id,
    }
