"""What a shard's worker prints, sorted for people: the pipeline's messages for the task log, the engine's output
(vLLM's start-up lines, its engine core's, the libraries' logs and warnings) for an engine log of its own, and the
engine's warnings surfaced in the task log as one line each, named by their source (``vllm: <warning>``).

The worker marks its own messages (``worker_child.SAY_PREFIX``, ``WARN_PREFIX``); every other line is the
engine's. ``EngineLog`` is where those lines go in a task: a file in the run's ``logs/`` folder (written where the
run folder is on this machine, else locally and copied there when the worker is done)."""
from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from batch_llm.io.storage import Location, atomic_writer, is_local

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# A line of a library's log rather than a stage's message (colours removed first): vLLM's
# "(EngineCore_DP0 pid=7) INFO 11-30 12:00:01 [file.py:12] ...", Python logging's "2026-11-30 12:00:01,123 name
# ...", transformers' "[transformers] ...", tqdm's redrawn bars.
ENGINE_LOG = re.compile(r"^(\([\w.-]+ pid=\d+\)\s*)?((DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d"
                        r"|\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d|\[transformers\])|\r|\d+%\|")
# vLLM's own format: its level, then the file that logged it; the engine core's lines carry its process name
VLLM_WARNING = re.compile(r"^(\([\w.-]+ pid=\d+\)\s*)?(WARNING|WARN|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d"
                          r"(\.\d+)?\s+\[[^\]]*\]\s*(?P<msg>.*)$")
# Python logging as the worker formats it (worker_child: "%(asctime)s %(levelname)s %(name)s: %(message)s")
LOGGING_WARNING = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(,\d+)?\s+(WARNING|ERROR|CRITICAL)\s+"
                             r"(?P<name>[\w.]+):\s*(?P<msg>.*)$")
# Python's warnings, as printed ("<file>:<line>: <Category>: <message>") or captured by logging (py.warnings)
PY_WARNING = re.compile(r"(?P<file>\S+?):\d+: (?P<cat>\w*Warning): (?P<msg>.*)$")
PACKAGE_IN_PATH = re.compile(r"(?:site|dist)-packages/(?P<pkg>[A-Za-z_][\w]*)")


def engine_line(msg: str) -> bool:
    """Whether ``msg`` is a library's log line (``ENGINE_LOG``), not a stage's message."""
    return ENGINE_LOG.search(ANSI.sub("", msg)) is not None


def engine_warning(line: str) -> str | None:
    """The engine output ``line`` as one warning line named by its source (``vllm: ...``, ``transformers:
    UserWarning: ...``), or None where it is no warning."""
    text = ANSI.sub("", line).strip()
    if (m := VLLM_WARNING.match(text)) is not None:
        return f"vllm: {m['msg']}"
    source = None
    if (m := LOGGING_WARNING.match(text)) is not None:
        source, text = m["name"].split(".")[0], m["msg"]
    if (w := PY_WARNING.search(text)) is not None:
        pkg = PACKAGE_IN_PATH.search(w["file"])
        return f"{pkg['pkg'] if pkg else Path(w['file']).stem}: {w['cat']}: {w['msg']}"
    if source is not None and source != "py":
        return f"{source}: {text}"
    return None


class EngineLog:
    """Where a worker's engine output goes in a task: every line to the file, and each warning (``engine_warning``)
    to ``warn``, once (a repeat only to the file). A warning's continuation lines (Python prints the source line
    under it, indented) go to the file only. ``url``: where the file is once ``close`` returns (the run folder's
    ``logs/<name>.log``)."""

    def __init__(self, run_dir: Location, name: str, warn: Callable[[str], None]):
        self.target = run_dir.child("logs", f"{name}.log")
        target = self.target.path()
        self._local: Path = Path(target.path) if is_local(target) else \
            Path(tempfile.mkdtemp(prefix="batch_llm_engine_log_")) / f"{name}.log"
        self._copy = not is_local(target)
        self._local.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = open(self._local, "a", encoding="utf-8", buffering=1)
        self.warn = warn
        self.lines = self.warnings = self.repeats = 0
        self._seen: set[str] = set()

    @property
    def url(self) -> str:
        return self.target.url

    def __call__(self, line: str) -> None:
        if self._file is None:
            return
        self._file.write(line + "\n")
        self.lines += 1
        if line[:1].isspace():  # a warning's source line, a traceback's frame: part of the line above
            return
        if (w := engine_warning(line)) is not None:
            if w in self._seen:  # vLLM says some once per worker thread: once in the task log is enough
                self.repeats += 1
                return
            self._seen.add(w)
            self.warnings += 1
            self.warn(w)

    def note(self, msg: str) -> None:
        """A pipeline message written into the engine log too, so the engine's lines read in context."""
        if self._file is not None:
            self._file.write(f"[batch-llm {time.strftime('%H:%M:%S')}] {msg}\n")

    def close(self) -> None:
        """Closes the file; where the run folder is elsewhere, copies it there (a failed copy is said, not raised:
        the shard's outcome does not depend on its log)."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if not self._copy:
            return
        try:
            with open(self._local, "rb") as src, atomic_writer(self.target.path()) as dst:
                shutil.copyfileobj(src, dst)
        except Exception as e:  # noqa: BLE001 - the shard's outcome does not depend on its log
            self.warn(f"batch-llm: the engine log could not be copied to {self.url}: {type(e).__name__}: {e}")
        finally:
            shutil.rmtree(self._local.parent, ignore_errors=True)

    def __enter__(self) -> "EngineLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
