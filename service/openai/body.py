"""Request bodies read within bounds: JSON objects of limited nesting, numbers of limited size, text
that is valid Unicode; typed reads of their fields; counts written in ASCII digits (query strings and
headers). Every failure is a 400 that says what is wrong."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from service.openai.errors import SURROGATE, bad_request

MAX_DEPTH = 32  # an OpenAI body nests ~5 levels (messages -> content parts -> part)
MAX_NUMBER_CHARS = 40  # any int64 or double fits; more is not a number this API takes
INT64_MAX = 2**63 - 1
COUNT = re.compile(r"[0-9]{1,19}")  # NOTE: `[0-9]`, not `\d`: `\d` takes Arabic-Indic and fullwidth digits


class BodyError(ValueError):
    """A JSON value outside the bounds; json.loads passes it through from its hooks."""


def decode_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object within the bounds, or a 400 naming the first problem."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise bad_request(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except BodyError as error:
        raise bad_request(str(error)) from None
    except UnicodeDecodeError:
        raise bad_request("the body is not UTF-8") from None
    except ValueError as error:
        raise bad_request(f"the body is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise bad_request("the body must be a JSON object")
    check_value(value)
    return value


def check_value(value: Any) -> None:
    """Raise a 400 for nesting past MAX_DEPTH or a string (key or value) with an unpaired surrogate.
    Dicts built from other sources (a protobuf message, a stored job) pass the same check."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise bad_request(f"the body nests deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            pending.extend((key, depth) for key in item)
            pending.extend((v, depth + 1) for v in item.values())
        else:
            pending.extend((v, depth + 1) for v in item)


def _check_text(text: str) -> None:
    if not text.isascii() and (found := SURROGATE.search(text)) is not None:
        raise bad_request(f"a string holds an unpaired surrogate (U+{ord(found.group()):04X}), which is not Unicode "
                          "text")


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise BodyError(f"a number has {len(text)} characters; at most {MAX_NUMBER_CHARS} are read")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise BodyError(f"a number has {len(text)} characters; at most {MAX_NUMBER_CHARS} are read")
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(f"the number {text} is out of range")
    return value


def _constant(name: str) -> float:
    raise BodyError(f"{name} is not a JSON number")


def parse_count(text: str, name: str, maximum: int = INT64_MAX, minimum: int = 0) -> int:
    """An integer in [minimum, maximum] written in ASCII digits (a query parameter or a header)."""
    if COUNT.fullmatch(text) is None or not minimum <= (value := int(text)) <= maximum:
        raise bad_request(f"{name} must be an integer from {minimum} to {maximum} in ASCII digits "
                          f"(got {text[:40]!r})", name)
    return value


class Body:
    """Typed reads of a JSON object's optional fields: null or absent gives the default."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def raw(self, name: str) -> Any:
        return self.data.get(name)

    def integer(self, name: str, default: int | None = None) -> int | None:
        """Any int64; ranges narrower than that are the caller's to check."""
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{name} must be an integer (got {_shown(value)})", name)
        if not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise bad_request(f"{name} must fit in 64 bits (got {value})", name)
        return value

    def number(self, name: str, default: float) -> float:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"{name} must be a number (got {_shown(value)})", name)
        if isinstance(value, int) and abs(value) > INT64_MAX:
            raise bad_request(f"{name} is out of range (got {value})", name)
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"{name} must be true or false (got {_shown(value)})", name)
        return value

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string (got {_shown(value)})", name)
        return value

    def obj(self, name: str) -> Body:
        value = self.data.get(name)
        if value is not None and not isinstance(value, dict):
            raise bad_request(f"{name} must be an object", name)
        return Body(value or {})


def _shown(value: Any) -> str:
    """A value as an error message quotes it: short, whatever its size."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
