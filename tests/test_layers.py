"""The packages depend one way, service -> tools -> engine -> ops: every module of `ops` imported into a fresh
interpreter pulls in no `engine`, `tools` or `service` module, every module of `engine` no `tools` or
`service` module, and every module of `tools` no `service` module."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"ops": ("engine", "service", "tools"), "engine": ("service", "tools"), "tools": ("service",)}


def modules(package: str) -> list[str]:
    found = [package]
    for info in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
        if not info.name.split(".")[-1].startswith("_"):
            found.append(info.name)
    return found


CHECK = """
import importlib, sys
for module in {modules!r}:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:  # an optional package (Triton) that is not installed
        if e.name != 'triton':
            raise
        continue
    bad = sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})
    if bad:
        print(module, 'pulls in', ', '.join(bad))
        break
"""


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_never_imports_the_layers_above_it(package: str) -> None:
    code = CHECK.format(modules=modules(package), forbidden=FORBIDDEN[package])
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not result.stdout.strip(), f"{package} imports a layer above it: {result.stdout.strip()}"
