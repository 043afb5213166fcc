"""Build-and-load of the C kernels in `ops/csrc`.

A source is compiled at first use with the system C compiler (`$CC`, default `cc`) into
`$MOECACHE_CACHE_DIR` (default `~/.cache/moecache`), under a name keyed by a hash of every file in
`ops/csrc`, the compiler, its flags and the machine, and loaded with ctypes (whose calls release the
GIL). A build that fails logs one warning and yields None, so callers can fall back to torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
BASE_FLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=c11")
COMPILE_TIMEOUT_S = 300

_lock = threading.Lock()
# (source, flags, $CC, $MOECACHE_CACHE_DIR) -> the loaded library, or None when it cannot be built
_libraries: dict[tuple[str, tuple[str, ...], str, str], ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("MOECACHE_CACHE_DIR") or Path.home() / ".cache" / "moecache")


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def _cpu_signature() -> str:
    """The CPU model and feature flags: `-march=native` output is only valid on the same kind of CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(wanted)))


def build_key(source: Path, flags: tuple[str, ...], cc: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(source.parent.glob("*.[ch]")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (*flags, cc, platform.machine(), _cpu_signature()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:20]


def _compile(source: Path, target: Path, flags: tuple[str, ...], cc: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-I", str(source.parent), str(source), "-o", tmp, "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _failure_reason(err: Exception) -> str:
    if isinstance(err, subprocess.CalledProcessError):
        return (err.stderr or "").strip()[-2000:] or f"exit status {err.returncode}"
    return str(err)


def _build_and_load(source: Path, flags: tuple[str, ...], cc: str) -> ctypes.CDLL | None:
    target = cache_dir() / f"{source.stem}-{build_key(source, flags, cc)}.so"
    try:
        if not target.exists():
            _compile(source, target, flags, cc)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("cannot build %s with %s (%s); using the slower torch path", source.name, cc, _failure_reason(err))
        return None


def load_library(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled `source`, built on first use; None (after one warning) when it cannot be built."""
    flags = BASE_FLAGS + tuple(extra_flags)
    # plain strings: this runs on every kernel call, Path and home lookups would dominate it
    key = (str(source), flags, os.environ.get("CC", ""), os.environ.get("MOECACHE_CACHE_DIR", ""))
    with _lock:
        if key not in _libraries:
            _libraries[key] = _build_and_load(source, flags, compiler())
        return _libraries[key]
