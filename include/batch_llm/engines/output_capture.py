"""Capturing the output of this process and of the engine processes it starts: vLLM's engine core reports why
it failed on its own stdout/stderr, and the memory back-off (``classify_start_failure``) needs that text."""
from __future__ import annotations

import os
import sys
import threading
from collections import deque
from contextlib import contextmanager


class OutputTail:
    """Tees this process's stdout and stderr (and so the engine processes it starts) through a pipe, keeping
    the last lines. vLLM's engine core reports why it failed on its own output, and the exception the caller
    gets only says "see root cause above": the memory back-off needs that cause."""

    def __init__(self, lines: int = 300):
        self.lines: deque[str] = deque(maxlen=lines)
        self._thread: threading.Thread | None = None

    @contextmanager
    def capture(self):
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        r, w = os.pipe()
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        self._thread = threading.Thread(target=self._pump, args=(r, os.dup(saved[0])), daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)

    def _pump(self, r: int, out: int) -> None:
        # Runs until every writer is gone: engine processes started under capture() keep writing here.
        with os.fdopen(r, "rb") as f:
            for raw in f:
                self.lines.append(raw.decode("utf-8", "replace"))
                try:
                    os.write(out, raw)
                except OSError:
                    pass

    def text(self, settle_seconds: float = 5.0) -> str:
        """The captured tail, after waiting briefly for a failed engine's last words."""
        if self._thread is not None:
            self._thread.join(timeout=settle_seconds)
        return "".join(self.lines)
