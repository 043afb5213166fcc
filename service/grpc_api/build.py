"""The wheel build step (pyproject's `[tool.setuptools.cmdclass]`): copies `proto/` into the package and
generates the stubs next to it, so an installed server neither needs the checkout nor a compiler.
An editable install skips this: `stubs.load()` generates into the checkout on first import."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

from setuptools.command.build_py import build_py


def _stubs() -> ModuleType:
    """`stubs.py` loaded from its file: the build environment cannot import the `service` package."""
    spec = importlib.util.spec_from_file_location("_moecache_grpc_stubs", Path(__file__).with_name("stubs.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        stubs = _stubs()
        package = Path(self.build_lib) / "service" / "grpc_api"
        shutil.copytree(stubs.CHECKOUT_PROTO, package / "proto", dirs_exist_ok=True)
        shutil.rmtree(package / "_gen", ignore_errors=True)  # never ship stubs of an earlier build
        stubs.generate(package / "proto", package / "_gen")
