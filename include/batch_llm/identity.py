"""What a stage's committed work was made from: fingerprints of files in storage and the keys that decide reuse.

A run's folder is the same for every retry and every *Clear* of one DAG run, so a stage that finds its own
committed work there must tell whether it still holds. It holds when it was made from the same things: the
plan from the same input files (names, sizes, and what the store says changes with the content: an S3 ETag, a
local file's mtime, ctime and inode) and the same settings; a shard's chunks from the same plan, model and
sampling. These keys are that comparison, kept small (a hash) so they fit in a manifest.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from upath import UPath

# What fsspec's ``info()`` reports that changes when an object's content changes, per store: S3 and GCS an
# ETag / md5 / generation, a local file its mtime, ctime ("created") and inode (a file replaced by a rename gets
# a new inode even when size and mtime were copied over with it).
_CHANGE_FIELDS = ("ETag", "etag", "md5Hash", "md5", "generation", "VersionId", "mtime", "created", "ino",
                  "LastModified", "last_modified", "updated")


def stable_hash(obj: Any) -> str:
    """SHA-256 of the object's canonical JSON (sorted keys): the same value gives the same key in any process."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str, ensure_ascii=False).encode()).hexdigest()


def file_fingerprint(path: UPath) -> dict[str, str]:
    """The file's size and its store's change markers, as strings (``info()`` of the file's filesystem)."""
    info = path.fs.info(path.path)
    marks = {k: str(info[k]) for k in _CHANGE_FIELDS if info.get(k) is not None}
    return {"name": path.name, "size": str(info.get("size")), **marks}


def files_key(files: Iterable[UPath]) -> str:
    """One key for a set of files: changes when a file is added, removed, renamed or rewritten."""
    return stable_hash([file_fingerprint(f) for f in files])
