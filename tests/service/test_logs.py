"""Log records pass through the redaction of `service.logs`: no API key, Authorization value or database
password reaches a handler, and a client's malformed request is one warning line."""

from __future__ import annotations

import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage

from service import logs

KEY = "s3cret-key"


@pytest.fixture
def redacted(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    redact = logs.Redact(logs.secrets_of(KEY, "postgresql://moe:pa55w0rd@db:5432/jobs"))
    logs.install(redact)
    caplog.set_level(logging.DEBUG)
    yield logging.getLogger("aiohttp.server")
    logs.uninstall(redact)


def test_the_key_and_authorization_values_are_redacted_from_messages(
        redacted: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    redacted.info("request with %s", f"Authorization: Bearer {KEY}x")
    redacted.info("key %s and url %s", KEY, "postgresql://moe:pa55w0rd@db:5432/jobs")
    text = caplog.text
    assert KEY not in text and "pa55w0rd" not in text and "Bearer" not in text
    assert text.count(logs.REDACTED) == 3 and "postgresql://moe:[redacted]@db" in text


def test_the_key_is_redacted_from_tracebacks(redacted: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    try:
        raise ValueError(f"bad header {KEY!r}")
    except ValueError:
        logging.getLogger("service.openai.errors").exception("unexpected error")
    assert "ValueError" in caplog.text and KEY not in caplog.text


def test_a_malformed_request_is_one_warning_line(redacted: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    error = BadHttpMessage(f"Invalid header value char:\n\n  b'Authorization: Bearer {KEY}\\x01'\n   ^")
    redacted.error("Error handling request from %s", "127.0.0.1", exc_info=error)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None and not record.exc_text
    assert record.getMessage() == "Error handling request from 127.0.0.1: Invalid header value char:"
    assert KEY not in caplog.text


def test_a_server_without_secrets_has_nothing_to_redact() -> None:
    assert logs.secrets_of(None, "sqlite:////var/jobs.db") == []
    assert logs.secrets_of(KEY, "postgresql://moe@db/jobs") == [KEY]
