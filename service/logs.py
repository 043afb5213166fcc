"""Logging that writes no secret: the API key, `Authorization` values and database passwords are
redacted from every record of the loggers that may quote a request (aiohttp's, grpc's, the unexpected
errors of the API), and a client's malformed HTTP request is one warning line, not a server error."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

# aiohttp's low-level server quotes the raw header lines of a request it cannot parse
QUOTING_LOGGERS = ("aiohttp.server", "aiohttp.access", "aiohttp.web", "aiohttp.internal", "grpc._cython.cygrpc",
                   "grpc._server", "service.openai.errors")
REDACTED = "[redacted]"
PATTERNS = (
    re.compile(r"(?i)(authorization[\"']?\s*[:=,]\s*[\"']?)[^\r\n\"']+"),
    re.compile(r"(?i)(postgres(?:ql)?://[^:/@\s]+:)[^@\s]+(?=@)"),
)


class Redact(logging.Filter):
    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError | RequestPayloadError):  # the client's: one line, no traceback
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            first_line = str(getattr(error, "message", error)).partition("\n")[0]
            record.msg, record.args = f"{record.getMessage()}: {first_line}", ()
            record.exc_info = None
        if record.exc_info:
            record.exc_text = self.redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        record.msg, record.args = self.redact(record.getMessage()), ()
        return True

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        for pattern in PATTERNS:
            text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
        return text


def secrets_of(api_key: str | None, db_url: str | None) -> list[str]:
    """The strings no log line may hold: the API key and the job store's password."""
    found = [api_key] if api_key else []
    if db_url and (match := PATTERNS[1].search(db_url)):
        found.append(db_url[match.end(1):match.end()])
    return found


def install(redact: Redact) -> None:
    """On the loggers that quote requests and on the root logger's handlers (every record they write)."""
    for owner in _owners():
        owner.addFilter(redact)


def uninstall(redact: Redact) -> None:
    for owner in _owners():
        owner.removeFilter(redact)


def _owners() -> list[logging.Filterer]:
    return [*(logging.getLogger(name) for name in QUOTING_LOGGERS), *logging.getLogger().handlers]
