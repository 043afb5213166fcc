"""`moecache serve` flags of the gRPC server and the jobs -> ServeOptions."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cli import build_parser, main
from service.commands.serve import serve_options


def test_grpc_and_job_flags_reach_the_options() -> None:
    args = build_parser().parse_args([
        "serve", "--grpc-port", "0", "--jobs-db", "postgresql://db/jobs", "--job-concurrency", "3",
        "--job-lease", "7.5", "--max-queued-jobs", "9", "--max-file-bytes", "4096"])
    options = serve_options(args)
    assert options.grpc_port == 0 and options.jobs is not None
    jobs = options.jobs
    assert (jobs.db_url, jobs.worker.concurrency, jobs.worker.lease_s) == ("postgresql://db/jobs", 3, 7.5)
    assert (jobs.max_queued_jobs, jobs.max_file_bytes) == (9, 4096)
    assert serve_options(build_parser().parse_args(["serve", "--no-grpc"])).grpc_port is None
    assert serve_options(build_parser().parse_args(["serve"])).grpc_port == 50051


def test_the_default_job_store_is_sqlite_in_the_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOECACHE_CACHE_DIR", str(tmp_path))
    jobs = serve_options(build_parser().parse_args(["serve"])).jobs
    assert jobs is not None and jobs.db_url == f"sqlite:///{tmp_path / 'jobs.db'}"
    monkeypatch.setenv("MOECACHE_JOBS_DB", "sqlite:////srv/jobs.db")
    assert serve_options(build_parser().parse_args(["serve"])).jobs.db_url == "sqlite:////srv/jobs.db"  # type: ignore[union-attr]


def test_bad_job_flags_are_clean_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--job-concurrency", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert main(["serve", "--job-lease", "0"]) == 2
    assert "positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--no-grpc", "--grpc-port", "1"])
