"""Uploaded files and batch records in object storage (a local folder by default), under one root::

    <root>/files/<file id>/content       the bytes, streamed in and out (never held whole)
    <root>/files/<file id>/file.json     the File object (written last: a file exists once it is complete)
    <root>/batches/<batch id>/batch.json       the Batch record: what POST /v1/batches was asked (written once)
    <root>/batches/<batch id>/cancel.json      when a cancel was asked (POST /v1/batches/<id>/cancel)
    <root>/batches/<batch id>/validation.json  the input file's check by the run (validate.py): counts, errors
    <root>/batches/<batch id>/stopped.json     why the run stopped its shards early (cancelled, expired)
    <root>/batches/<batch id>/files.json       the output and error file ids, once the run published them

Ids carry their creation time first (milliseconds, hex), so a listing sorted by name is in creation order and a
page (``after``, ``limit``) reads only the records it returns.
"""
from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from batch_llm.batch_api.errors import ApiError, not_found
from batch_llm.io.storage import (
    AtomicWriter,
    Location,
    exists,
    read_json,
    remove_tree,
    write_json,
)

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
#: Upload limit of the deployment, before a file names its model (each pipeline's openai_batch.max_file_bytes
#: bounds what its batches read): OpenAI's 200 MB by default.
MAX_UPLOAD_ENV = "BATCH_LLM_OPENAI_MAX_UPLOAD_BYTES"
DEFAULT_MAX_UPLOAD = 200 * 10**6
PURPOSES = ("batch",)
#: OpenAI's list limits: 1..100 for batches, 1..10,000 for files.
MAX_BATCH_PAGE, MAX_FILE_PAGE = 100, 10_000


def max_upload_bytes() -> int:
    value = os.environ.get(MAX_UPLOAD_ENV)
    return int(value) if value else DEFAULT_MAX_UPLOAD


def new_id(prefix: str) -> str:
    """``<prefix><12 hex: ms since the epoch><12 random hex>``: sorted by name is sorted by creation."""
    return f"{prefix}{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def check_id(pattern: re.Pattern, ident: str, kind: str, param: str | None = None) -> str:
    """The id, when it is one of ours; an unknown-id 404 otherwise (it also keeps ``..`` out of paths)."""
    if not isinstance(ident, str) or not pattern.fullmatch(ident):
        raise not_found(kind, str(ident)[:80], param)
    return ident


class Upload:
    """One file being uploaded: ``write`` its bytes as they arrive (413 past ``max_bytes``, nothing kept),
    ``commit`` to make it a file (its File object returned), or ``abort``."""

    def __init__(self, store: "BatchStore", meta: dict, max_bytes: int):
        self.store, self.meta, self.max_bytes = store, meta, max_bytes
        self.size = 0
        self._w = AtomicWriter(store.file_dir(meta["id"]).child("content").path())

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.max_bytes:
            self.abort()
            raise ApiError(413, f"File is too large: more than the {self.max_bytes} bytes a batch input file may "
                                "have.", param="file", code="file_too_large")
        self._w.write(data)

    def commit(self) -> dict:
        self._w.commit()
        meta = {**self.meta, "bytes": self.size}
        write_json(self.store.file_dir(meta["id"]).child("file.json").path(), meta)
        return meta

    def abort(self) -> None:
        self._w.abort()
        remove_tree(self.store.file_dir(self.meta["id"]).path())


