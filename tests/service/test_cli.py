"""The `moecache` command line: a command whose package is missing names the package, whatever options it
is given; the other commands still parse strictly."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest

from service import cli

BLOCK_GRPC = "import sys; sys.modules['grpc'] = None; from service.cli import main; sys.exit(main(sys.argv[1:]))"


def without(module: str, command: str):  # noqa: ANN201
    real = cli.import_command

    def import_command(name: str) -> ModuleType:
        if name == command:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)
        return real(name)
    return import_command


def test_missing_grpc_names_grpcio_for_serve_with_its_options() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCK_GRPC, "serve", "-m", "model.gguf", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs the Python package grpcio" in done.stderr
    assert "unrecognized arguments" not in done.stderr


def test_missing_package_is_named_by_its_distribution(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "import_command", without("prometheus_client.core", "serve"))
    assert cli.main(["serve", "--moe-cache-mib", "8", "--no-grpc"]) == 2
    err = capsys.readouterr().err
    assert "`moecache serve` needs the Python package prometheus-client" in err
    assert "pip install 'prometheus-client'" in err


def test_other_commands_still_refuse_unknown_options(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "import_command", without("aiohttp", "serve"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "model.gguf", "--no-such-option"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_a_missing_module_of_our_own_is_a_bug_not_a_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "import_command", without("service.nothing_here", "serve"))
    with pytest.raises(ModuleNotFoundError):
        cli.build_parser()
