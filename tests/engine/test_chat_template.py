"""Chat templates render exactly as transformers renders them, and fail with clear errors."""

from __future__ import annotations

import pickle
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader
from transformers.utils.chat_template_utils import render_jinja_template

from engine.gguf.chat import CHATML_TEMPLATE, render_chat_template
from engine.gguf.tokenizer import Tokenizer
from tools.embedded_vocab import build_embedded_vocab

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Indented blocks (trim_blocks/lstrip_blocks), namespace, loop controls, tojson, tools, {% generation %}.
TOOLS_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% set ns.system = message.content %}
        {% continue %}
    {% endif %}
{% endfor %}
<|system|>{{ ns.system }}
{% if tools %}
Tools: {{ tools | tojson }}
{% endif %}
{% for message in messages if message.role != 'system' %}
    {% if loop.index > 5 %}{% break %}{% endif %}
<|{{ message.role }}|>
    {% if message.content is defined %}
{{ message.content }}
    {% endif %}
    {% if message.tool_calls is defined %}
        {% for call in message.tool_calls %}
<call>{{ call.function | tojson(indent=2) }}</call>
        {% endfor %}
    {% endif %}
    {% if message.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single": [{"role": "user", "content": "Hello!"}],
    "system": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "  Hello, how can I help?  "},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
    "markup": [
        {"role": "user", "content": '<b>Tom & Jerry</b> "quoted" \u00fcn\u00efcode \U0001f999\n\tend'}
    ],
}
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "add", "arguments": {"a": 2, "b": "<3>"}},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers & return <the> sum",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]
TOOL_CONVERSATION = [
    SYSTEM,
    {"role": "user", "content": "Add 2 and 3"},
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]
TEMPLATES = {
    "llama3": LLAMA3_TEMPLATE,
    "mistral": MISTRAL_TEMPLATE,
    "tools": TOOLS_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
}


def reference(
    template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any
) -> str:
    """transformers' rendering; apply_chat_template drops None-valued keys before it renders."""
    messages = [{k: v for k, v in message.items() if v is not None} for message in messages]
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=add_generation_prompt, **extra
    )
    return rendered[0]


def ours(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any) -> str:
    return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, **extra)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_renders_like_transformers(template: str, conversation: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[conversation]
    if template == "mistral" and conversation == "system":
        pytest.skip("this template rejects system messages (tested below)")
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    expected = reference(TEMPLATES[template], messages, add_generation_prompt, **tokens)
    assert ours(TEMPLATES[template], messages, add_generation_prompt, **tokens) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tools_and_tool_calls_render_like_transformers(add_generation_prompt: bool) -> None:
    expected = reference(
        TOOLS_TEMPLATE, TOOL_CONVERSATION, add_generation_prompt, tools=TOOLS, eos_token="</s>"
    )
    rendered = ours(TOOLS_TEMPLATE, TOOL_CONVERSATION, add_generation_prompt, tools=TOOLS, eos_token="</s>")
    assert rendered == expected
    assert '"<3>"' in rendered and "& return <the> sum" in rendered  # tojson leaves HTML alone
    assert rendered.count("<|assistant|>") == 2 + add_generation_prompt  # {% break %} after 5 turns


def test_reasoning_is_visible_under_every_name() -> None:
    template = "{{ messages[0].reasoning_content }}|{{ messages[0].thinking }}"
    messages = [{"role": "assistant", "content": "x", "reasoning": "because"}]
    assert ours(template, messages, False) == reference(template, messages, False) == "because|because"


# --- templates embedded in GGUF files ---------------------------------------------------------


def gguf_metadata(path: Path, cache_dir: Path | None) -> dict[str, Any]:
    """Every key/value of a GGUF file as plain Python values, kept in pytest's cache: GGUFReader needs
    seconds for a large vocabulary (the same cache as test_tokenizer.py)."""
    stat = path.stat()
    cached = cache_dir / f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}.pickle" if cache_dir else None
    if cached is not None and cached.exists():
        return pickle.loads(cached.read_bytes())
    metadata = {name: field.contents() for name, field in GGUFReader(path).fields.items()}
    if cached is not None:
        cached.write_bytes(pickle.dumps(metadata))
    return metadata


