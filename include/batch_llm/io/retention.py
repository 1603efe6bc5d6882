"""What publish may delete in a partition, and the proof it asks for first.

A partition folder holds ``_CURRENT.json`` and the version folders publish wrote. Only a folder proven to be a
version of this partition is ever deleted:

- it is a direct child of the partition's folder (``<pipeline>/<partition>/<name>``, compared as the store
  resolves it), not a symlink;
- its name is one publish gives (``VERSION_NAME``: ``v-<UTC start>-<run>-<random>``);
- it holds ``_VERSION.json``, the marker publish writes into a version before anything else, naming this
  pipeline, this partition and the folder's own name.

A URL in the pointer's ``history`` (a version two switches old) that fails any of these is skipped with a warning,
whatever it names (a pointer edited or corrupted must not delete data). Versions the pointer names now, and the
run's own version, are never deleted.

Orphans (the version folders of publishers killed before their switch, and temporary files of killed writes in
the partition folder) are removed by the next publish of the partition once nothing in them changed for the
grace period (``output.orphan_grace_hours``): a version another run is still writing has changed recently, and a
publisher checks that its version is still there before it switches to it.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field

from upath import UPath

from batch_llm.io.storage import Location, exists, is_local, modified_at, newest_change, remove_tree, write_json

log = logging.getLogger("batch_llm.stages.publish")

VERSION_MARKER = "_VERSION.json"
VERSION_NAME = re.compile(r"v-\d{8}T\d{12}-[A-Za-z0-9]{0,12}-[0-9a-f]{6}")


def new_version_name(run_id: str) -> str:
    """A new version's folder: its UTC start to the microsecond (names sort by age), the run, and a random
    tail (two publishes of one run never share a folder). Matches ``VERSION_NAME``."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    return f"v-{stamp}-{re.sub(r'[^A-Za-z0-9]', '', run_id)[-12:]}-{uuid.uuid4().hex[:6]}"


def _name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


class VersionGone(RuntimeError):
    """The run's own version folder was removed before its pointer switch."""


@dataclass(frozen=True)
class Partition:
    """One partition of one pipeline: where its versions live and the identity their markers carry."""

    location: Location   # <output.path>/<pipeline>/<partition>
    pipeline: str
    partition: str

    def write_marker(self, version: Location, run_id: str) -> None:
        """The first file of a new version: what makes it deletable later (and nothing else is)."""
        write_json(version.child(VERSION_MARKER).path(),
                   {"pipeline": self.pipeline, "partition": self.partition, "version": _name(version.url),
                    "run_id": run_id, "created_at": dt.datetime.now(dt.timezone.utc).isoformat()})

    def require(self, version: Location) -> None:
        """Raises ``VersionGone`` unless the version's marker is still there (checked before each switch)."""
        if not exists(version.child(VERSION_MARKER).path()):
            raise VersionGone(f"{version.url}: this run's version was removed before its pointer switch (superseded "
                              f"twice since, or removed as an orphan after output.orphan_grace_hours); publish again")

    def proven_version(self, url: str) -> tuple[UPath | None, str]:
        """The folder to delete for ``url`` when it is proven a version of this partition, else (None, why not)."""
        name = _name(url)
        if not VERSION_NAME.fullmatch(name):
            return None, "its name is not a version's"
        target = self.location.child(name).path()
        try:
            given = Location(url, self.location.options).path()
        except Exception as e:  # noqa: BLE001 - an unreadable URL is simply not proven
            return None, f"unreadable URL ({type(e).__name__})"
        if getattr(given, "protocol", "") != getattr(target, "protocol", "") \
                or given.path.rstrip("/") != target.path.rstrip("/"):
            return None, f"not a folder directly under {self.location.url}"
        if is_local(target) and os.path.islink(target.path):
            return None, "a symbolic link"
        try:
            marker = json.loads(target.joinpath(VERSION_MARKER).read_bytes())
        except FileNotFoundError:
            return None, f"no {VERSION_MARKER}"
        except Exception as e:  # noqa: BLE001
            return None, f"unreadable {VERSION_MARKER} ({type(e).__name__})"
        if not isinstance(marker, dict) or (marker.get("pipeline"), marker.get("partition"), marker.get("version")) \
                != (self.pipeline, self.partition, name):
            return None, f"its {VERSION_MARKER} names another version"
        return target, ""


@dataclass
class Housekeeping:
    """What one publish removed from its partition, and what it left though asked to remove it."""

    retired: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def tidy_partition(part: Partition, *, pointer: dict | None, own: str, retire: list[str], grace_s: float,
                   now: float | None = None) -> Housekeeping:
    """After a switch: removes the versions in ``retire`` (two switches old), then the orphans older than
    ``grace_s``. Never a version ``pointer`` (the pointer as read after the switch) names, nor ``own``. A
    failure to remove is logged, not raised: the run's data is published."""
    keep = {_name(u) for u in [own, (pointer or {}).get("version") or "", *((pointer or {}).get("history") or [])]
            if isinstance(u, str) and u}
    done = Housekeeping()
    for url in retire:
        if not isinstance(url, str) or _name(url) in keep:
            continue
        target, why = part.proven_version(url)
        if target is None:
            log.warning("%s: the pointer's history names %s, which is not a version of this partition (%s): "
                        "left in place", part.location.url, url, why)
            done.skipped.append(str(url))
        elif _remove(target, "retired version"):
            done.retired.append(url)
    _sweep_orphans(part, keep, grace_s, time.time() if now is None else now, done)
    return done


def _sweep_orphans(part: Partition, keep: set[str], grace_s: float, now: float, done: Housekeeping) -> None:
    root = part.location.path()
    try:
        entries = root.fs.ls(root.path, detail=True)
    except FileNotFoundError:
        return
    for info in entries:
        name = _name(info["name"])
        if name.startswith(".") and name.endswith(".tmp") and info.get("type") == "file":
            t = modified_at(info)  # a temporary file of a killed write (the pointer's, on a local disk)
            if t is not None and now - t > grace_s and _remove(root / name, "temporary file"):
                done.orphans.append(part.location.child(name).url)
            continue
        if name in keep or not VERSION_NAME.fullmatch(name):
            continue
        url = part.location.child(name).url
        target, why = part.proven_version(url)
        if target is None:
            log.info("%s: %s is not proven a version of this partition (%s): left in place", part.location.url,
                     name, why)
            continue
        try:
            changed = newest_change(target)
        except Exception as e:  # noqa: BLE001
            log.warning("could not list %s: %s", url, e)
            continue
        if changed is not None and now - changed > grace_s and _remove(target, "orphaned version"):
            done.orphans.append(url)


def _remove(path: UPath, what: str) -> bool:
    try:
        if path.is_file():
            path.unlink()
        else:
            remove_tree(path)
        log.info("removed the %s %s", what, path)
        return True
    except Exception as e:  # noqa: BLE001 - retention is housekeeping
        log.warning("could not remove the %s %s: %s", what, path, e)
        return False
