"""Triton compiles a kernel only if every global it reads is a constexpr, a jitted function or a module;
its interpreter (the CPU tests) accepts any global. So this checks, for every kernel in `ops.triton`, the
names its source reads that are neither its parameters nor assigned in it."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")
tl = pytest.importorskip("triton.language")

import ops.triton  # noqa: E402


def kernels() -> list[tuple[str, object]]:
    found = []
    for info in pkgutil.iter_modules(ops.triton.__path__):
        module = importlib.import_module(f"ops.triton.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.JITFunction) and value.__module__ == module.__name__:
                found.append((f"{module.__name__}.{name}", value))
    return found


def free_names(fn: object) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))  # type: ignore[attr-defined]
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef)
    bound = {a.arg for a in func.args.args}
    loads = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name):
            (bound.add if isinstance(node.ctx, ast.Store) else loads.add)(node.id)
    return loads - bound


def allowed(value: object) -> bool:
    return isinstance(value, (tl.constexpr, triton.runtime.JITFunction, types.ModuleType)) or \
        value in (triton.language,) or (isinstance(value, type) and value.__module__.startswith("triton"))


@pytest.mark.parametrize("name, kernel", kernels(), ids=[k[0] for k in kernels()])
def test_kernels_read_only_constexpr_globals(name: str, kernel: object) -> None:
    module = inspect.getmodule(kernel.fn)  # type: ignore[attr-defined]
    bad = [g for g in sorted(free_names(kernel)) if not hasattr(builtins, g)
           and not allowed(getattr(module, g, None))]
    assert not bad, f"{name} reads globals Triton will not compile: {bad} (make them tl.constexpr)"
