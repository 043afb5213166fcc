"""OpenAI request bodies -> typed generation requests; a wrong field is a 400 that names it.

Every check the engine would make (vocabulary, context length, empty prompt) is made here too, so a
request is refused when it is submitted, whichever way it came: HTTP, gRPC, a job, a batch line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.gguf.tokenizer import Tokenizer
from engine.types import Request, SamplingParams
from service.openai.body import Body, check_value
from service.openai.errors import ApiError, bad_request
from service.openai.kinds import Kind
from service.openai.limits import Limits

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SEED = 2**63 - 1
UNSUPPORTED = ("suffix", "logit_bias", "tools", "functions")


@dataclass(frozen=True)
class ServedModel:
    """What reading a request needs to know of the loaded model and the server's limits."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    limits: Limits


@dataclass(frozen=True)
class Generation:
    """One validated OpenAI generation call: prompts as token ids and the shared sampling parameters."""

    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt's text (and with logprobs, its tokens') before the output
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def requests(self, request_id: str, arrival: float) -> list[Request]:
        """One engine request per choice; choice `p * n + i` samples prompt `p`."""
        return [Request(f"{request_id}-{p * self.n + i}", prompt, self._choice_params(i), arrival)
                for p, prompt in enumerate(self.prompts) for i in range(self.n)]

    def _choice_params(self, i: int) -> SamplingParams:
        # Seeded choices get consecutive seeds: reproducible, and n > 1 does not give n copies.
        seed = self.params.seed
        return self.params if seed is None or i == 0 else replace(self.params, seed=(seed + i) % MAX_SEED)


def read_generation(kind: Kind, data: dict[str, Any], model: ServedModel, *, any_model: bool = False) -> Generation:
    """The generation of a `/v1/completions` or `/v1/chat/completions` body. `any_model`: skip the model
    name check (a stored job runs on any replica serving its model)."""
    check_value(data)
    body = Body(data)
    if not any_model:
        check_model(body, model.name)
    generation = parse_chat(body, model) if kind == "chat" else parse_completion(body, model)
    check_prompts(generation, model)
    return generation


def check_model(body: Body, served: str) -> None:
    name = body.string("model")
    if name is not None and name != served:
        raise ApiError(404, f"the model {name[:100]!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")


def check_prompts(generation: Generation, model: ServedModel) -> None:
    """The engine's own checks, made before the request is queued anywhere."""
    max_tokens, limit = generation.params.max_tokens, model.max_model_len
    for prompt in generation.prompts:
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        if min(prompt) < 0 or max(prompt) >= model.tokenizer.vocab_size:
            raise bad_request(f"prompt token ids must be in [0, {model.tokenizer.vocab_size})", "prompt")
        if len(prompt) + max_tokens > limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens; the prompt has {len(prompt)} "
                              f"tokens and max_tokens is {max_tokens} ({len(prompt) + max_tokens} in all)",
                              "max_tokens", "context_length_exceeded")


def parse_completion(body: Body, model: ServedModel) -> Generation:
    _check_unsupported(body)
    prompts = completion_prompts(body.raw("prompt"), model.tokenizer)
    logprobs, echo = body.integer("logprobs"), body.boolean("echo", False)
    # vLLM's prompt_logprobs, or OpenAI's legacy echo + logprobs: the prompt tokens' logprobs as well
    prompt_logprobs = body.integer("prompt_logprobs", logprobs if echo else None)
    if body.raw("prompt_logprobs") is not None and body.boolean("stream", False):
        raise bad_request("prompt_logprobs does not stream; use echo with logprobs", "prompt_logprobs")
    params = sampling_params(body, model.limits, COMPLETION_DEFAULT_MAX_TOKENS, logprobs, prompt_logprobs)
    return replace(_generation(body, prompts, params, model.limits), echo=echo,
                   tokens_as_ids=body.boolean("return_tokens_as_token_ids", False))


def parse_chat(body: Body, model: ServedModel) -> Generation:
    _check_unsupported(body)
    for name in ("echo", "prompt_logprobs"):
        if body.raw(name):
            raise bad_request(f"{name} is for prompts: use /v1/completions", name)
    prompt = tuple(encode_chat(model.tokenizer, chat_messages(body.raw("messages"))))
    limits = model.limits
    default_max_tokens = max(1, min(limits.max_tokens, model.max_model_len - len(prompt)))
    params = sampling_params(body, limits, default_max_tokens, chat_logprobs(body))
    return _generation(body, (prompt,), params, limits)


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt)
    except ValueError as error:  # the template refused the conversation
        raise bad_request(str(error), "messages") from None


