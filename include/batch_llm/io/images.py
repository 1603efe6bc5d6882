"""Images in rows: the references a row names, checked cheaply when the run is planned, and loaded, checked
against their content hash and decoded when the shard feeds them to the engine.

A row names its images as OpenAI chat content parts (``{"type": "image_url", "image_url": {"url": ...}}``, in
JSONL prompt rows and OpenAI Batch bodies) or in table columns (``input.image_columns``: a path or URL, a list
of them, or the image's bytes in a Parquet binary column or a ``{bytes, path}`` struct). Where a reference may
point is one rule, ``path_policy.RowResources``, for the plan's check and the shard's read alike:

- ``data:image/...;base64,...``: the image inline;
- an object in the run's own store (the input's: ``s3://`` for an input in S3, or through ``input.conn_id``), read
  with the input's storage options;
- a local path (plain or ``file://``; relative to the input file's folder), only under the input's own folder or
  ``input.image_roots``, compared after ``realpath`` (``path_policy.under_roots``);
- nothing else: ``http(s)://``, ``hf://``, another store, fsspec wrappers and a NUL byte are refused by name before
  any filesystem is made (the pipeline fetches nothing from the web). Any failure of a reference, whatever raised
  it (a store's client without credentials or its package), is its row's error, never the plan's.

The planner (``ImageChecker``) checks each reference without decoding it: it exists, is a regular file or object,
holds 1 to ``input.max_image_bytes`` bytes, its first bytes are a raster format PIL decodes here (PNG, JPEG, GIF,
WebP, BMP, TIFF; an SVG is refused by name), its name's extension (where it names an image format) is that
format, for PNG and WebP the end is where the format says (a truncated PNG lacks its IEND chunk; a WebP is
shorter than its RIFF header says), and its header's width × height is at most ``input.max_image_pixels`` (a
decompression bomb, a small file of huge dimensions, is refused by its header). It hashes the bytes (SHA-256,
streamed in ``READ_CHUNK`` pieces: memory holds one piece, never an image), and the shard row carries the hash
and the pixels: the prompt's key (the result cache, folding of identical prompts) holds the images' content
hashes, never their URLs. A reference that fails is the row's error, with the reason. Each file or object read is
noted with its stamp (``ImageReads``): the plan's key holds them, so a plan is made again once one changed.

The shard (``load_image``) reads each image again as its request goes to the engine, under the same rule (a FIFO
or a link put in its place is refused, unread), checks the hash (an image changed since the plan is the row's
error), checks the header's pixels again, and decodes it with PIL in full (``Image.load``): a decode failure
(corrupt data past the header, a JPEG cut short) is the row's error too. Only the requests the engine holds at
once, and those ``load_ahead`` loads ahead of it on ``input.image_workers`` threads (at most
``input.max_decoded_bytes_ahead`` of them decoded, counted from their headers), have decoded images
(``stages.infer``).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import itertools
import json
import os
import re
import stat
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from batch_llm.host import path_policy

MIB = 2**20
DEFAULT_MAX_IMAGE_BYTES = 20 * MIB   # OpenAI's limit per image
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000  # a 40 MP photo; vision-language models resize to far fewer (Qwen2-VL: 12.8 MP)
DECODED_BYTES_PER_PIXEL = 4          # PIL holds an RGB image as 4 bytes a pixel
ABSENT = "absent"                    # the stamp of a resource that is not there
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
    """A reference that cannot be an image of this row; the message says which and why. ``read``: the resource
    the check reached and its stamp (``stamp_of``), where it reached one: the plan's key holds it, so a row
    refused for an image that is then fixed is planned again."""

    def __init__(self, message: str, read: tuple[str, str] | None = None):
        super().__init__(message)
        self.read = read


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


def _too_many_pixels(width: int, height: int, limit: int) -> ImageProblem:
    return ImageProblem(f"{width} x {height} pixels ({_mib(width * height * DECODED_BYTES_PER_PIXEL)} decoded), over "
                        f"input.max_image_pixels ({limit:,})")


def header_pixels(f: Any, limit: int) -> int:
    """Width × height from an image's header, read from the file object ``f`` (PIL reads the header only; nothing
    is decoded); ImageProblem when over ``limit`` (``input.max_image_pixels``) or when the header does not read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(f) as img:
            width, height = img.size
    except Image.DecompressionBombError as e:  # PIL's own limit, above any this pipeline allows
        raise ImageProblem(f"over input.max_image_pixels ({limit:,}): {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageProblem(f"its header does not read: {e}") from None
    if width * height > limit:
        raise _too_many_pixels(width, height, limit)
    return width * height


def local_stamp(st: os.stat_result) -> str:
    """What changes when a local file is rewritten or replaced: size, mtime, ctime, inode."""
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def storage_stamp(info: dict) -> str:
    """What changes when an object is rewritten: its size and its store's change markers (ETag, ...)."""
    from batch_llm.io.identity import change_marks, stable_hash

    return stable_hash({"size": str(info.get("size")), **change_marks(info)})[:32]


def stamp_of(url: str, options: dict | None) -> str:
    """The stamp (``local_stamp``, ``storage_stamp``, ``ABSENT``) of a resource the plan read, now: compared with
    the plan's to tell whether the plan still holds. A resource that cannot be asked gets a stamp no plan holds."""
    try:
        resolved = path_policy.resolve(url)
        if resolved.kind == "local":
            return local_stamp(os.stat(resolved.local_path or url))
        from batch_llm.io.storage import as_path

        p = as_path(url, options)
        return storage_stamp(p.fs.info(p.path))
    except FileNotFoundError:
        return ABSENT
    except Exception as e:  # whatever it is, it is not what the plan read
        return f"unreadable: {type(e).__name__}"


# ------------------------------------------------------------------------------------------ references
@dataclass(frozen=True)
class ImageRef:
    """A checked image: where it is read from (``url``: a data: URL, an absolute local path or a storage URL),
    its SHA-256 and format, its size. What a shard row's ``images`` list holds, one per image part in order."""

    url: str
    sha256: str
    format: str
    bytes: int
    pixels: int = 0  # width × height from its header; 0: not known (a plan made before pixels were counted)
    stamp: str = field(default="", compare=False)  # the plan's stamp of the file or object (not of inline bytes)

    def to_json(self) -> dict:
        d = {"url": self.url, "sha256": self.sha256, "format": self.format, "bytes": self.bytes}
        return {**d, "pixels": self.pixels} if self.pixels else d

    @classmethod
    def from_json(cls, d: dict) -> "ImageRef":
        return cls(url=d["url"], sha256=d["sha256"], format=d["format"], bytes=int(d["bytes"]),
                   pixels=int(d.get("pixels") or 0))


def decoded_bytes(refs: Iterable[ImageRef | dict], max_pixels: int) -> int:
    """The memory a request's images take decoded, from their headers' pixels (``max_pixels`` for one whose
    pixels the plan did not count)."""
    total = 0
    for ref in refs:
        pixels = ref.pixels if isinstance(ref, ImageRef) else int(ref.get("pixels") or 0)
        total += (pixels or max_pixels) * DECODED_BYTES_PER_PIXEL
    return total


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
    """The planner's check of a row's image references (see the module's docstring). Where a reference may be read
    from is ``path_policy.RowResources``' rule: ``stores``, the object-storage protocols of the run's own storage,
    read with ``options`` (the input's storage options); ``roots``, the local folders; ``base``, the input file's
    folder (relative paths resolve against it). Any failure of a reference, whatever raised it, is the row's
    ImageProblem. Results are kept for the last ``memo`` references, so an image many rows name is read once per
    plan."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    roots: list[str] = field(default_factory=list)
    stores: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    base: str | None = None
    memo: int = 4096
    _seen: OrderedDict = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the memo; checks run on threads

    def check(self, url: Any, where: str) -> ImageRef:
        """The checked reference, or ImageProblem naming ``where`` (the row's n-th image) and why. Safe on several
        threads (the planner's ``input.image_workers``); two threads may then both read an image not yet known."""
        key = (self.base, url) if isinstance(url, str) and not url.startswith("data:") else None  # inline: the row's
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
            raise ImageProblem(f"{where}: {found}", found.read)
        return found

    def check_bytes(self, data: bytes, name: str, where: str) -> ImageRef:
        """Image bytes a table cell holds (Parquet binary): checked as a file's, carried as a data: URL."""
        try:
            if len(data) > self.max_bytes:
                raise _over(len(data), self.max_bytes)
            fmt = check_bytes_shape(data[:HEAD_BYTES], data[-16:], len(data), name)
            pixels = header_pixels(io.BytesIO(data), self.max_pixels)
        except ImageProblem as e:
            raise ImageProblem(f"{where}: {e}") from None
        return ImageRef(data_url(data, fmt), hashlib.sha256(data).hexdigest(), fmt, len(data), pixels)

    def _check(self, url: Any) -> ImageRef:
        """One reference under the rule (``path_policy.RowResources``), then read: any failure is an ImageProblem
        (a store's client refusing credentials or missing its package fails the row, never the plan)."""
        try:
            r = path_policy.RowResources(self.stores, tuple(self.roots)).check(url, self.base)
            if r.kind == "inline":
                data = _data_payload(url, self.max_bytes)
                fmt = check_bytes_shape(data[:HEAD_BYTES], data[-16:], len(data), url)
                pixels = header_pixels(io.BytesIO(data), self.max_pixels)
                return ImageRef(url, hashlib.sha256(data).hexdigest(), fmt, len(data), pixels)
            if r.kind == "storage":
                return self._check_storage(r.url)
            return self._check_local(r.local_path or url)
        except ImageProblem:
            raise
        except path_policy.PathRefused as e:
            raise ImageProblem(str(e)) from None
        except Exception as e:  # the rule: whatever a reference does is its row's error, with what it was
            raise ImageProblem(f"cannot read {_short(url)}: {type(e).__name__}: {e}") from None

    def _check_local(self, path: str) -> ImageRef:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ImageProblem(f"no such file {path}", (path, ABSENT)) from None
        except OSError as e:
            raise ImageProblem(f"cannot read {path}: {e.strerror}") from None
        read = (path, local_stamp(st))
        if not stat.S_ISREG(st.st_mode):
            raise ImageProblem(f"{path} is not a regular file", read)
        return self._checked_stream(path, st.st_size, lambda: path_policy.open_regular(path), read)

    def _check_storage(self, url: str) -> ImageRef:
        from batch_llm.io.storage import as_path

        p = as_path(url, self.options)
        try:
            info = p.fs.info(p.path)
        except FileNotFoundError:
            raise ImageProblem(f"no such object {url}", (url, ABSENT)) from None
        except OSError as e:
            raise ImageProblem(f"cannot read {url}: {e}") from None
        read = (url, storage_stamp(info))
        if info.get("type") == "directory":
            raise ImageProblem(f"{url} is a folder, not an object", read)
        return self._checked_stream(url, int(info.get("size") or 0), lambda: p.open("rb"), read)

    def _checked_stream(self, name: str, size: int, opener: Callable[[], Any], read: tuple[str, str]) -> ImageRef:
        """Size first (nothing read when over the limit), then the bytes streamed once: the head and tail
        checked, the hash computed, the pixels counted from the header; memory holds one ``READ_CHUNK``. A
        problem carries ``read``: what was read, as the plan's key holds it."""
        try:
            return self._stream(name, size, opener, read[1])
        except (ImageProblem, path_policy.PathRefused) as e:  # PathRefused: a FIFO or a folder put there since
            raise ImageProblem(str(e), read) from None

    def _stream(self, name: str, size: int, opener: Callable[[], Any], stamp: str) -> ImageRef:
        if size > self.max_bytes:
            raise _over(size, self.max_bytes)
        h = hashlib.sha256()
        first, tail, n = b"", b"", 0
        try:
            with opener() as f:
                while chunk := f.read(READ_CHUNK):
                    if n == 0:
                        first = chunk
                        if sniff(chunk[:HEAD_BYTES]) in (None, "svg"):  # not an image: said without reading the rest
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
        fmt = check_bytes_shape(first[:HEAD_BYTES], tail, n, name)
        return ImageRef(name, h.hexdigest(), fmt, n, self._pixels(first, n, opener), stamp)

    def _pixels(self, first: bytes, size: int, opener: Callable[[], Any]) -> int:
        """The header's pixels, from the first chunk read (the whole of most images), else (a header further in:
        a TIFF's directory after its pixel data) from the file opened again, PIL reading only what it needs."""
        try:
            return header_pixels(io.BytesIO(first), self.max_pixels)
        except ImageProblem as e:
            if len(first) >= size or "over input.max_image_pixels" in str(e):
                raise
        with opener() as f:
            return header_pixels(f, self.max_pixels)


# ------------------------------------------------------------------------------------------ what a plan read
class ImageReads:
    """The image files and objects a plan's rows read, one JSON line ``[url, stamp]`` each (``stamp_of``), in the
    rows' order (an image many rows name once while it is among the last ``recent`` noted): written while the
    planner scans; the plan's key holds their ``digest``, and ``stamps_digest`` tells later whether they are
    still what was read. Inline images are the input file's own bytes (its key holds them)."""

    def __init__(self, path: Any, recent: int = 4096):
        self.path, self.count, self._recent = path, 0, recent
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._hash = hashlib.sha256()
        self._file: Any = None

    def __enter__(self) -> "ImageReads":
        self._file = open(self.path, "wb")
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def note(self, read: tuple[str, str] | None) -> None:
        if read is None:
            return
        if read in self._seen:
            self._seen.move_to_end(read)
            return
        self._seen[read] = None
        if len(self._seen) > self._recent:
            self._seen.popitem(last=False)
        line = _read_line(*read)
        self._file.write(line)
        self._hash.update(line)
        self.count += 1

    def digest(self) -> str:
        return self._hash.hexdigest()


def _read_line(url: str, stamp: str) -> bytes:
    return (json.dumps([url, stamp], ensure_ascii=False) + "\n").encode()


def stamps_digest(listing: Any, options: dict | None, workers: int = 4) -> str:
    """The digest ``ImageReads`` made of the plan's list of reads (``listing``, a path), with each resource's
    stamp taken now (object stores asked on ``workers`` threads): the same digest while every one is unchanged."""
    h = hashlib.sha256()
    with listing.open("rb") as fh, ThreadPoolExecutor(max(1, workers), thread_name_prefix="image-stamp") as pool:
        while batch := list(itertools.islice(fh, 1024)):
            urls = [json.loads(line)[0] for line in batch]
            for url, stamp in zip(urls, pool.map(lambda u: stamp_of(u, options), urls)):
                h.update(_read_line(url, stamp))
    return h.hexdigest()


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
def read_image_bytes(ref: ImageRef, options: dict | None, max_bytes: int, stores: Sequence[str] = ()) -> bytes:
    """The image's bytes as the plan checked them, read again under the same rule (``path_policy.RowResources``:
    the plan's local path, still a regular file at that real path; an object of ``stores``); ImageProblem when
    they cannot be read, grew past ``max_bytes`` or are not the bytes the plan hashed."""
    where = f"image {_short(ref.url)}"
    try:
        r = path_policy.RowResources(tuple(stores), None).check(ref.url)
        if r.kind == "inline":
            data = _data_payload(ref.url, max_bytes)
        else:
            from batch_llm.io.storage import as_path

            opened = path_policy.open_regular(r.local_path) if r.kind == "local" and r.local_path else \
                as_path(r.url, options).open("rb")
            with opened as f:
                data = f.read(max_bytes + 1)
    except (ImageProblem, path_policy.PathRefused) as e:
        raise ImageProblem(f"{where}: {e}") from None
    except FileNotFoundError:
        raise ImageProblem(f"{where}: gone since the plan (no such file or object)") from None
    except OSError as e:
        raise ImageProblem(f"{where}: cannot read it: {e}") from None
    except Exception as e:  # the rule: whatever the read does is the row's error
        raise ImageProblem(f"{where}: cannot read it: {type(e).__name__}: {e}") from None
    if len(data) > max_bytes:
        raise ImageProblem(f"{where} grew past input.max_image_bytes ({_mib(max_bytes)}) since the plan")
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ImageProblem(f"{where} changed since the plan (its SHA-256 is not {ref.sha256[:12]}…): plan the run "
                           "again (clear plan_shards)")
    return data


def decode_image(data: bytes, ref: ImageRef, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Any:
    """A PIL image, decoded in full (``load``) and in RGB; ImageProblem when its header says more than
    ``max_pixels`` (told before any pixel is decoded: a small file of huge dimensions never takes their memory)
    or when PIL cannot decode it (a truncated JPEG, corrupt data past the header)."""
    from PIL import Image, UnidentifiedImageError

    where = f"image {_short(ref.url)}"
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > max_pixels:
                raise _too_many_pixels(width, height, max_pixels)
            img.load()
            return img.convert("RGB")
    except ImageProblem as e:
        raise ImageProblem(f"{where}: {e}") from None
    except Image.DecompressionBombError as e:
        raise ImageProblem(f"{where} does not decode: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageProblem(f"{where} does not decode ({FORMAT_NAME.get(ref.format, ref.format)}): {e}") from None


def load_image(ref: ImageRef | dict, options: dict | None, max_bytes: int, *,
               max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, stores: Sequence[str] = ()) -> Any:
    """The shard's load of one checked image: read, hash compared, decoded (``read_image_bytes``, ``decode_image``)."""
    ref = ref if isinstance(ref, ImageRef) else ImageRef.from_json(ref)
    return decode_image(read_image_bytes(ref, options, max_bytes, stores), ref, max_pixels)


def load_ahead(items: Iterable[T], refs_of: Callable[[T], Sequence[Any]], load: Callable[[Any], Any],
               workers: int, cost: Callable[[T], int] | None = None,
               budget: int | None = None) -> Iterator[tuple[T, list | ImageProblem | None]]:
    """``(item, its images)`` for each item, in the items' order: the decoded images of ``refs_of(item)`` (``load``
    each), the ``ImageProblem`` that stopped one, or None for an item without images.

    With ``workers`` > 1 the loads run on that many threads, up to ``2 × workers`` items ahead of the consumer: an
    object store's reads overlap, and PIL decodes outside the GIL, so a shard of image rows keeps its engine fed
    (the window is small because each item ahead holds its images decoded). With a ``budget``, the window also
    holds at most that many bytes of ``cost`` (an item's images decoded, from their headers: ``decoded_bytes``):
    an item whose images would take it past the budget starts loading only once the items before it have gone
    to the consumer; one item alone always loads, whatever its cost.
    An item is yielded as soon as it and every item before it are loaded; a text item waits only for those before
    it. The consumer's thread pulls ``items`` (whatever that iterator does, e.g. failing a row, stays on it); the
    threads only load. Any other exception of a load is raised at its item, as a load one at a time would."""
    if workers <= 1:
        for item in items:
            yield item, _load_all(refs_of(item), load)
        return
    window = 2 * workers
    pending: deque[tuple[T, Future | None, int]] = deque()
    held = 0  # the cost of the items in the window
    pool: ThreadPoolExecutor | None = None

    def pop() -> tuple[T, list | ImageProblem | None]:
        nonlocal held
        head, fut, c = pending.popleft()
        held -= c
        return head, (fut.result() if fut is not None else None)

    try:
        for item in items:
            refs = refs_of(item)
            if not refs and not pending:  # nothing loading: a text item goes straight through (most rows of a day)
                yield item, None
                continue
            if refs:
                c = cost(item) if cost is not None else 0
                while budget is not None and pending and held + c > budget:  # room first: the items before it go
                    yield pop()
                pool = pool or ThreadPoolExecutor(workers, thread_name_prefix="image-load")
                pending.append((item, pool.submit(_load_all, list(refs), load), c))
                held += c
            else:
                pending.append((item, None, 0))
            while pending and (len(pending) > window or pending[0][1] is None or pending[0][1].done()):
                yield pop()
        while pending:
            yield pop()
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
    from pathlib import Path

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return True  # nothing to go by: the engine decides
    text = json.dumps(config).lower()
    return any(word in text for word in ("vision", "image", "visual", "pixel"))