@dataclass(frozen=True)
class BatchStore:
    """Files and batches under ``root`` (a ``Location``: a local folder or an object-store prefix with its
    credentials)."""

    root: Location

    # ------------------------------------------------------------------------------------------ files
    def file_dir(self, file_id: str) -> Location:
        return self.root.child("files", check_id(FILE_ID, file_id, "file"))

    def content_path(self, file_id: str):
        return self.file_dir(file_id).child("content").path()

    def begin_upload(self, *, owner: str, filename: str, purpose: str, max_bytes: int | None = None,
                     extra: dict | None = None) -> Upload:
        if purpose not in PURPOSES:
            raise ApiError(400, f"Invalid purpose {purpose!r}: this server takes files for batches only "
                                f"({', '.join(PURPOSES)}).", param="purpose", code="invalid_value")
        meta = {"id": new_id("file-"), "object": "file", "bytes": 0, "created_at": int(time.time()),
                "filename": filename or "upload.jsonl", "purpose": purpose, "status": "processed",
                "expires_at": None, "status_details": None, "owner": owner, **(extra or {})}
        return Upload(self, meta, max_upload_bytes() if max_bytes is None else max_bytes)

    def write_file(self, chunks, **kwargs: Any) -> dict:
        """A whole upload from an iterable of byte chunks (the routes feed ``Upload`` as the body arrives)."""
        up = self.begin_upload(**kwargs)
        try:
            for c in chunks:
                up.write(c)
        except ApiError:
            raise
        except BaseException:
            up.abort()
            raise
        return up.commit()

    def file(self, file_id: str) -> dict:
        """The file's record (its File object and owner); 404 when there is none (never uploaded, deleted)."""
        path = self.file_dir(file_id).child("file.json").path()
        try:
            return read_json(path)
        except FileNotFoundError:
            raise not_found("file", file_id) from None

    def open_content(self, file_id: str) -> BinaryIO:
        self.file(file_id)
        try:
            return self.content_path(file_id).open("rb")
        except FileNotFoundError:
            raise not_found("file", file_id) from None

    def delete_file(self, file_id: str) -> dict:
        self.file(file_id)
        # the record first: from then on the file is gone for every reader, whatever is left of the content
        self.file_dir(file_id).child("file.json").path().unlink()
        remove_tree(self.file_dir(file_id).path())
        return {"id": file_id, "object": "file", "deleted": True}

    def files(self, visible: Callable[[dict], bool], *, purpose: str | None = None, after: str | None = None,
              limit: int = MAX_FILE_PAGE, order: str = "desc") -> tuple[list[dict], bool]:
        """A page of the files ``visible`` lets the caller see: (files, has_more)."""
        if order not in ("asc", "desc"):
            raise ApiError(400, f"Invalid order {order!r}: asc or desc.", param="order", code="invalid_value")
        ids = [p.name for p in _dirs(self.root.child("files").path()) if FILE_ID.fullmatch(p.name)]
        return _page(sorted(ids, reverse=order == "desc"), self._file_or_none, visible, after, limit,
                     lambda r: purpose is None or r.get("purpose") == purpose)

    def _file_or_none(self, file_id: str) -> dict | None:
        try:
            return self.file(file_id)
        except ApiError:
            return None

    # ---------------------------------------------------------------------------------------- batches
    def batch_dir(self, batch_id: str) -> Location:
        return self.root.child("batches", check_id(BATCH_ID, batch_id, "batch"))

    def create_batch(self, record: dict) -> dict:
        write_json(self.batch_dir(record["id"]).child("batch.json").path(), record)
        return record

    def batch(self, batch_id: str) -> dict:
        try:
            return read_json(self.batch_dir(batch_id).child("batch.json").path())
        except FileNotFoundError:
            raise not_found("batch", batch_id) from None

    def batches(self, visible: Callable[[dict], bool], *, after: str | None = None,
                limit: int = 20) -> tuple[list[dict], bool]:
        """A page of the batch records ``visible`` lets the caller see, newest first: (records, has_more)."""
        ids = [p.name for p in _dirs(self.root.child("batches").path()) if BATCH_ID.fullmatch(p.name)]
        return _page(sorted(ids, reverse=True), self._batch_or_none, visible, after, limit)

    def _batch_or_none(self, batch_id: str) -> dict | None:
        try:
            return self.batch(batch_id)
        except ApiError:
            return None

    def note(self, batch_id: str, name: str) -> dict | None:
        """A note of the batch (``cancel``, ``validation``, ``stopped``, ``files``); None when not written."""
        try:
            return read_json(self.batch_dir(batch_id).child(f"{name}.json").path())
        except FileNotFoundError:
            return None

    def write_note(self, batch_id: str, name: str, value: dict, *, once: bool = False) -> dict:
        """Writes a note; ``once``: the note already there is kept and returned (the first cancel, the first
        stop: their times are the batch's)."""
        path = self.batch_dir(batch_id).child(f"{name}.json").path()
        if once and exists(path):
            return read_json(path)
        write_json(path, value)
        return value


def _dirs(path) -> list:
    if not exists(path):
        return []
    return [p for p in path.iterdir() if not p.name.startswith(".")]


def _page(ids: list[str], read: Callable[[str], dict | None], visible: Callable[[dict], bool], after: str | None,
          limit: int, keep: Callable[[dict], bool] = lambda r: True) -> tuple[list[dict], bool]:
    """Records of ``ids`` (in the listing's order) after the id ``after``, at most ``limit`` of them that exist
    and are ``visible``; and whether more follow."""
    if after is not None:
        ids = ids[ids.index(after) + 1:] if after in ids else []
    out: list[dict] = []
    for ident in ids:
        rec = read(ident)
        if rec is None or not keep(rec) or not visible(rec):
            continue
        if len(out) == limit:
            return out, True
        out.append(rec)
    return out, False


def public_file(meta: dict) -> dict:
    """The File object as OpenAI returns it (the owner and the batch it came from are this server's)."""
    return {k: meta.get(k) for k in ("id", "object", "bytes", "created_at", "filename", "purpose", "status",
                                     "expires_at", "status_details")}


def iter_chunks(f: BinaryIO, size: int = 1 << 16) -> Iterator[bytes]:
    with f:
        while chunk := f.read(size):
            yield chunk
