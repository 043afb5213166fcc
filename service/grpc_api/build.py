"""The wheel build step (pyproject's `[tool.setuptools.cmdclass]`): copies `proto/` into the package and
generates the stubs next to it, so an installed server neither needs the checkout nor a compiler.
An editable install skips this: `stubs.load()` generates into the checkout on first import."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools.command.build_py import build_py

from service.grpc_api import stubs


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        package = Path(self.build_lib) / "service" / "grpc_api"
        shutil.copytree(stubs.CHECKOUT_PROTO, package / "proto", dirs_exist_ok=True)
        shutil.rmtree(package / "_gen", ignore_errors=True)  # never ship stubs of an earlier build
        stubs.generate(package / "proto", package / "_gen")
