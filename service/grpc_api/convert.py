"""Protocol buffer messages <-> the OpenAI request bodies of `service.openai` (so the gRPC and the HTTP
APIs accept and refuse exactly the same requests), and engine outputs and jobs -> messages."""

from __future__ import annotations

import json
from typing import Any

from engine.gguf.tokenizer import Tokenizer
from engine.types import RequestOutput, TokenLogprob
from service.grpc_api.stubs import load
from service.jobs.records import Job
from service.openai.errors import bad_request
from service.openai.kinds import Kind

STUBS = load()
gen_pb: Any = STUBS.generation_pb2
jobs_pb: Any = STUBS.jobs_pb2

OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "seed")


def request_body(request: Any) -> tuple[Kind, dict[str, Any]]:
    """A GenerateRequest as the body of the HTTP request of its kind."""
    which = request.WhichOneof("input")
    if which is None:
        raise bad_request("give a prompt or a chat", "prompt")
    body = sampling_body(request.sampling, is_chat=which == "chat")
    if request.model:
        body["model"] = request.model
    if which == "chat":
        return "chat", {**body, "messages": chat_messages(request.chat)}
    return "completion", {**body, "prompt": request.prompt}


def chat_messages(chat: Any) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def sampling_body(sampling: Any, is_chat: bool) -> dict[str, Any]:
    body = {name: getattr(sampling, name) for name in OPTIONAL_SAMPLING if sampling.HasField(name)}
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if sampling.HasField("prompt_logprobs"):
        body["prompt_logprobs"] = sampling.prompt_logprobs
    if sampling.HasField("logprobs"):  # the chat API spells "n most likely tokens" differently
        body.update({"logprobs": True, "top_logprobs": sampling.logprobs} if is_chat else
                    {"logprobs": sampling.logprobs})
    return body


def tokenize_body(request: Any) -> dict[str, Any]:
    """A TokenizeRequest as the body of `POST /tokenize` (no input: an empty body, refused as HTTP refuses it)."""
    which = request.WhichOneof("input")
    body: dict[str, Any] = {}
    if which == "chat":
        body["messages"] = chat_messages(request.chat)
        if request.HasField("add_generation_prompt"):
            body["add_generation_prompt"] = request.add_generation_prompt
    elif which == "prompt":
        body["prompt"] = request.prompt
        if request.HasField("add_special"):
            body["add_special"] = request.add_special
    return body


def chunk_message(out: RequestOutput, tokenizer: Tokenizer) -> Any:
    logprobs = [token_logprob(lp, tokenizer) for lp in out.logprobs]
    prompt = [token_logprob(lp, tokenizer) for lp in out.prompt_logprobs if lp is not None]
    chunk = gen_pb.TokenChunk(text=out.new_text, token_ids=out.new_token_ids, logprobs=logprobs,
                              prompt_logprobs=prompt)
    return gen_pb.GenerateResponse(chunk=chunk)


def token_logprob(lp: TokenLogprob, tokenizer: Tokenizer) -> Any:
    top = [gen_pb.TopLogprob(token_id=t, token=tokenizer.token_text(t), logprob=v) for t, v in lp.top]
    return gen_pb.TokenLogprob(token_id=lp.token_id, token=tokenizer.token_text(lp.token_id), logprob=lp.logprob,
                               top=top)


def finished_message(out: RequestOutput) -> Any:
    usage = usage_message(out.num_prompt_tokens, out.num_generated_tokens)
    return gen_pb.GenerateResponse(finished=gen_pb.Finished(finish_reason=out.finish_reason or "abort", usage=usage))


def usage_message(prompt_tokens: int, completion_tokens: int) -> Any:
    return gen_pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens)


def job_status(status: str) -> int:
    return int(jobs_pb.JobStatus.Value(f"JOB_STATUS_{status.upper()}"))


def status_name(status: int) -> str | None:
    """A JobStatus as the store names it; None for unspecified."""
    if status not in jobs_pb.JobStatus.values():
        raise bad_request(f"status must be one of {', '.join(jobs_pb.JobStatus.keys())} (got {status})", "status")
    return None if status == 0 else str(jobs_pb.JobStatus.Name(status)).removeprefix("JOB_STATUS_").lower()


def job_message(job: Job) -> Any:
    message = jobs_pb.Job(id=job.id, kind=job.kind, status=job_status(job.status),
                          progress_tokens=job.progress_tokens, text=job.text, created_at=job.created_at,
                          error=job.error or "", cancel_requested=job.cancel_requested, attempts=job.attempts)
    if job.started_at is not None:
        message.started_at = job.started_at
    if job.finished_at is not None:
        message.finished_at = job.finished_at
    if job.result is not None:
        add_result(message, job.result)
    return message


def add_result(message: Any, result: dict[str, Any]) -> None:
    message.result_json = json.dumps(result, ensure_ascii=False)
    message.finish_reason = result["choices"][0]["finish_reason"] or ""
    usage = result["usage"]
    message.usage.CopyFrom(usage_message(usage["prompt_tokens"], usage["completion_tokens"]))
