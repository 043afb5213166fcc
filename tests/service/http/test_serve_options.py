"""`moecache serve` flags and environment defaults -> the engine config and the server options."""

from __future__ import annotations

import pytest

from service.cli import build_parser, main
from service.commands.serve import serve_config, serve_options


def test_flags_reach_the_config_and_the_limits() -> None:
    args = build_parser().parse_args([
        "serve", "--max-context", "300", "--port", "0", "--max-tokens-limit", "99", "--max-concurrent-requests", "3",
        "--max-queued-requests", "0", "--max-body-bytes", "1000", "--max-stop-strings", "2", "--max-n", "5",
        "--shutdown-timeout", "1.5", "--served-model-name", "m"])
    options = serve_options(args)
    assert (options.port, options.model_name, options.shutdown_timeout, options.api_key) == (0, "m", 1.5, None)
    limits = options.limits
    assert (limits.max_tokens, limits.max_concurrent_requests, limits.max_queued_requests) == (99, 3, 0)
    assert (limits.max_body_bytes, limits.max_stop_strings, limits.max_n) == (1000, 2, 5)
    config = serve_config(args)
    assert config.model.max_context == 300 and config.scheduler.max_model_len == 300 and config.model.path is None
    assert serve_config(build_parser().parse_args(["serve", "-c", "200"])).model.max_context == 200


def test_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOECACHE_API_KEY", "from-env")
    assert serve_options(build_parser().parse_args(["serve"])).api_key == "from-env"
    assert serve_options(build_parser().parse_args(["serve", "--api-key", "flag"])).api_key == "flag"


def test_a_bad_limit_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-n", "0"]) == 2
    assert "max_n must be at least 1" in capsys.readouterr().err
