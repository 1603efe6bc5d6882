"""A partition's ``_CURRENT.json``, switched by compare-and-swap: two runs of one day never both win.

Two runs can publish one partition at once (a manual run beside the scheduled one, a backfill with
``reprocess``). Each writes its version folder first, then switches the pointer from the state it read to its
own version. The switch is conditional:

- on S3-compatible stores, a conditional PUT: ``If-Match: <ETag read>``, or ``If-None-Match: *`` when there was
  no pointer yet; the store refuses it (412) when another run switched in between;
- on a local (or mounted) file system, under an exclusive ``flock`` on ``.<name>.lock`` beside the pointer,
  opened without following symlinks, the content compared again before the atomic rename.

A refused switch reads the pointer again and tries once more from the new state: the last run to finish is
current, and it knows exactly which version it replaced, so retention can remove only versions that were
current once and are now two replacements old (``PointerState.history``), never one that a run is still writing.
A refusal of a write that had in fact landed (a lost reply, retried) is recognised by the version the pointer
names, so a run never replaces its own version nor puts it into its own history (``switch_pointer``). What
retention may delete, and the proof it asks for: ``batch_llm.io.retention``.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from upath import UPath

from batch_llm.io.storage import exists, is_local, write_bytes_atomic

log = logging.getLogger("batch_llm.stages.publish")


class PointerConflict(RuntimeError):
    """Another run switched the pointer between our read and our write."""


@dataclass(frozen=True)
class PointerState:
    """The pointer as read: its JSON (None when there is none yet) and the token a conditional write needs
    (the store's ETag, or a local file's SHA-256)."""

    value: dict[str, Any] | None
    token: str | None

    @property
    def version(self) -> str | None:
        return (self.value or {}).get("version")

    @property
    def seq(self) -> int:
        return int((self.value or {}).get("seq") or 0)

    @property
    def history(self) -> list[str]:
        """Versions that were current once and are still kept, newest first (the current one not included)."""
        return list((self.value or {}).get("history") or [])

    @property
    def switched(self) -> list[str]:
        """The versions of the latest switches, newest first (the current one included): they survive their
        retention, so a switch whose reply was lost still finds its write (``switch_pointer``)."""
        return [v for v in (self.value or {}).get("switched") or [] if isinstance(v, str)]


def _is_s3(path: UPath) -> bool:
    return getattr(path, "protocol", "") in ("s3", "s3a")


def read_pointer(path: UPath) -> PointerState:
    if _is_s3(path):
        if not exists(path):
            return PointerState(None, None)
        # The ETag first, then the body: should the pointer change in between, the body is the newer one and
        # the conditional PUT on the older ETag fails, so a value built from a stale body is never written.
        etag = path.fs.info(path.path, refresh=True).get("ETag")
        return PointerState(json.loads(path.fs.cat_file(path.path)), etag)
    try:  # a local file (or another store): the token is the content's hash
        data = path.read_bytes()
    except FileNotFoundError:
        return PointerState(None, None)
    return PointerState(json.loads(data), hashlib.sha256(data).hexdigest())


@contextlib.contextmanager
def _local_lock(path: UPath) -> Iterator[None]:
    lock = os.path.join(os.path.dirname(str(path)), f".{path.name}.lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _is_precondition_failure(e: Exception) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "precondition" in text or "pre-condition" in text or "412" in text


def write_pointer(path: UPath, expected: PointerState, value: dict[str, Any]) -> None:
    """Writes ``value`` only if the pointer is still ``expected``; raises ``PointerConflict`` otherwise."""
    data = (json.dumps(value, indent=1, ensure_ascii=False, default=str) + "\n").encode("utf-8")
    if is_local(path):
        with _local_lock(path):
            if read_pointer(path).token != expected.token:
                raise PointerConflict(str(path))
            write_bytes_atomic(path, data)
        return
    if _is_s3(path):
        cond = {"IfMatch": expected.token} if expected.token else {"IfNoneMatch": "*"}
        try:
            path.fs.pipe_file(path.path, data, **cond)
        except Exception as e:  # s3fs maps 412 PreconditionFailed to OSError(EINVAL)
            if _is_precondition_failure(e):
                raise PointerConflict(str(path)) from e
            raise
        return
    # A store without conditional writes here: compare, then write (a race window remains; said in the log).
    log.warning("%s: this store's pointer switch is not conditional; overlapping publishes may race", path)
    if read_pointer(path).token != expected.token:
        raise PointerConflict(str(path))
    write_bytes_atomic(path, data)


# How many of the latest switches' versions the pointer remembers (``PointerState.switched``): a write whose reply
# was lost is recognised as long as fewer switches than this came after it before it reads the pointer again.
SWITCHES_REMEMBERED = 16


def _landed(state: PointerState, version: str) -> bool:
    """Whether the pointer as read shows that our switch to ``version`` took effect: it names the version as
    current or as one of the latest switches (other runs switched after us). Version URLs are unique per publish."""
    return bool(version) and (version == state.version or version in state.history or version in state.switched)


def switch_pointer(path: UPath, make: Callable[[PointerState], dict[str, Any]], *, timeout: float = 600.0,
                   before_write: Callable[[PointerState], None] | None = None) -> tuple[PointerState, dict[str, Any]]:
    """Reads the pointer, builds the new value from what was read (``make``, whose ``version`` must be unique to
    this switch), writes it conditionally; on a conflict reads again after a short random pause (contenders then
    spread out). Returns (the state replaced, the value written); ``PointerConflict`` only when other publishers
    kept winning for ``timeout`` seconds.

    A conflict can also be our own write: an S3 PUT whose reply was lost, retried by the client, is refused
    (412) because the first one landed. So after a conflict the pointer read again is checked for our version
    first (current, or among the latest switches when other runs switched after us): then the switch is done, and
    the state it replaced is the one that write was made from. ``before_write`` runs before each write (publish
    checks there that its version is still there) and may raise to stop."""
    deadline = time.monotonic() + timeout
    pause = 0.01
    tried: tuple[PointerState, dict[str, Any]] | None = None
    while True:
        state = read_pointer(path)
        if tried is not None and _landed(state, str(tried[1].get("version") or "")):
            log.info("%s: the switch to %s had landed (its reply was a conflict)", path, tried[1].get("version"))
            return tried
        value = make(state)
        if value.get("version"):
            value["switched"] = [value["version"], *state.switched][:SWITCHES_REMEMBERED]
        if before_write is not None:
            before_write(state)
        try:
            write_pointer(path, state, value)
            return state, value
        except PointerConflict:
            tried = (state, value)
            if time.monotonic() > deadline:
                raise PointerConflict(f"{path}: other publishers kept switching it for {timeout:.0f} s") from None
            log.info("%s changed while publishing (another run of this partition): reading it again", path)
            time.sleep(random.uniform(0, pause))
            pause = min(pause * 2, 1.0)
