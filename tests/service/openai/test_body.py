"""Bounded reading of request bodies, query numbers and the API key: every failure a 400 that says what is
wrong, never an exception of the parser."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.openai.auth import is_authorized
from service.openai.body import MAX_DEPTH, Body, decode_object, parse_count
from service.openai.errors import ApiError, printable


def refused(raw: bytes) -> str:
    with pytest.raises(ApiError) as error:
        decode_object(raw)
    assert error.value.status == 400
    return error.value.message


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


def test_a_json_object_within_the_bounds_is_read() -> None:
    body = {"prompt": [[1, 2]], "messages": [{"role": "user", "content": [{"type": "text", "text": "hi 😀"}]}],
            "temperature": 0.5, "seed": 2**63 - 1}
    assert decode_object(json.dumps(body).encode()) == body
    assert decode_object(b'{"a": "\\ud83d\\ude00"}') == {"a": "😀"}  # a surrogate pair is one character


def test_nesting_up_to_the_limit_is_read() -> None:
    assert decode_object(nested(MAX_DEPTH - 1))  # the object and MAX_DEPTH - 1 lists


@pytest.mark.parametrize("depth", [MAX_DEPTH, 990, 100_000])
def test_nesting_past_the_limit_is_refused_however_deep(depth: int) -> None:
    assert f"deeper than {MAX_DEPTH}" in refused(nested(depth))


@pytest.mark.parametrize("raw", [b'{"prompt": "\\ud800"}', b'{"\\udfff": 1}', b'{"m": [{"role": "a\\ud800b"}]}'])
def test_an_unpaired_surrogate_anywhere_is_refused(raw: bytes) -> None:
    assert "unpaired surrogate" in refused(raw)


@pytest.mark.parametrize(("raw", "says"), [
    (b'{"n": ' + b"9" * 41 + b"}", "characters"),
    (b'{"n": 1' + b"0" * 45 + b".5}", "characters"),
    (b'{"n": 1e400}', "out of range"),
    (b'{"n": NaN}', "not a JSON number"),
    (b'{"n": -Infinity}', "not a JSON number"),
    (b'{"a": 1', "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[1, 2]", "must be a JSON object"),
])
def test_numbers_past_their_size_and_bodies_that_are_not_json_objects_are_refused(raw: bytes, says: str) -> None:
    assert says in refused(raw)


@pytest.mark.parametrize(("text", "maximum", "value"), [("0", 100, 0), ("42", 100, 42), ("007", 100, 7),
                                                       ("9223372036854775807", 2**63 - 1, 2**63 - 1)])
def test_a_count_in_ascii_digits_is_read(text: str, maximum: int, value: int) -> None:
    assert parse_count(text, "limit", maximum) == value


@pytest.mark.parametrize("text", ["²", "٣", "１", "𝟙", "-1", "+1", " 1", "1.0", "", "1" * 20, "9" * 5000, "101"])
def test_a_count_in_other_digits_signs_or_out_of_range_is_refused(text: str) -> None:
    with pytest.raises(ApiError) as error:
        parse_count(text, "limit", 100)
    assert error.value.status == 400 and error.value.param == "limit" and "ASCII digits" in error.value.message


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30])
def test_an_integer_field_past_64_bits_is_refused(value: Any) -> None:
    with pytest.raises(ApiError) as error:
        Body({"seed": value}).integer("seed")
    assert error.value.param == "seed" and "64 bits" in error.value.message


def test_an_error_message_never_carries_an_unpaired_surrogate() -> None:
    assert printable("a\udcffb") == "a\ufffdb"
    assert json.dumps(ApiError(400, "got '\ud800'").body(), ensure_ascii=False).encode()


@pytest.mark.parametrize(("header", "ok"), [
    ("Bearer k3y", True), ("bearer k3y", True), ("BEARER  k3y ", True), (b"Bearer k3y", True),
    ("Bearer k3", False), ("Basic k3y", False), ("k3y", False), ("", False), (None, False), ("Bearer k3y\udcff", False),
])
def test_the_bearer_scheme_is_read_in_any_case(header: str | bytes | None, ok: bool) -> None:
    assert is_authorized(header, "k3y") is ok
