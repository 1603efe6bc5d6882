"""Images in rows: the references a row names, checked cheaply when the run is planned, and loaded, checked
against their content hash and decoded when the shard feeds them to the engine.

A row names its images as OpenAI chat content parts (``{"type": "image_url", "image_url": {"url": ...}}``, in
JSONL prompt rows and OpenAI Batch bodies) or in table columns (``input.image_columns``: a path or URL, a list
of them, or the image's bytes in a Parquet binary column or a ``{bytes, path}`` struct). What a reference may be:

- ``data:image/...;base64,...``: the image inline;
- an object-storage URL (``s3://bucket/key``, any ``path_policy.OBJECT_STORAGE_PROTOCOLS``), read with the input's
  storage options (``input.conn_id``'s credentials);
- a local path (plain or ``file://``; relative to the input file's folder), only under the input's own folder or
  ``input.image_roots``, compared after ``realpath`` (``path_policy.under_roots``);
- nothing else: ``http(s)://`` and fsspec wrappers are refused (the pipeline fetches nothing from the web).

The planner (``ImageChecker``) checks each reference without decoding it: it exists, is a regular file or object,
holds 1 to ``input.max_image_bytes`` bytes, its first bytes are a raster format PIL decodes here (PNG, JPEG, GIF,
WebP, BMP, TIFF; an SVG is refused by name), its name's extension (where it names an image format) is that
format, and for PNG and WebP the end is where the format says (a truncated PNG lacks its IEND chunk; a WebP is
shorter than its RIFF header says). It hashes the bytes (SHA-256, streamed in ``READ_CHUNK`` pieces: memory holds
one piece, never an image), and the shard row carries the hash: the prompt's key (the result cache, folding of
identical prompts) holds the images' content hashes, never their URLs. A reference that fails is the row's error,
with the reason.

The shard (``load_image``) reads each image again as its request goes to the engine, checks the hash (an image
changed since the plan is the row's error), and decodes it with PIL in full (``Image.load``): a decode failure
(corrupt data past the header, a JPEG cut short) is the row's error too. Only the requests the engine holds at once,
and those ``load_ahead`` loads ahead of it on ``input.image_workers`` threads, have decoded images (``stages.infer``).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import posixpath
import re
import stat
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from batch_llm.io import path_policy

MIB = 2**20
DEFAULT_MAX_IMAGE_BYTES = 20 * MIB   # OpenAI's limit per image
READ_CHUNK = 1 * MIB                 # bytes read at a time when hashing
HEAD_BYTES = 64                      # what the format check reads from the start

# Magic bytes of the raster formats PIL decodes here, and the format each extension names.
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpeg"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)
EXTENSION_FORMAT = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".jpe": "jpeg", ".gif": "gif", ".webp": "webp",
                    ".bmp": "bmp", ".tif": "tiff", ".tiff": "tiff", ".svg": "svg", ".svgz": "svg"}
FORMAT_NAME = {"png": "PNG", "jpeg": "JPEG", "gif": "GIF", "webp": "WebP", "bmp": "BMP", "tiff": "TIFF", "svg": "SVG"}
_PNG_END = b"IEND\xaeB`\x82"
T = TypeVar("T")


class ImageProblem(ValueError):
    """A reference that cannot be an image of this row; the message says which and why."""


def sniff(head: bytes) -> str | None:
    """The format the first bytes of a file say (``png``, ``jpeg``, ... or ``svg``); None for anything else."""
    for magic, fmt in _MAGIC:
        if head.startswith(magic):
            return fmt
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith(b"<svg") or (text.startswith(b"<?xml") and b"<svg" in head.lower()) or \
            (text.startswith(b"<!doctype svg")):
        return "svg"
    return None


def _what_it_is(head: bytes) -> str:
    if not head:
        return "empty"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"its first bytes are {head[:8].hex(' ')}"
    return f"its bytes are text ({text[:24]!r})" if text.isprintable() or "\n" in text else \
        f"its first bytes are {head[:8].hex(' ')}"


def check_bytes_shape(head: bytes, tail: bytes, size: int, name: str) -> str:
    """The format of an image from its first ``HEAD_BYTES`` and last bytes (and size), or ImageProblem saying why
    it is not one this pipeline sends: empty, not a raster image (an SVG is named), a name whose extension says
    another format, a PNG without its closing IEND chunk, a WebP shorter than its header says."""
    if size == 0:
        raise ImageProblem("empty (0 bytes)")
    fmt = sniff(head)
    if fmt == "svg":
        raise ImageProblem("an SVG drawing (vector graphics): vision models take raster images (PNG, JPEG, WebP, "
                           "GIF, BMP, TIFF); render it to PNG first")
    if fmt is None:
        raise ImageProblem(f"not an image: {_what_it_is(head)} (PNG, JPEG, WebP, GIF, BMP or TIFF expected)")
    ext = os.path.splitext(name.split("?", 1)[0])[1].lower() if not name.startswith("data:") else ""
    named = EXTENSION_FORMAT.get(ext)
    if named is not None and named != fmt:
        raise ImageProblem(f"wrong extension: its name says {FORMAT_NAME[named]} ({ext}) but its bytes are a "
                           f"{FORMAT_NAME[fmt]} image")
    if fmt == "png" and not tail.endswith(_PNG_END):
        raise ImageProblem(f"a truncated PNG: it does not end with the IEND chunk ({size} bytes)")
    if fmt == "webp" and len(head) >= 8:
        declared = int.from_bytes(head[4:8], "little") + 8
        if size < declared:
            raise ImageProblem(f"a truncated WebP: {size} of the {declared} bytes its header declares")
    return fmt


def _short(url: str) -> str:
    """A reference as a message names it: a data: URL by its media type and size, not its payload."""
    if url.startswith("data:"):
        head = url[:url.find(",")] if "," in url else url[:40]
        return f"{head},… ({len(url)} characters)"
    return url if len(url) <= 200 else url[:200] + "…"


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n} bytes"


def _over(n: int, limit: int) -> ImageProblem:
    return ImageProblem(f"{_mib(n)}, over input.max_image_bytes ({_mib(limit)})")


# ------------------------------------------------------------------------------------------ references
@dataclass(frozen=True)
class ImageRef:
    """A checked image: where it is read from (``url``: a data: URL, an absolute local path or a storage URL),
    its SHA-256 and format, its size. What a shard row's ``images`` list holds, one per image part in order."""

    url: str
    sha256: str
    format: str
    bytes: int

    def to_json(self) -> dict:
        return {"url": self.url, "sha256": self.sha256, "format": self.format, "bytes": self.bytes}

    @classmethod
    def from_json(cls, d: dict) -> "ImageRef":
        return cls(url=d["url"], sha256=d["sha256"], format=d["format"], bytes=int(d["bytes"]))


