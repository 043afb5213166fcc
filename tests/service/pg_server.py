"""A throwaway PostgreSQL server for tests, and the pytest fixtures that share it.

The server is started once per test session with the installed `initdb`/`pg_ctl` (as the `postgres`
user when the tests run as root, since PostgreSQL refuses root), listens on a free loopback port with
trust auth, and is deleted at the end. Each test gets a fresh schema (`postgres_url`); a whole
database is there too (`create_database`). Use from a conftest.py:

    sys.path.insert(0, str(Path(__file__).resolve().parents[N]))  # the folder holding pg_server.py
    from pg_server import postgres_server, postgres_url  # noqa: F401  (fixtures)

Set MOECACHE_REQUIRE_POSTGRES=1 (CI) to fail instead of skip when no server is installed.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

INSTALL_HINT = "PostgreSQL server not installed: apt-get install postgresql"
START_TIMEOUT_S = 30


class PostgresUnavailable(Exception):
    pass


@dataclass(frozen=True)
class PostgresServer:
    bin_dir: Path
    root: Path  # holds data/, the unix socket and the logs; owned by `user`
    port: int
    user: str | None  # the account the server runs as when the tests run as root

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_schema(self) -> str:
        """A new empty schema in the `postgres` database; returns a URL whose connections use it.
        Much cheaper than a database (no file copy), and as isolated for tables."""
        name = f"test_{uuid.uuid4().hex}"
        self._admin(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        return f"{self.url()}?options=-csearch_path%3D{name}"

    def drop_schema(self, url: str) -> None:
        name = url.rsplit("%3D", 1)[1]
        self._admin(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))

    def create_database(self) -> str:
        """A new empty database, for tests that need more than a schema; returns its URL."""
        name = f"test_{uuid.uuid4().hex}"
        self._admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        # FORCE: a test may leave connections open (e.g. a store it meant to abandon)
        self._admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def stop(self) -> None:
        _run(self, "pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def _admin(self, statement: sql.Composed) -> None:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(statement)


def find_bin_dir() -> Path | None:
    """The newest installed server's bin folder (Debian's versioned folders, then PATH)."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_major_version, reverse=True)
    found = candidates[0] if candidates else shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl", path=str(Path(found).parent)) else None


def start_postgres() -> PostgresServer:
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise PostgresUnavailable(INSTALL_HINT)
    user = _server_user()
    root = Path(tempfile.mkdtemp(prefix="moecache-pg-"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    server = PostgresServer(bin_dir=bin_dir, root=root, port=_free_port(), user=user)
    try:
        _init_and_start(server)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return server


def _init_and_start(server: PostgresServer) -> None:
    data = str(server.root / "data")
    _run(server, "initdb", "-D", data, "-U", "postgres", "--auth=trust", "--no-locale", "-E", "UTF8", "-N")
    # durability settings off: a test server's data is thrown away, and fsyncs would dominate runtime
    options = (
        f"-h 127.0.0.1 -p {server.port} -k {server.root} -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    )
    log = str(server.root / "server.log")
    _run(server, "pg_ctl", "-D", data, "-l", log, "-w", "-t", str(START_TIMEOUT_S), "-o", options, "start")


def _run(server: PostgresServer, program: str, *args: str) -> None:
    command = [str(server.bin_dir / program), *args]
    if server.user is not None:
        command = ["runuser", "-u", server.user, "--", *command]
    # output goes to a file, not a pipe: the postmaster pg_ctl starts inherits it and never closes it
    out_path = server.root / f"{program}.out"
    with open(out_path, "wb") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=server.root, check=False)
    if done.returncode != 0:
        raise PostgresUnavailable(f"{program} failed ({done.returncode}): {_tail(out_path, server.root)}")


def _tail(out_path: Path, root: Path) -> str:
    texts = [p.read_text(errors="replace") for p in (out_path, root / "server.log") if p.exists()]
    return "\n".join(texts)[-2000:]


def _server_user() -> str | None:
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresUnavailable("running as root and there is no 'postgres' user to run the server") from None
    if shutil.which("runuser") is None:
        raise PostgresUnavailable("running as root and runuser (util-linux) is missing")
    return "postgres"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _major_version(initdb_path: str) -> int:
    version = Path(initdb_path).parent.parent.name
    return int(version) if version.isdigit() else 0


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    try:
        server = start_postgres()
    except PostgresUnavailable as exc:
        if os.environ.get("MOECACHE_REQUIRE_POSTGRES") == "1":
            raise
        pytest.skip(str(exc))
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A URL to a fresh, empty schema on the session's server (`search_path` is set in the URL)."""
    url = postgres_server.create_schema()
    yield url
    postgres_server.drop_schema(url)
