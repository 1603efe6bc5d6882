"""Object-storage helpers: one place for paths, atomic commits and manifests.

Stages work on ``upath.UPath`` objects (local folders, ``s3://``, anything fsspec speaks). Airflow's
``ObjectStoragePath`` is converted at the operator boundary into a ``Location`` (URL + fsspec options),
which also crosses the process boundary into the engine worker, where no Airflow is installed.

Commit rule, everywhere: data first, manifest last. A reader goes by the manifest, so it never sees a
half-written artifact, on a local disk (write to a temporary name, then rename) or on S3 (one PUT, or one
multipart upload through fsspec's ``autocommit=False`` file, completed on commit and aborted on failure).
"""
from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from upath import UPath

from batch_llm.host import path_policy

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Location:
    """A storage location that survives JSON: the URL plus the fsspec options (credentials, endpoint).

    ``options`` may hold secrets: it is passed to child processes over a pipe, never on a command line,
    and ``__repr__`` hides it.
    """

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def path(self) -> UPath:
        return as_path(self.url, self.options)

    def child(self, *parts: str) -> "Location":
        return Location(join_url(self.url, *parts), self.options)

    def to_dict(self) -> dict:
        return {"url": self.url, "options": self.options}

    @classmethod
    def from_any(cls, value: "Location | dict | str") -> "Location":
        if isinstance(value, Location):
            return value
        if isinstance(value, dict):
            return cls(value["url"], dict(value.get("options") or {}))
        return cls(str(value))

    def __repr__(self) -> str:
        return f"Location({self.url!r})"


def join_url(url: str, *parts: str) -> str:
    out = url.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def as_path(url: str, options: dict[str, Any] | None = None) -> UPath:
    """The path ``url`` names; a local one at exactly the path the path policy classified (``path_policy``)."""
    resolved = path_policy.resolve(url)
    if resolved.kind == "builtin":
        return UPath(path_policy.builtin_file(url))
    if resolved.is_local and resolved.local_path is not None:  # a local path always has one
        return UPath(resolved.local_path)
    opts = dict(options or {})
    if url.startswith(("s3://", "s3a://")):
        # dag.test() and the CLI run every stage in one process; a cached listing would hide later writes.
        opts.setdefault("use_listings_cache", False)
        # multipart parts of exactly MULTIPART_PART_BYTES (the last one smaller), cut by s3fs; without it s3fs
        # sends whatever one write() buffered as a single part
        opts.setdefault("fixed_upload_size", True)
    return UPath(url, **opts)


def is_local(path: UPath) -> bool:
    return getattr(path, "protocol", "") in ("", "file", "local")


# Objects smaller than this are one PUT; others a multipart upload of parts this size (boto3's default
# multipart threshold and chunk size). s3fs cuts the parts itself (``fixed_upload_size``, set by ``as_path``).
MULTIPART_PART_BYTES = 8 * 2**20