def data_url(data: bytes, fmt: str) -> str:
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode('ascii')}"


_DATA_URL = re.compile(r"^data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),", re.S)


def _data_payload(url: str, max_bytes: int) -> bytes:
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageProblem("not a data: URL (data:image/png;base64,...)")
    if ";base64" not in m["params"].lower():
        raise ImageProblem("a data: URL of an image must be base64 (data:image/png;base64,...)")
    media = m["type"].lower()
    if media and not media.startswith("image/"):
        raise ImageProblem(f"a data: URL of type {media!r}, not an image")
    payload = url[m.end():]
    approx = len(payload) * 3 // 4  # the size, known from the length without decoding
    if approx > max_bytes + 3:
        raise _over(approx, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageProblem(f"its base64 does not decode ({e})") from None
    if len(data) > max_bytes:
        raise _over(len(data), max_bytes)
    return data


def where_of(n: int, url: Any) -> str:
    """How a row's error names its n-th image (1-based)."""
    return f"image {n} ({_short(url)})" if isinstance(url, str) else f"image {n}"


@dataclass
class ImageChecker:
    """The planner's check of a row's image references (see the module's docstring). ``base``: the input
    file's folder (relative paths resolve against it); ``roots``: the local folders images may be read from;
    ``options``: the storage options object-storage URLs are read with (the input's). Results are kept for the
    last ``memo`` references, so an image many rows name is read once per plan."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    roots: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    base: str | None = None
    memo: int = 4096
    _seen: OrderedDict = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the memo; checks run on threads

    def check(self, url: Any, where: str) -> ImageRef:
        """The checked reference, or ImageProblem naming ``where`` (the row's n-th image) and why. Safe on several
        threads (the planner's ``input.image_workers``); two threads may then both read an image not yet known."""
        if not isinstance(url, str) or not url.strip():
            raise ImageProblem(f"{where}: an image reference is a non-empty string (a data: URL, a path or a "
                               f"storage URL), got {type(url).__name__}")
        key = (self.base, url) if not url.startswith("data:") else None  # inline images: their text is the row's
        with self._lock:
            found = self._seen.get(key) if key is not None else None
            if found is not None:
                self._seen.move_to_end(key)
        if found is None:
            try:
                found = self._check(url)
            except ImageProblem as e:
                found = e
            if key is not None:
                with self._lock:
                    self._seen[key] = found
                    while len(self._seen) > self.memo:
                        self._seen.popitem(last=False)
        if isinstance(found, ImageProblem):
            raise ImageProblem(f"{where}: {found}")
        return found

    def check_bytes(self, data: bytes, name: str, where: str) -> ImageRef:
        """Image bytes a table cell holds (Parquet binary): checked as a file's, carried as a data: URL."""
        try:
            if len(data) > self.max_bytes:
                raise _over(len(data), self.max_bytes)
            fmt = check_bytes_shape(data[:HEAD_BYTES], data[-16:], len(data), name)
        except ImageProblem as e:
            raise ImageProblem(f"{where}: {e}") from None
        return ImageRef(data_url(data, fmt), hashlib.sha256(data).hexdigest(), fmt, len(data))

    def _check(self, url: str) -> ImageRef:
        if url.startswith("data:"):
            data = _data_payload(url, self.max_bytes)
            fmt = check_bytes_shape(data[:HEAD_BYTES], data[-16:], len(data), url)
            return ImageRef(url, hashlib.sha256(data).hexdigest(), fmt, len(data))
        resolved = path_policy.resolve(url)
        if resolved.kind == "storage" and not resolved.wrapped:
            return self._check_storage(url)
        if resolved.kind == "local" and not resolved.wrapped:
            if "://" not in url and self.base is not None and not os.path.isabs(os.path.expanduser(url)):
                joined = _join(self.base, url)
                target = path_policy.resolve(joined)
                if target.kind == "storage":  # an input in object storage: relative to its folder there, and under it
                    if not (joined + "/").startswith(self.base.rstrip("/") + "/"):
                        raise ImageProblem(f"{url} climbs out of the input's folder {self.base} (a relative path "
                                           "stays under it; name another object by its full URL)")
                    return self._check_storage(joined)
                return self._check_local(target.local_path or joined)
            return self._check_local(resolved.local_path or url)
        raise ImageProblem("not read from there: images come from data: URLs, object storage (s3://, gs://, az://, "
                           "...) through the input's connection, or local paths under the input's folder and "
                           "input.image_roots")

    def _check_local(self, path: str) -> ImageRef:
        if not path_policy.under_roots(path, self.roots):
            raise ImageProblem(f"{path} is outside the folders images may be read from "
                               f"({', '.join(self.roots) or 'none'}; add its folder to input.image_roots)")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ImageProblem(f"no such file {path}") from None
        except OSError as e:
            raise ImageProblem(f"cannot read {path}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ImageProblem(f"{path} is not a regular file")
        return self._checked_stream(os.path.realpath(path), st.st_size, lambda: open(path, "rb"))

    def _check_storage(self, url: str) -> ImageRef:
        from batch_llm.io.storage import as_path

        p = as_path(url, self.options)
        try:
            info = p.fs.info(p.path)
        except FileNotFoundError:
            raise ImageProblem(f"no such object {url}") from None
        except OSError as e:
            raise ImageProblem(f"cannot read {url}: {e}") from None
        if info.get("type") == "directory":
            raise ImageProblem(f"{url} is a folder, not an object")
        return self._checked_stream(url, int(info.get("size") or 0), lambda: p.open("rb"))

    def _checked_stream(self, name: str, size: int, opener: Callable[[], Any]) -> ImageRef:
        """Size first (nothing read when over the limit), then the bytes streamed once: the head and tail
        checked, the hash computed; memory holds one ``READ_CHUNK``."""
        if size > self.max_bytes:
            raise _over(size, self.max_bytes)
        h = hashlib.sha256()
        head, tail, n = b"", b"", 0
        try:
            with opener() as f:
                while chunk := f.read(READ_CHUNK):
                    if n == 0:
                        head = chunk[:HEAD_BYTES]
                        if sniff(head) in (None, "svg"):  # not an image: said without reading the rest
                            n = len(chunk)
                            break
                    n += len(chunk)
                    if n > self.max_bytes:
                        raise ImageProblem(f"holds more than input.max_image_bytes ({_mib(self.max_bytes)})")
                    tail = (tail + chunk)[-16:]
                    h.update(chunk)
        except FileNotFoundError:
            raise ImageProblem(f"no such file or object {name}") from None
        except OSError as e:
            raise ImageProblem(f"cannot read {name}: {e}") from None
        fmt = check_bytes_shape(head, tail, n, name)
        return ImageRef(name, h.hexdigest(), fmt, n)


def _join(base: str, rel: str) -> str:
    """A relative reference joined to the input file's folder: a local path, or an object-storage URL whose key's
    ``.`` and ``..`` segments are resolved (S3 keys hold them literally; no store would find the object meant)."""
    if path_policy.resolve(base).kind == "storage":
        scheme, _, rest = base.rstrip("/").partition("://")
        bucket, _, prefix = rest.partition("/")
        key = posixpath.normpath(posixpath.join("/" + prefix, rel)).lstrip("/")
        return f"{scheme}://{bucket}/{key}"
    return os.path.join(base, rel)


# ------------------------------------------------------------------------------------------ rows
def content_text(content: Any) -> str:
    """A message content's text: the string, or its text parts joined (image parts have none)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def image_part(ref: ImageRef) -> dict:
    """An image as a shard row's message part: by content hash only (the URL is in the row's ``images``), in the
    shape Hugging Face chat templates read (``{"type": "image"}``)."""
    return {"type": "image", "sha256": ref.sha256}


def count_images(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")


# ------------------------------------------------------------------------------------------ the shard
def read_image_bytes(ref: ImageRef, options: dict | None, max_bytes: int) -> bytes:
    """The image's bytes as the plan checked them, read again; ImageProblem when they cannot be read, grew past
    ``max_bytes`` or are not the bytes the plan hashed."""
    where = f"image {_short(ref.url)}"
    if ref.url.startswith("data:"):
        try:
            data = _data_payload(ref.url, max_bytes)
        except ImageProblem as e:
            raise ImageProblem(f"{where}: {e}") from None
    else:
        from batch_llm.io.storage import as_path

        try:
            with as_path(ref.url, options).open("rb") as f:
                data = f.read(max_bytes + 1)
        except FileNotFoundError:
            raise ImageProblem(f"{where}: gone since the plan (no such file or object)") from None
        except OSError as e:
            raise ImageProblem(f"{where}: cannot read it: {e}") from None
        if len(data) > max_bytes:
            raise ImageProblem(f"{where} grew past input.max_image_bytes ({_mib(max_bytes)}) since the plan")
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ImageProblem(f"{where} changed since the plan (its SHA-256 is not {ref.sha256[:12]}…): plan the run "
                           "again (clear plan_shards)")
    return data


def decode_image(data: bytes, ref: ImageRef) -> Any:
    """A PIL image, decoded in full (``load``) and in RGB; ImageProblem when PIL cannot decode it (a truncated
    JPEG, corrupt data past the header, more pixels than PIL's decompression-bomb limit)."""
    from PIL import Image, UnidentifiedImageError

    where = f"image {_short(ref.url)}"
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except Image.DecompressionBombError as e:
        raise ImageProblem(f"{where} does not decode: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageProblem(f"{where} does not decode ({FORMAT_NAME.get(ref.format, ref.format)}): {e}") from None


def load_image(ref: ImageRef | dict, options: dict | None, max_bytes: int) -> Any:
    """The shard's load of one checked image: read, hash compared, decoded (``read_image_bytes``, ``decode_image``)."""
    ref = ref if isinstance(ref, ImageRef) else ImageRef.from_json(ref)
    return decode_image(read_image_bytes(ref, options, max_bytes), ref)


def load_ahead(items: Iterable[T], refs_of: Callable[[T], Sequence[Any]], load: Callable[[Any], Any],
               workers: int) -> Iterator[tuple[T, list | ImageProblem | None]]:
    """``(item, its images)`` for each item, in the items' order: the decoded images of ``refs_of(item)`` (``load``
    each), the ``ImageProblem`` that stopped one, or None for an item without images.

    With ``workers`` > 1 the loads run on that many threads, up to ``2 × workers`` items ahead of the consumer: an
    object store's reads overlap, and PIL decodes outside the GIL, so a shard of image rows keeps its engine fed
    (the window is small because each item ahead holds its images decoded).
    An item is yielded as soon as it and every item before it are loaded; a text item waits only for those before
    it. The consumer's thread pulls ``items`` (whatever that iterator does, e.g. failing a row, stays on it); the
    threads only load. Any other exception of a load is raised at its item, as a load one at a time would."""
    if workers <= 1:
        for item in items:
            yield item, _load_all(refs_of(item), load)
        return
    window = 2 * workers
    pending: deque[tuple[T, Future | None]] = deque()
    pool: ThreadPoolExecutor | None = None
    try:
        for item in items:
            refs = refs_of(item)
            if not refs and not pending:  # nothing loading: a text item goes straight through (most rows of a day)
                yield item, None
                continue
            if refs:
                pool = pool or ThreadPoolExecutor(workers, thread_name_prefix="image-load")
                pending.append((item, pool.submit(_load_all, list(refs), load)))
            else:
                pending.append((item, None))
            while pending and (len(pending) > window or pending[0][1] is None or pending[0][1].done()):
                head, fut = pending.popleft()
                yield head, (fut.result() if fut is not None else None)
        while pending:
            head, fut = pending.popleft()
            yield head, (fut.result() if fut is not None else None)
    finally:  # the consumer stopped early (a stop, a failed engine): loads not started are dropped
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _load_all(refs: Sequence[Any], load: Callable[[Any], Any]) -> list | ImageProblem | None:
    if not refs:
        return None
    try:
        return [load(ref) for ref in refs]
    except ImageProblem as e:
        return e


def iter_refs(row: dict) -> Iterator[ImageRef]:
    for d in row.get("images") or ():
        yield ImageRef.from_json(d)


def model_takes_images(model_dir: str) -> bool:
    """Whether the model folder's config names a vision part (``vision_config``, an image token, ...): a text
    model is sent no images (the row's error says so)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return True  # nothing to go by: the engine decides
    text = json.dumps(config).lower()
    return any(word in text for word in ("vision", "image", "visual", "pixel"))
