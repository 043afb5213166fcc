"""Command-line options generated from the config dataclasses, and the config built back from them.

A dataclass field becomes an option when its metadata names a flag:
`field(default=8, metadata={"flag": "--cache-promote-per-step", "help": "...", "metavar": "N"})`.
The field's type gives the option's type (`X | None` takes an X; a bool is a switch that sets True),
its default is the option's default, `choices` and `hidden` are optional. Every option can also come
from a `MOECACHE_<OPTION>` environment variable (`apply_env_defaults`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from service.engine_setup import RoutingOptions

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Option:
    """One flagged field of a config dataclass."""

    field: dataclasses.Field[Any]
    kind: type  # int, float, str or bool
    flags: tuple[str, ...]

    @property
    def dest(self) -> str:
        return self.flags[-1].lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return None if self.field.default is dataclasses.MISSING else self.field.default


def options_of(cls: type) -> list[Option]:
    """The flagged fields of `cls`, in order."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata:
            flag = f.metadata["flag"]
            found.append(Option(f, _value_type(hints[f.name]), (flag,) if isinstance(flag, str) else tuple(flag)))
    return found


def _value_type(hint: Any) -> type:
    """int for `int` and `int | None`; the same for float, str and bool."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    if hint not in (int, float, str, bool):
        raise TypeError(f"a flagged field must be int, float, str or bool (or one of them | None), not {hint}")
    return typing.cast(type, hint)


def add_options(group: argparse._ActionsContainer, cls: type, names: Iterable[str] | None = None) -> None:
    """An argparse option for each flagged field of `cls` (only those of `names` where given)."""
    for option in options_of(cls):
        if names is not None and option.field.name not in names:
            continue
        meta = option.field.metadata
        help_text = argparse.SUPPRESS if meta.get("hidden") else _help(meta.get("help", ""), option)
        if option.kind is bool:
            group.add_argument(*option.flags, dest=option.dest, action="store_true", default=bool(option.default),
                               help=help_text)
            continue
        group.add_argument(*option.flags, dest=option.dest, type=option.kind, default=option.default,
                           choices=meta.get("choices"), metavar=meta.get("metavar"), help=help_text)


def _help(text: str, option: Option) -> str:
    if option.default is None or option.kind is bool or "(default" in text:
        return text
    return f"{text} (default: {option.default})" if text else f"default: {option.default}"


def default_of(cls: type, name: str) -> Any:
    """The default of field `name` of `cls`, for an option a command writes by hand."""
    found = next(f for f in dataclasses.fields(cls) if f.name == name)
    return None if found.default is dataclasses.MISSING else found.default


def from_options(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """`cls` with its flagged fields from `args` and the rest from `given` (or their defaults)."""
    values = {o.field.name: getattr(args, o.dest) for o in options_of(cls)}
    return cls(**{**values, **given})


def add_engine_options(p: argparse.ArgumentParser) -> None:
    add_options(p.add_argument_group("model"), ModelConfig)
    add_options(p.add_argument_group("expert placement and cache"), CacheConfig)
    batching = p.add_argument_group("batching")
    add_options(batching, SchedulerConfig)
    add_options(batching, RoutingOptions)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    model = from_options(ModelConfig, args)
    scheduler = from_options(SchedulerConfig, args, max_model_len=model.max_context)
    return EngineConfig(model, from_options(CacheConfig, args), scheduler)


def env_name(dest: str) -> str:
    return f"MOECACHE_{dest.upper()}"


def apply_env_defaults(p: argparse.ArgumentParser) -> None:
    """`MOECACHE_<DEST>` sets the default of option `--<dest>`; an empty value keeps the built-in default.

    The value is converted and checked against the choices only when this command's arguments are
    parsed, so a bad one is a usage error of that command naming the variable, not a crash of every
    command."""
    for action in p._actions:
        name = env_name(action.dest)
        value = os.environ.get(name, "")
        if not value or action.dest == "help":
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.lower() in ("1", "true", "yes", "on")
        else:
            # NOTE: argparse passes a string default through `type` at parse time.
            action.type = _checked(action.type if callable(action.type) else None, action.choices, name)
            action.default = value


def _checked(convert: Callable[[str], Any] | None, choices: Iterable[Any] | None,
             name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = convert(text) if convert else text
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} (from the flag or {name})") from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} (from the flag or {name}) is not one of "
                                             f"{', '.join(map(str, choices))}")
        return value

    return parse
