"""Chat templates (`tokenizer.chat_template`) rendered the way transformers renders them.

Templates are written against transformers' `apply_chat_template`: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not
escape HTML, and the `{% generation %}` tag. Anything that fails becomes a ValueError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a GGUF carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Errors a template can raise while rendering, besides jinja2's own.
RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it only
    renders its body, so templates that use it still compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach Python internals."""

    # `self` travels in args, as in jinja2's Namespace, so that `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot set underscore names on a namespace: {name!r}"
        )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per template string; a syntax error becomes a ValueError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_make_dict,
        namespace=TemplateNamespace,
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template does not compile: {error} (line {error.lineno})") from error


def render_chat_template(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` (dicts with role/content/...) with `template`, or ChatML when it is None.

    `extra` is passed to the template as variables (bos_token, eos_token, ...). Keys whose value is
    None are dropped from messages first, as transformers does: templates test for presence."""
    compiled = compile_template(template or CHATML_TEMPLATE)
    conversation = [_with_reasoning_aliases(_plain(_without_none(message))) for message in messages]
    try:
        return compiled.render(
            messages=conversation,
            tools=_plain(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **_plain(extra),
        )
    except RENDER_ERRORS as error:
        raise ValueError(f"chat template failed: {error}") from error


def _without_none(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"chat messages must be dicts, got {message!r}")
    return {key: value for key, value in message.items() if value is not None}


def _plain(value: Any) -> Any:
    # A copy built from JSON types only, so the sandboxed template never sees caller objects.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses such as str enums, back to the base type
        return str.__str__(value)
    if isinstance(value, (int, float)):
        return float(value) if isinstance(value, float) else int(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    # Templates read a message's reasoning as `reasoning_content` (Qwen, DeepSeek) or `thinking` (gpt-oss).
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}
