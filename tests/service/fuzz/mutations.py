"""Schema-guided mutations (hypothesis strategies): valid bodies of each endpoint, from the seed corpus,
with fields set to hostile values of their kind (boundaries, wrong types, unpaired surrogates, digits that
are not ASCII, deep nesting), deleted, or added; then, now and then, the bytes, headers, queries and
path ids mutated too."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

from fuzz_http import HttpCase
from hypothesis import strategies as st

Draw = Any  # hypothesis' draw function

COUNTS = ("0", "1", "20", "100", "101", "-1", "+1", " 1", "1 ", "1.5", "1e3", "0x10", "²", "٣", "１", "۳", "𝟙",
          "9" * 20, "9" * 19, "9223372036854775807", "9223372036854775808", "1" * 5000, "")
PERCENT = ("%ff", "%ED%A0%80", "%00", "%", "%zz", "%C0%AF")  # written as sent: bytes that are not UTF-8 text
INTS = (0, 1, -1, 2, 3, 16, 255, 256, 257, 4095, 4096, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
        10**30, -(2**63) - 1)
FLOATS = (0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 100.0, 1e-320, 1e308, -1e308, float("inf"), float("nan"))
STRINGS = ("", " ", "tiny", "hello", "x" * 3000, "\ud800", "\udfff", "a\ud800b", "\x00", "\u202e", "😀", "²", "٣",
           "\n\r\t", "null", "{}", "[DONE]", "data: x\n\n", "<script>", "../../etc/passwd", "%s%n", "\\", '"')
TOKEN_IDS = (0, 1, 2, 100, 4095, 4096, 99999, -1, 2**31, 2**63, 2**64)
ROLES = ("user", "assistant", "system", "tool", "", "\ud800", "USER", "x" * 300)
WINDOWS = ("24h", "1h", "0h", "8760h", "8761h", "9" * 30 + "h", "24", "h", "٢٤h", "24H", "-1h", "")
DEEP = (33, 64, 990, 5000)
DEEP_MARKER = re.compile(r'"__deep_(\d+)__"')
MAX_QUERY_CHARS = 6000


@dataclass(frozen=True)
class Deep:
    """A JSON value nested `depth` levels, written into the serialized body as text."""

    depth: int

    @property
    def marker(self) -> str:
        return f"__deep_{self.depth}__"


COMPLETION = {"model": "model", "prompt": "prompt", "max_tokens": "int", "max_completion_tokens": "int",
              "temperature": "number", "top_p": "number", "top_k": "int", "min_p": "number", "seed": "int",
              "repetition_penalty": "number", "presence_penalty": "number", "frequency_penalty": "number",
              "stop": "stop", "n": "int", "stream": "bool", "stream_options": "stream_options", "logprobs": "int",
              "echo": "bool", "prompt_logprobs": "int", "return_tokens_as_token_ids": "bool", "best_of": "int",
              "user": "string", "ignore_eos": "bool", "suffix": "string", "logit_bias": "any"}
CHAT = {**{k: v for k, v in COMPLETION.items() if k != "prompt"}, "messages": "messages", "logprobs": "bool",
        "top_logprobs": "int", "tools": "any"}
SCHEMAS: dict[str, dict[str, str]] = {
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": CHAT,
    "/tokenize": {"prompt": "string", "messages": "messages", "add_special": "bool", "add_generation_prompt": "bool"},
    "/detokenize": {"tokens": "ids"},
    "/v1/jobs": {**COMPLETION, **CHAT},
    "/v1/batches": {"input_file_id": "file_id", "endpoint": "endpoint", "completion_window": "window",
                    "metadata": "metadata"},
}
QUERIES = {"/v1/jobs": ("limit", "after", "status"), "/v1/files": ("limit", "after", "purpose"),
           "/v1/batches": ("limit", "after"), "/events": ("after",)}


def json_values(depth: int = 2) -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.sampled_from(INTS), st.sampled_from(FLOATS),
                       st.sampled_from(STRINGS), st.text(max_size=20))
    if depth == 0:
        return leaves
    inner = json_values(depth - 1)
    return st.one_of(leaves, st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(STRINGS), inner, max_size=3),
                     st.sampled_from(DEEP).map(Deep))


def value_of(kind: str, ids: dict[str, str]) -> st.SearchStrategy[Any]:
    """Values of a field's kind: mostly near-valid, hostile at the edges, now and then anything."""
    kinds: dict[str, st.SearchStrategy[Any]] = {
        "int": st.one_of(st.sampled_from(INTS), st.integers(-5, 300)),
        "number": st.one_of(st.sampled_from(FLOATS), st.floats(-3, 3), st.sampled_from(INTS)),
        "bool": st.one_of(st.booleans(), st.sampled_from((0, 1, "true", None))),
        "string": st.one_of(st.sampled_from(STRINGS), st.text(max_size=40)),
        "model": st.sampled_from(("tiny", "gpt-4", "", "\ud800", "TINY")),
        "prompt": prompts(),
        "messages": st.lists(message(), max_size=4),
        "stop": st.one_of(st.sampled_from(STRINGS), st.lists(st.sampled_from(STRINGS), max_size=20)),
        "stream_options": st.dictionaries(st.just("include_usage"), json_values(0), max_size=1),
        "ids": st.lists(st.sampled_from(TOKEN_IDS), max_size=8),
        "metadata": st.dictionaries(st.sampled_from(STRINGS), json_values(0), max_size=20),
        "window": st.sampled_from(WINDOWS),
        "endpoint": st.sampled_from(("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "", "\ud800")),
        "file_id": st.sampled_from((ids.get("file_id", "file-x"), ids.get("bad_file_id", "file-y"), "file-nope", "",
                                    "\ud800", "x" * 5000)),
    }
    return st.one_of(kinds.get(kind, json_values()), json_values(1)) if kind != "any" else json_values()


def prompts() -> st.SearchStrategy[Any]:
    text = st.one_of(st.sampled_from(STRINGS), st.text(max_size=30))
    ids = st.lists(st.sampled_from(TOKEN_IDS), max_size=6)
    return st.one_of(text, st.lists(text, max_size=3), ids, st.lists(ids, max_size=3), st.sampled_from(DEEP).map(Deep))


def message() -> st.SearchStrategy[Any]:
    part = st.fixed_dictionaries({"type": st.sampled_from(("text", "image_url", "")),
                                  "text": st.one_of(st.sampled_from(STRINGS), st.integers())})
    content = st.one_of(st.sampled_from(STRINGS), st.none(), st.lists(part, max_size=3), json_values(1))
    valid = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": content})
    return st.one_of(valid, valid, json_values(1))


@st.composite
def mutated_body(draw: Draw, seed: dict[str, Any], schema: dict[str, str], ids: dict[str, str]) -> dict[str, Any]:
    body = dict(seed)
    for _ in range(draw(st.integers(1, 3))):
        operation = draw(st.sampled_from(("set", "set", "set", "delete", "unknown")))
        if operation == "set":
            name = draw(st.sampled_from(sorted(schema)))
            body[name] = draw(value_of(schema[name], ids))
        elif operation == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body[draw(st.sampled_from(STRINGS))] = draw(json_values())
    return body


def serialize(value: Any) -> bytes:
    """JSON as a client could send it: lone surrogates escaped, NaN and Infinity written, deep nests inlined
    (a `Deep`, or the string `__deep_<n>__` of the corpus)."""
    text = json.dumps(value, default=lambda v: v.marker if isinstance(v, Deep) else str(v))
    return DEEP_MARKER.sub(lambda m: "[" * int(m.group(1)) + "]" * int(m.group(1)), text).encode()


@st.composite
def mutated_bytes(draw: Draw, body: bytes) -> bytes:
    operation = draw(st.sampled_from(("truncate", "insert", "replace", "bom")))
    if operation == "truncate":
        return body[:draw(st.integers(0, max(0, len(body) - 1)))]
    if operation == "insert":
        at = draw(st.integers(0, len(body)))
        return body[:at] + draw(st.binary(min_size=1, max_size=4)) + body[at:]
    if operation == "bom":
        return b"\xef\xbb\xbf" + body
    return draw(st.sampled_from((b"", b"null", b"[]", b"1", b'"x"', b"{", b"\xff\xfe", b"{}" * 3, b'{"a":1,}')))


@st.composite
def mutated_headers(draw: Draw, headers: dict[str, str], body: bytes | None,
                    key: str) -> tuple[dict[str, str], bytes | None]:
    headers = dict(headers)
    operation = draw(st.sampled_from(("auth", "type", "encoding", "encoded", "accept")))
    if operation == "auth":
        headers["Authorization"] = draw(st.sampled_from((f"bearer {key}", f"BEARER  {key}", f"Bearer {key} ",
                                                         "Bearer", "Bearer wrong", key, f"Basic {key}", "")))
    elif operation == "type":
        headers["Content-Type"] = draw(st.sampled_from(("text/plain", "application/x-www-form-urlencoded",
                                                        "multipart/form-data", "application/json; charset=latin-1",
                                                        "")))
    elif operation == "encoding":  # codings aiohttp decodes (it refuses others itself, before any route)
        headers["Content-Encoding"] = draw(st.sampled_from(("gzip", "deflate", "identity", "x-nope")))
    elif operation == "encoded" and body is not None:
        encoding = draw(st.sampled_from(("gzip", "deflate")))
        headers["Content-Encoding"] = encoding
        body = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    else:
        headers["Accept"] = "text/html"
    return headers, body


@st.composite
def mutated_case(draw: Draw, seed: HttpCase, key: str, ids: dict[str, str]) -> HttpCase:
    """One mutation of a corpus case: its JSON body by schema, its query, its path id, its bytes, its headers."""
    case, headers = seed, dict(seed.headers)
    path_only, _, query = seed.path.partition("?")
    schema = SCHEMAS.get(path_only)
    if schema is not None and isinstance(seed.data, dict) and draw(st.integers(0, 9)) < 8:
        body = draw(mutated_body(seed.data, schema, ids))
        case = replace(case, body=serialize(body))
    if query or path_only in QUERIES or path_only.endswith("/events"):
        case = replace(case, path=draw(mutated_query(path_only)))
    if "/" in path_only.removeprefix("/v1/").strip("/") and draw(st.integers(0, 4)) == 0:
        case = replace(case, path=draw(mutated_path_id(case.path)))
    if case.body is not None and draw(st.integers(0, 6)) == 0:
        case = replace(case, body=draw(mutated_bytes(case.body)))
    if draw(st.integers(0, 6)) == 0:
        headers, body = draw(mutated_headers(headers, case.body, key))
        case = replace(case, body=body)
    if path_only.endswith("/events") and draw(st.integers(0, 3)) == 0:
        headers["Last-Event-ID"] = draw(st.sampled_from(COUNTS))
    leave_after = draw(st.sampled_from((None, None, 0, 1, 3))) if case.method == "POST" else case.leave_after
    return replace(case, headers=tuple(headers.items()), leave_after=leave_after, expect=None, name="mutant",
                   data=None)


@st.composite
def mutated_query(draw: Draw, path: str) -> str:
    names = QUERIES["/events" if path.endswith("/events") else path]
    params = []
    for name in draw(st.lists(st.sampled_from(names), max_size=3)):
        value = draw(st.one_of(st.sampled_from(COUNTS).map(_quoted), st.sampled_from(PERCENT),
                               st.sampled_from(("queued", "running", "nope", "batch")),
                               st.text(max_size=10).map(_quoted)))
        params.append(f"{name}={value}")
    while len("&".join(params)) > MAX_QUERY_CHARS:  # HTTP's request line has a limit (aiohttp: 8190 bytes)
        params.pop()
    return path + ("?" + "&".join(params) if params else "")


@st.composite
def mutated_path_id(draw: Draw, path: str) -> str:
    path_only, _, query = path.partition("?")
    parts = path_only.split("/")
    at = 3 if len(parts) > 3 else len(parts) - 1  # /v1/<collection>/<id>...
    odd = st.sampled_from(("x" * 3000, "..", "%2F", "٣", " ")).map(_quoted)
    parts[at] = draw(st.one_of(st.sampled_from(PERCENT), odd, st.text(min_size=1, max_size=12).map(_quoted)))
    return "/".join(parts) + ("?" + query if query else "")


def _quoted(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")