@pytest.fixture(scope="module")
def gguf_templates(shared_data: Path, request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """Metadata of the vocab files that carry a chat template (a byte scan picks them before parsing)."""
    pytest_cache = getattr(request.config, "cache", None)
    cache_dir = pytest_cache.mkdir("moecache-gguf-metadata") if pytest_cache is not None else None
    found = {}
    for path in sorted((shared_data / "vocab").glob("ggml-vocab-*.gguf")):
        if b"tokenizer.chat_template" in path.read_bytes():
            found[path.name] = gguf_metadata(path, cache_dir)
    if not found:
        pytest.skip("no vocab file with tokenizer.chat_template")
    return found


def test_gguf_templates_render_like_transformers(gguf_templates: dict[str, dict[str, Any]]) -> None:
    for name, metadata in gguf_templates.items():
        tokenizer = Tokenizer.from_metadata(metadata)
        tokens = {"bos_token": tokenizer.special_text(tokenizer.bos_id),
                  "eos_token": tokenizer.special_text(tokenizer.eos_id)}  # fmt: skip
        for conversation in CONVERSATIONS.values():
            for add_generation_prompt in (True, False):
                expected = reference(
                    metadata["tokenizer.chat_template"], conversation, add_generation_prompt, **tokens
                )
                assert tokenizer.apply_chat_template(conversation, add_generation_prompt) == expected, name


def test_qwen2_template_adds_its_default_system_prompt(gguf_templates: dict[str, dict[str, Any]]) -> None:
    metadata = gguf_templates.get("ggml-vocab-qwen2.gguf")
    if metadata is None:
        pytest.skip("ggml-vocab-qwen2.gguf not present")
    tokenizer = Tokenizer.from_metadata(metadata)
    prompt = tokenizer.apply_chat_template(CONVERSATIONS["single"])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode_chat(CONVERSATIONS["single"])
    assert ids[0] == 151644 and ids.count(151645) == 2 and tokenizer.decode(ids) == prompt


# --- fallback and errors ------------------------------------------------------------------------


def test_missing_template_falls_back_to_chatml() -> None:
    metadata = {k: v for k, v in build_embedded_vocab().items() if k != "tokenizer.chat_template"}
    tokenizer = Tokenizer.from_metadata(metadata)
    assert tokenizer.chat_template is None
    assert tokenizer.apply_chat_template(CONVERSATIONS["system"]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(CONVERSATIONS["single"], add_generation_prompt=False) == (
        "<|im_start|>user\nHello!<|im_end|>\n"
    )


def test_raise_exception_becomes_value_error_with_its_message() -> None:
    with pytest.raises(ValueError, match="roles must alternate"):
        ours(MISTRAL_TEMPLATE, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], True)


def test_syntax_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ours("{% for message in messages %}{{ message.content }}", CONVERSATIONS["single"], True)


def test_missing_key_in_concatenation_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="chat template failed"):
        ours(CHATML_TEMPLATE, [{"role": "assistant", "content": None}], True)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
        "{{ messages.append({'role': 'user'}) }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(template: str) -> None:
    with pytest.raises(ValueError):
        ours(template, CONVERSATIONS["single"], True)


def test_strftime_now_gives_the_current_date() -> None:
    year = datetime.now().strftime("%Y")
    assert ours("{{ strftime_now('%Y') }}", [], True) in (year, str(int(year) + 1))


def test_messages_are_not_modified() -> None:
    messages = [{"role": "assistant", "content": None, "reasoning": "r"}]
    ours("{{ messages | tojson }}", messages, True)
    assert messages == [{"role": "assistant", "content": None, "reasoning": "r"}]