def tokenize_request(data: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """`/tokenize`: `{"prompt": str, "add_special"}` or `{"messages": [...], "add_generation_prompt"}`."""
    check_value(data)
    body = Body(data)
    if body.raw("messages") is not None:
        messages = chat_messages(body.raw("messages"))
        return encode_chat(tokenizer, messages, body.boolean("add_generation_prompt", True))
    prompt = body.string("prompt")
    if prompt is None:
        raise bad_request("give prompt (a string) or messages", "prompt")
    return tokenizer.encode(prompt, add_special=body.boolean("add_special", True))


def _generation(body: Body, prompts: tuple[tuple[int, ...], ...], params: SamplingParams,
                limits: Limits) -> Generation:
    n = body.integer("n", 1) or 0
    if n < 1 or n * len(prompts) > limits.max_n:
        raise bad_request(f"n x prompts must be in [1, {limits.max_n}] (got {n} x {len(prompts)})", "n")
    stream = body.boolean("stream", False)
    include_usage = body.obj("stream_options").boolean("include_usage", False)
    body.string("user")  # accepted for compatibility; only its type is checked
    return Generation(prompts, params, n, stream, include_usage)


def _check_unsupported(body: Body) -> None:
    for name in UNSUPPORTED:
        if body.raw(name):
            raise bad_request(f"{name} is not supported by this server", name)
    if (body.integer("best_of") or 1) > 1:
        raise bad_request("best_of is not supported by this server", "best_of")


def completion_prompts(prompt: Any, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(prompt, str):
        return (tuple(tokenizer.encode(prompt)),)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(tuple(tokenizer.encode(p)) for p in prompt)
    if isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        return tuple(tuple(p) for p in prompt)
    if _is_ids(prompt):
        return (tuple(prompt),)
    raise bad_request("prompt must be a string, a list of strings, or (lists of) token ids", "prompt")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def chat_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    return [_message(m) for m in messages]


def _message(message: Any) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request("each message must be an object with a string role", "messages")
    return {"role": message["role"], "content": _content(message.get("content"))}


def _content(content: Any) -> str:
    """A string, null, or a list of text parts (OpenAI's content-part form)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(_is_text_part(p) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request("message content must be a string or a list of {type: text, text} parts", "messages")


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def chat_logprobs(body: Body) -> int | None:
    """Chat's `logprobs: true` + `top_logprobs: k` as the engine's number of top tokens (None: off)."""
    top = body.integer("top_logprobs")
    if not body.boolean("logprobs", False):
        if top is not None:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def stop_strings(body: Body, limits: Limits) -> tuple[str, ...]:
    stop = body.raw("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"at most {limits.max_stop_strings} stop strings (got {len(stops)})", "stop")
    return tuple(stops)


def max_tokens(body: Body, limits: Limits, default: int) -> int:
    name = "max_completion_tokens" if body.raw("max_completion_tokens") is not None else "max_tokens"
    value = body.integer(name, default) or 0
    if value > limits.max_tokens:
        raise bad_request(f"{name} must be at most {limits.max_tokens} (got {value})", name)
    return value


def sampling_params(body: Body, limits: Limits, default_max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams checks ranges itself; its RequestError names the field."""
    seed = body.integer("seed")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad_request(f"seed must be in [0, {MAX_SEED}] (got {seed})", "seed")
    top_k = body.integer("top_k", 0) or 0
    return SamplingParams(
        max_tokens=max_tokens(body, limits, default_max_tokens),
        temperature=body.number("temperature", 1.0), top_p=body.number("top_p", 1.0),
        top_k=0 if top_k == -1 else top_k, min_p=body.number("min_p", 0.0),
        repetition_penalty=body.number("repetition_penalty", 1.0),
        presence_penalty=body.number("presence_penalty", 0.0),
        frequency_penalty=body.number("frequency_penalty", 0.0),
        seed=seed, stop=stop_strings(body, limits), ignore_eos=body.boolean("ignore_eos", False),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
