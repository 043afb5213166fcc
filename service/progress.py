"""A terminal progress bar for model loading (stderr, redrawn in place; plain lines when not a tty)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream, self.width = stream or sys.stderr, width  # the stream of the call, not of the import
        self.is_tty = self.stream.isatty()
        self._last_draw = 0.0
        self._label = ""

    def __call__(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        finished = done >= total
        if not finished and label == self._label and now - self._last_draw < 0.1:
            return
        self._label, self._last_draw = label, now
        share = done / total if total else 1.0
        if self.is_tty:
            filled = int(share * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{label:<10} [{bar}] {share:6.1%} {done / 2**20:8.0f}/{total / 2**20:.0f} MiB")
            if finished:
                self.stream.write("\n")
        elif finished:
            self.stream.write(f"{label}: {total / 2**20:.0f} MiB done\n")
        self.stream.flush()
