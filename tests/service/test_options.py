"""Options from the config dataclasses and `MOECACHE_<OPTION>` environment defaults: every flagged field is
a serve flag with the field's default, every serve flag has a variable, values are checked like flags, an
empty value keeps the default, and a bad value only fails the command that uses it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine.config import CacheConfig
from service.cli import build_parser, main
from service.commands.serve import serve_config, serve_options
from service.options import add_options, apply_env_defaults, env_name, from_options, options_of


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def serve_flags() -> list[argparse.Action]:
    return [a for a in serve_parser()._actions if a.help != argparse.SUPPRESS and a.dest != "help"]


def sample(action: argparse.Action) -> tuple[str, object]:
    """A value other than the default for the flag's variable, and what the parsed option should be."""
    if isinstance(action, argparse._StoreTrueAction):
        return "true", True
    if action.choices:
        choice = list(action.choices)[-1]
        return str(choice), choice
    if action.type in (int, float):
        return "7", action.type("7")
    return "/some/value", "/some/value"


def test_every_serve_flag_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = {}
    for action in serve_flags():
        text, expected[action.dest] = sample(action)
        monkeypatch.setenv(env_name(action.dest), text)
    args = vars(build_parser().parse_args(["serve"]))
    assert {dest: args[dest] for dest in expected} == expected


def test_variables_reach_the_server_options_and_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"MOECACHE_HOST": "0.0.0.0", "MOECACHE_PORT": "8001", "MOECACHE_API_KEY": "k",
                        "MOECACHE_SHUTDOWN_TIMEOUT": "2.5", "MOECACHE_MAX_N": "3", "MOECACHE_MODEL": "/models/m.gguf",
                        "MOECACHE_MAX_CONTEXT": "400", "MOECACHE_CPU_MOE": "1", "MOECACHE_MISS_MODE": "hybrid",
                        "MOECACHE_MOE_CACHE_MIB": "64", "MOECACHE_CACHE_FREE_SLOTS": "4"}.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve"])
    options, config = serve_options(args), serve_config(args)
    assert (options.host, options.port, options.api_key, options.shutdown_timeout) == ("0.0.0.0", 8001, "k", 2.5)
    assert options.limits.max_n == 3
    assert (config.model.path, config.model.max_context, config.cache.budget_mib) == ("/models/m.gguf", 400, 64)
    assert config.cache.cpu_moe is True and config.cache.miss_mode == "hybrid" and config.cache.free_slots == 4


def test_a_flag_beats_its_variable_and_empty_keeps_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOECACHE_PORT", "8001")
    monkeypatch.setenv("MOECACHE_MOE_CACHE_MIB", "")
    monkeypatch.setenv("MOECACHE_CACHE_POLICY", "")
    assert build_parser().parse_args(["serve", "--port", "9"]).port == 9
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.moe_cache_mib, args.cache_policy) == (8001, None, CacheConfig().policy)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("MOECACHE_PORT", "eighty", "invalid value 'eighty' (from the flag or MOECACHE_PORT)"),
    ("MOECACHE_MISS_MODE", "gpu", "'gpu' (from the flag or MOECACHE_MISS_MODE) is not one of cpu, stream, hybrid"),
    ("MOECACHE_CACHE_TYPE_K", "f32", "'f32' (from the flag or MOECACHE_CACHE_TYPE_K) is not one of bf16, q8_0, q4_0"),
])
def test_a_bad_variable_is_a_usage_error_of_its_command(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], name: str, value: str,
                                                         message: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        main(["serve"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    # another command, which has no such option, is not affected
    assert build_parser().parse_args(["synth", "x.gguf"]).command == "synth"


def test_kv_cache_types_per_k_and_v_and_a_bad_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "q8_0", "-ctv", "q4_0"])
    assert serve_config(args).model.kv_types == ("q8_0", "q4_0")
    args = build_parser().parse_args(["serve", "--cache-type-k", "q4_0"])
    assert serve_config(args).model.kv_types == ("q4_0", "bf16")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--kv-cache-dtype", "q5_0"])
    assert exit_.value.code == 2 and "argument --kv-cache-dtype: invalid choice: 'q5_0'" in capsys.readouterr().err


def flagged_classes() -> list[type]:
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from service.jobs.run import WorkerOptions
    from service.jobs.runtime import JobOptions
    from service.openai.limits import Limits
    from service.server import ServeOptions

    return [ModelConfig, CacheConfig, SchedulerConfig, EngineConfig, ServeOptions, Limits, JobOptions, WorkerOptions]


@pytest.mark.parametrize("cls", flagged_classes(), ids=lambda c: c.__name__)
def test_each_flagged_field_is_a_serve_option_with_the_field_default(cls: type) -> None:
    actions = {a.dest: a for a in serve_parser()._actions}
    for option in options_of(cls):
        action = actions[option.dest]
        assert option.flags == tuple(action.option_strings), option.dest
        assert action.default == option.default, option.dest  # one default: the field's


def test_a_field_with_a_flag_in_its_metadata_becomes_an_option_and_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(frozen=True)
    class Knobs:
        depth: int = dataclasses.field(default=3, metadata={"flag": "--knob-depth", "help": "how deep"})
        label: str | None = dataclasses.field(default=None, metadata={"flag": "--knob-label"})
        is_on: bool = dataclasses.field(default=False, metadata={"flag": "--knob-on"})
        hidden: float = 0.5  # no flag: no option

    parser = argparse.ArgumentParser()
    add_options(parser, Knobs)
    assert "how deep (default: 3)" in parser.format_help() and "--hidden" not in parser.format_help()
    assert from_options(Knobs, parser.parse_args([])) == Knobs()
    assert from_options(Knobs, parser.parse_args(["--knob-depth", "5", "--knob-on"])) == Knobs(5, None, True)
    monkeypatch.setenv("MOECACHE_KNOB_LABEL", "x")
    apply_env_defaults(parser)
    assert from_options(Knobs, parser.parse_args([]), hidden=2.0) == Knobs(3, "x", False, 2.0)
