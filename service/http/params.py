"""OpenAI request bodies -> typed generation jobs; a wrong field is a 400 that names it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.gguf.tokenizer import Tokenizer
from engine.types import Request, SamplingParams
from service.http.errors import ApiError, bad_request
from service.http.limits import Limits

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SEED = 2**63 - 1
UNSUPPORTED = ("suffix", "logit_bias", "tools", "functions")


class Body:
    """Typed reads of a JSON object's optional fields: null or absent gives the default."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def raw(self, name: str) -> Any:
        return self.data.get(name)

    def integer(self, name: str, default: int | None = None) -> int | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{name} must be an integer (got {value!r})", name)
        return value

    def number(self, name: str, default: float) -> float:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"{name} must be a number (got {value!r})", name)
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"{name} must be true or false (got {value!r})", name)
        return value

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string (got {value!r})", name)
        return value

    def obj(self, name: str) -> Body:
        value = self.data.get(name)
        if value is not None and not isinstance(value, dict):
            raise bad_request(f"{name} must be an object", name)
        return Body(value or {})


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


def check_model(body: Body, served: str) -> None:
    model = body.string("model")
    if model is not None and model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")


def parse_completion(body: Body, tokenizer: Tokenizer, limits: Limits) -> Generation:
    _check_unsupported(body)
    prompts = completion_prompts(body.raw("prompt"), tokenizer)
    logprobs, echo = body.integer("logprobs"), body.boolean("echo", False)
    # vLLM's prompt_logprobs, or OpenAI's legacy echo + logprobs: the prompt tokens' logprobs as well
    prompt_logprobs = body.integer("prompt_logprobs", logprobs if echo else None)
    if body.raw("prompt_logprobs") is not None and body.boolean("stream", False):
        raise bad_request("prompt_logprobs does not stream; use echo with logprobs", "prompt_logprobs")
    params = sampling_params(body, limits, COMPLETION_DEFAULT_MAX_TOKENS, logprobs, prompt_logprobs)
    return replace(_generation(body, prompts, params, limits), echo=echo,
                   tokens_as_ids=body.boolean("return_tokens_as_token_ids", False))


def parse_chat(body: Body, tokenizer: Tokenizer, limits: Limits, max_model_len: int) -> Generation:
    _check_unsupported(body)
    for name in ("echo", "prompt_logprobs"):
        if body.raw(name):
            raise bad_request(f"{name} is for prompts: use /v1/completions", name)
    try:
        prompt = tuple(tokenizer.encode_chat(chat_messages(body.raw("messages"))))
    except ValueError as error:  # the template refused the conversation
        raise bad_request(str(error), "messages") from None
    default_max_tokens = max(1, min(limits.max_tokens, max_model_len - len(prompt)))
    params = sampling_params(body, limits, default_max_tokens, chat_logprobs(body))
    return _generation(body, (prompt,), params, limits)


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