class AtomicWriter:
    """Streams bytes into an object that becomes visible only when complete. Use ``atomic_writer(path)``.

    On object storage this is fsspec's own deferred commit: the file is opened with ``autocommit=False``, so
    closing it uploads the parts but completes nothing; ``commit()`` completes the multipart upload and
    ``discard()`` aborts it (no object, no orphaned parts). Nothing else can complete it: neither an exception
    path nor the garbage collector closing the file. An object smaller than one part never opens that file and
    goes as one PUT (``pipe_file``): an ``autocommit=False`` file makes every object a multipart upload, three
    requests where one does. (A store whose files ignore ``autocommit=False`` shows the object while it is
    written: fsspec's ``memory://`` does, a store for tests.)

    On a local disk it stays a temporary file beside the target, fsynced and renamed over it. fsspec's local
    deferred file (``LocalFileOpener(autocommit=False)``) is not used: it makes its temporary file in the system
    temporary folder (``tempfile.mkstemp()`` without ``dir``) and commits with ``shutil.move``, which becomes a
    copy into the final name, visible half-written, wherever that folder is another file system (a tmpfs
    ``/tmp``, a mounted volume); nor does it fsync before the rename. ``fs.transaction`` is not used either: it
    is a flag on the filesystem instance, which fsspec caches and shares between threads, so one thread's
    transaction would defer (and commit) another thread's files.

    A local write that fails (a full disk: ENOSPC) raises OSError naming the final path, and leaves neither the
    object nor the temporary file behind."""

    def __init__(self, path: UPath):
        self.path = path
        self._f: Any = None  # the open file: a local temporary one, or fsspec's deferred upload
        self._head: bytearray | None = None  # elsewhere, the bytes until one part is full
        if is_local(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            # the file system path (a local UPath's .path is what os.fspath gives, for file:// URLs too)
            self._tmp: str | None = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp").path
            try:
                self._f = open(self._tmp, "wb")
            except OSError as e:
                raise self._named(e) from e
        else:
            self._tmp = None
            self._head = bytearray()

    def _named(self, e: OSError) -> OSError:
        """The error with the final path (the temporary name means nothing to a reader); same errno, same type."""
        return OSError(e.errno, e.strerror or os.strerror(e.errno), str(self.path)) if e.errno else e

    def write(self, data: bytes) -> None:
        if self._tmp is not None:
            try:
                self._f.write(data)
            except OSError as e:
                raise self._named(e) from e
        elif self._head is None:
            self._f.write(data)
        else:
            self._head += data
            if len(self._head) >= MULTIPART_PART_BYTES:  # a multipart upload from here on
                self._f = self.path.fs.open(self.path.path, "wb", autocommit=False, block_size=MULTIPART_PART_BYTES)
                self._f.write(bytes(self._head))
                self._head = None

    def flush(self) -> None:
        """A file object's flush (gzip's writer wraps this one): a local file's buffer goes to the temporary file;
        elsewhere the bytes wait for a full part (only complete parts are uploaded before the commit)."""
        if self._tmp is not None:
            try:
                self._f.flush()
            except OSError as e:
                raise self._named(e) from e

    def commit(self) -> None:
        if self._tmp is not None:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
                self._f.close()
                os.replace(self._tmp, self.path.path)
            except OSError as e:
                raise self._named(e) from e
        elif self._head is not None:
            self.path.fs.pipe_file(self.path.path, bytes(self._head))
            self._head = None
        else:
            self._f.close()  # the last part; the upload stays incomplete until:
            self._f.commit()  # CompleteMultipartUpload

    def abort(self) -> None:
        if self._tmp is not None:
            try:
                self._f.close()
            except OSError:
                pass  # a full disk fails the buffered rest again; the file is closed all the same, and goes
            with suppress(FileNotFoundError):
                os.unlink(self._tmp)
            return
        self._head = None
        if self._f is None:
            return
        try:
            self._f.discard()  # AbortMultipartUpload
        except Exception:  # noqa: BLE001 - the store is failing already; an unfinished upload stays invisible
            pass
        try:  # discard() left fsspec's file without a buffer: marked closed, its __del__ uploads nothing more
            self._f.closed = True
        except AttributeError:  # memory://'s file (a BytesIO) ignores autocommit=False: the object since the open
            pass


@contextmanager
def atomic_writer(path: UPath) -> Iterator[AtomicWriter]:
    w = AtomicWriter(path)
    try:
        yield w
        w.commit()  # a commit that fails (the last bytes on a full disk) leaves no temporary file either
    except BaseException:
        w.abort()
        raise


def write_bytes_atomic(path: UPath, data: bytes) -> None:
    """Writes the whole object at once (see ``AtomicWriter``)."""
    with atomic_writer(path) as w:
        w.write(data)


def write_text_atomic(path: UPath, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json(path: UPath, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False, default=str) + "\n")


def read_json(path: UPath) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


# msgspec (an Airflow dependency) encodes and decodes JSON several times faster than the json module; the
# project's own files are read and written with it (user input is parsed with json, for its error messages).
# Values JSON has no type for are written as str(value), as json.dumps(default=str) did.
_ENCODER = msgspec.json.Encoder(enc_hook=str)
_DECODER = msgspec.json.Decoder()


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON (non-ASCII kept as is). A string UTF-8 cannot hold (a lone UTF-16 surrogate, as
    Python's json reads ``"\\ud800"``) is written with that character as its escape text, not a crash."""
    try:
        return _ENCODER.encode(obj)
    except UnicodeEncodeError:
        return _ENCODER.encode(utf8_safe(obj))


def utf8_safe(obj: Any) -> Any:
    """``obj`` with every lone surrogate of its strings (keys too) replaced by its escape text (``\\ud800``)."""
    if isinstance(obj, str):
        return obj.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, dict):
        return {utf8_safe(k): utf8_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [utf8_safe(v) for v in obj]
    return obj


def write_jsonl(path: UPath, rows: Iterable[dict]) -> int:
    """Writes JSON lines atomically, streaming (rows are not held in memory); returns the row count."""
    n = 0
    buf = bytearray()
    with atomic_writer(path) as w:
        for row in rows:
            at = len(buf)
            try:
                _ENCODER.encode_into(row, buf, at)
            except UnicodeEncodeError:  # a lone surrogate: json_bytes writes it as its escape text
                del buf[at:]
                buf += json_bytes(row)
            buf += b"\n"
            n += 1
            if len(buf) >= 1 << 16:
                w.write(bytes(buf))
                buf.clear()
        w.write(bytes(buf))
    return n


def iter_jsonl(path: UPath | Path) -> Iterator[dict]:
    """The records of a JSON-lines file, local (a spool: ``pathlib.Path``) or anywhere fsspec reaches."""
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                yield _DECODER.decode(line)


def write_manifest(directory: UPath, manifest: dict) -> UPath:
    """The last write of a stage: the manifest that readers go by."""
    path = directory / MANIFEST
    write_json(path, manifest)
    return path


def read_manifest(directory_or_file: UPath) -> dict:
    p = directory_or_file
    if p.name != MANIFEST:
        p = p / MANIFEST
    return read_json(p)


def exists(path: UPath) -> bool:
    try:
        return path.exists()
    except FileNotFoundError:
        return False


def list_files(directory: UPath, suffix: str = "") -> list[UPath]:
    """Files directly under ``directory`` (sorted by name); none when it does not exist.

    On object stores a zero-byte ``prefix/`` "folder marker" (S3 consoles and some tools create them) is
    listed by s3fs as a child of the prefix, which ``UPath.iterdir`` turns into a phantom ``<prefix>/<name>``
    entry: the listing is read from the filesystem here and the marker left out."""
    if not exists(directory):
        return []
    if is_local(directory):
        children = list(directory.iterdir())
    else:
        own = directory.path.rstrip("/")
        children = [directory / entry.rstrip("/").rsplit("/", 1)[-1]
                    for entry in directory.fs.ls(directory.path, detail=False) if entry.rstrip("/") != own]
    return sorted((p for p in children if p.name.endswith(suffix) and not p.name.startswith(".")),
                  key=lambda p: p.name)


def modified_at(info: dict) -> float | None:
    """An fsspec listing entry's modification time, seconds since the epoch: a local file's ``mtime``, an
    object's ``LastModified`` (the store's clock); None for entries without one (S3 "directories")."""
    t = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if t is None:
        return None
    return t.timestamp() if hasattr(t, "timestamp") else float(t)


def newest_change(path: UPath) -> float | None:
    """When anything under ``path`` last changed (the newest modification time of its files); None when it
    holds no file."""
    times = [t for info in path.fs.find(path.path, detail=True).values() if (t := modified_at(info)) is not None]
    return max(times, default=None)


def copy_object(src: UPath, dst: UPath) -> None:
    """``dst`` made a copy of ``src`` by the store, not through this process where it can: a hard link on a local
    disk (a copy where the two are on different devices), a server-side copy within one object store; between
    stores, streamed through an atomic write."""
    if is_local(src) and is_local(dst):
        import shutil

        Path(dst.path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(dst.path).with_name(f".{Path(dst.path).name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            os.link(src.path, tmp)
        except OSError:
            shutil.copyfile(src.path, tmp)
        os.replace(tmp, dst.path)  # whole or not there, as an atomic write
    elif getattr(src, "protocol", None) == getattr(dst, "protocol", None) and src.storage_options == dst.storage_options:
        src.fs.copy(src.path, dst.path)
    else:
        with src.open("rb") as r, atomic_writer(dst) as w:
            while chunk := r.read(MULTIPART_PART_BYTES):
                w.write(chunk)


def remove_tree(path: UPath) -> None:
    if not exists(path):
        return
    if is_local(path):
        import shutil

        shutil.rmtree(path.path, ignore_errors=True)
    else:
        path.fs.rm(path.path, recursive=True)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MB. Linux's VmHWM belongs to this program's own memory;
    ru_maxrss survives exec, so a child started by a large process would report its parent's peak."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
