"""The result cache's table format: immutable sorted-string tables, how one is written (``TableWriter``) and the
batched range reads that open and read them (``RangeReader``, ``open_tables``, ``read_top_blocks``).

Layout: ``<root>/<namespace>/{s,r}-<max_t>-<uuid>.sst``. ``s-`` is a shard's table (one per shard, written once at
its end), ``r-`` a compacted run; ``max_t`` (unix seconds, the newest entry's write time) is in the name so that
retention deletes a dead table from a listing, without reading it; the uuid makes names unique, so concurrent
shards never write the same object. One table::

    values    one JSON line per entry, sorted by (key64, key): {"key": <full key>, "t": <unix s>, "output", ...}
    (pad to 8)
    keys      uint64 key64 of every entry (the first 16 hex digits of the key), ascending
    offsets   uint64 n+1 byte offsets of the lines in ``values``
    top       uint64 the first key64 of every page of 64 index entries
    root      uint64 the first key64 of every block of 64 top entries (4,096 entries); absent in tables written
              before it existed (nothing else differs: readers of either read both), whose top is read whole
    footer    104 bytes: magic, version, page size, n, section offsets, min/max t, min/max key64, magic

Why this shape: a lookup of k keys against a table of n entries reads the footer and the root (one range read
from the end: 8 bytes per 4,096 entries), then the 512-byte blocks of the top index that can hold a wanted key,
then only the 512-byte key pages that can hold one, then 16 bytes of offsets per candidate, then the value lines
of the candidates: about min(512 k, 8 n) bytes of key pages per table plus 16 bytes and one entry per hit,
never the history's values, and no index read whole once a table outgrows its tail read (a table of 300M
entries: a 586 KB root, not a 37.5 MB top). Ranges closer than ``gap_bytes`` are read as one (a request costs
more than a few KiB of transfer); every round is one batch of range reads over all tables (``fs.cat_ranges``,
which s3fs runs concurrently): one round for the footers, then four per 64k wanted keys (top blocks where a
table has a root, key pages, offsets, values), whatever the number of tables. Every candidate is verified
against its full key (key64 only narrows the search) and its write time. A miss costs only index pages: no
offsets, no values.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import struct
import uuid
from dataclasses import dataclass

import msgspec
import numpy as np

from batch_llm.io.storage import AtomicWriter

log = logging.getLogger("batch_llm.cache.table")

PAGE = 64                        # index entries per page of the top index
MAX_RANGE_BYTES = 8 * 2**20      # merged ranges are split at this size (parallel reads, bounded memory)
BATCH_BYTES = 64 * 2**20         # bytes asked for in one batch of range reads
BATCH_RANGES = 1024
TAIL_BYTES = 64 * 2**10          # read from a table's end at first: the footer and, mostly, the top index
LOCAL_GAP_BYTES = 4 * 2**10      # ranges closer than this are read as one: a local read costs little...
REMOTE_GAP_BYTES = 32 * 2**10    # ...an object-store request about as much as this many bytes of transfer
MAGIC = b"BLLMSST1"
VERSION = 1
FOOTER = struct.Struct("<8sIIQQQQQQddQQ8s")
TABLE_NAME = re.compile(r"^([sr])-(\d{10,})-([0-9a-f]{32})\.sst$")  # {kind}-{max_t}-{uuid}.sst
_HEX16 = re.compile(r"[0-9a-f]{16}")
_ENCODE = msgspec.json.Encoder(enc_hook=str).encode  # compact, non-ASCII kept, key order kept
DECODE = msgspec.json.Decoder().decode


def key64(key: str) -> int:
    """The index key: the first 16 hex digits of a sha256-hex key; any other string is hashed first."""
    head = key[:16]
    if len(head) == 16 and _HEX16.fullmatch(head):
        return int(head, 16)
    return int(hashlib.sha256(key.encode()).hexdigest()[:16], 16)


_HEX_RUN = re.compile(r"[0-9a-f]*")


def key64_array(keys: list[str]) -> np.ndarray:
    """``key64`` of many keys: one hex decode when they all are sha256-hex keys (the usual case)."""
    heads = "".join(k[:16] for k in keys)
    if len(heads) == 16 * len(keys) and _HEX_RUN.fullmatch(heads):
        return np.frombuffer(bytes.fromhex(heads), dtype=">u8").astype(np.uint64)
    return np.fromiter(map(key64, keys), dtype=np.uint64, count=len(keys))


def table_name(kind: str, max_t: float) -> str:
    """A new table's object name: ``{kind}-{max_t}-{uuid}.sst`` (``TABLE_NAME``)."""
    return f"{kind}-{math.ceil(max_t):010d}-{uuid.uuid4().hex}.sst"


@dataclass(frozen=True)
class Table:
    name: str
    path: str      # the filesystem's own path (a local path, or bucket/key)
    size: int
    kind: str      # "s" shard table, "r" compacted run
    max_t: int


@dataclass
class TableMeta:
    table: Table
    n: int
    values_len: int
    keys_off: int
    offsets_off: int
    top_off: int
    n_top: int
    top: np.ndarray | None   # the whole top index; None: read by blocks through ``root`` (``read_top_blocks``)
    root: np.ndarray | None
    min_t: float
    max_t: float
    min_k64: int
    max_k64: int


def parse_footer(table: Table, tail: bytes) -> tuple:
    if len(tail) < FOOTER.size:
        raise ValueError(f"{table.name}: {len(tail)} bytes, shorter than a footer")
    f = FOOTER.unpack(tail[-FOOTER.size:])
    if f[0] != MAGIC or f[-1] != MAGIC or f[1] != VERSION:
        raise ValueError(f"{table.name}: not a result-cache table (magic {f[0]!r}, version {f[1]})")
    return f


def table_meta(table: Table, f: tuple, top: np.ndarray | None, root: np.ndarray | None = None) -> TableMeta:
    _, _, _page, n, values_len, keys_off, offsets_off, top_off, n_top, min_t, max_t, min_k, max_k, _ = f
    return TableMeta(table, n, values_len, keys_off, offsets_off, top_off, n_top, top, root, min_t, max_t, min_k,
                     max_k)


def root_span(table: Table, f: tuple) -> tuple[int, int] | None:
    """(start, end) of the table's root index, or None when it has none (written before roots existed): the
    bytes between the top index and the footer are exactly one key64 per block of PAGE top entries."""
    top_off, n_top = f[7], f[8]
    start, end = top_off + 8 * n_top, table.size - FOOTER.size
    return (start, end) if end - start == 8 * -(-n_top // PAGE) and n_top else None


def merge_item(line: bytes) -> tuple[int, str, float, bytes]:
    """(key64, key, -t, line) of a value line: the merge order, newest first within a key. The fast path
    reads the key and t from where ``entry_line`` puts them; anything else is parsed as JSON."""
    if line.startswith(b'{"key":"'):
        end = line.find(b'"', 8)
        if end > 0 and b"\\" not in line[8:end] and line.startswith(b',"t":', end + 1):
            i = j = end + 6
            while line[j] not in b",}":
                j += 1
            key = line[8:end].decode("utf-8")
            tb = line[i:j]
            return key64(key), key, -(float(tb) if b"." in tb or b"e" in tb else int(tb)), line
    d = DECODE(line)
    return key64(d["key"]), d["key"], -d["t"], line


def entry_line(entry: dict, t: float) -> bytes:
    """A value line: compact JSON, the key first and t second (``merge_item`` reads them without parsing)."""
    return _ENCODE({"key": entry["key"], "t": t, **{k: v for k, v in entry.items() if k not in ("key", "t")}}) + b"\n"


def coalesce(starts: np.ndarray, ends: np.ndarray, gap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranges sorted by start, merged when closer than ``gap`` (and split at MAX_RANGE_BYTES boundaries):
    (the merged range of each input, merged starts, merged ends)."""
    run_end = np.maximum.accumulate(ends)
    brk = np.ones(len(starts), dtype=bool)
    if len(starts) > 1:
        brk[1:] = ((starts[1:] - run_end[:-1] > gap) |
                   (starts[1:] // MAX_RANGE_BYTES != starts[:-1] // MAX_RANGE_BYTES))
    first = np.flatnonzero(brk)
    return np.cumsum(brk) - 1, starts[first], np.maximum.reduceat(ends, first)


def all_read(parts: list[bytes | FileNotFoundError]) -> list[bytes] | None:
    """The bytes of every part, or None when one was missing (its table deleted under the reader)."""
    found = [p for p in parts if not isinstance(p, FileNotFoundError)]
    return found if len(found) == len(parts) else None


class RangeReader:
    """Batched, counted range reads: ``fs.cat_ranges`` on object stores (concurrent in s3fs), ``os.pread`` on
    one descriptor per file locally. A missing object comes back as a FileNotFoundError in its place."""

    def __init__(self, fs, local: bool, stats: dict):
        self.fs, self.local, self.stats = fs, local, stats
        self._fds: dict[str, int] = {}
        self._objects: set[str] = set()

    def read(self, reqs: list[tuple[str, int, int]]) -> list[bytes | FileNotFoundError]:
        out: list = [None] * len(reqs)
        if self.local:
            for i, (p, s, e) in enumerate(reqs):
                try:
                    fd = self._fds.get(p)
                    if fd is None:
                        fd = self._fds[p] = os.open(p, os.O_RDONLY)
                    out[i] = os.pread(fd, e - s, s)
                except FileNotFoundError as exc:
                    out[i] = exc
        else:
            i = 0
            while i < len(reqs):
                j, size = i, 0
                while j < len(reqs) and j - i < BATCH_RANGES and (j == i or size + reqs[j][2] - reqs[j][1] <= BATCH_BYTES):
                    size += reqs[j][2] - reqs[j][1]
                    j += 1
                batch = reqs[i:j]
                got = self.fs.cat_ranges([r[0] for r in batch], [r[1] for r in batch], [r[2] for r in batch],
                                         on_error="return")
                for k, r in enumerate(got):
                    if isinstance(r, BaseException) and not isinstance(r, FileNotFoundError):
                        raise r
                    out[i + k] = r
                i = j
        for (p, _, _), r in zip(reqs, out):
            if isinstance(r, bytes):
                self.stats["ranges_read"] += 1
                self.stats["bytes_read"] += len(r)
                self._objects.add(p)
        self.stats["objects_read"] = len(self._objects)
        return out

    def read_one(self, path: str, start: int, end: int) -> bytes:
        r = self.read([(path, start, end)])[0]
        if isinstance(r, FileNotFoundError):
            raise r
        return r

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def open_tables(reader: RangeReader, tables: list[Table]) -> tuple[list[TableMeta], list[Table]]:
    """Footers and the top indexes (of a table whose top the tail read does not hold and that has a root: its root
    instead) of the tables, in two batched rounds at most: (metas, tables gone)."""
    tails = reader.read([(t.path, max(0, t.size - TAIL_BYTES), t.size) for t in tables])
    gone, parsed, more = [], [], []
    for t, tail in zip(tables, tails):
        if isinstance(tail, FileNotFoundError):
            gone.append(t)
            continue
        tail_start = max(0, t.size - TAIL_BYTES)
        try:
            f = parse_footer(t, tail)
        except ValueError as e:
            log.warning("result cache: skipping %s: %s", t.path, e)
            continue
        top_off, n_top = f[7], f[8]
        span = root_span(t, f)
        by_root = span is not None and top_off < tail_start  # a top in the tail read costs nothing more
        start, end = span if span and by_root else (top_off, top_off + 8 * n_top)
        parsed.append((t, f, tail, tail_start, by_root, start, end))
        if start < tail_start:  # the index wanted starts before the tail read
            more.append((t.path, start, tail_start))
    extra = dict(zip((m[0] for m in more), reader.read(more))) if more else {}
    metas = []
    for t, f, tail, tail_start, by_root, start, end in parsed:
        if start < tail_start:
            head = extra[t.path]
            if isinstance(head, FileNotFoundError):
                gone.append(t)
                continue
            raw = head + tail[:end - tail_start]
        else:
            raw = tail[start - tail_start:end - tail_start]
        idx = np.frombuffer(raw, dtype="<u8")
        metas.append(table_meta(t, f, None, idx) if by_root else table_meta(t, f, idx))
    return metas, gone


def read_top_blocks(reader: RangeReader, wanted: list[tuple[TableMeta, np.ndarray]], gap: int,
                    gone: set[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The parts of the top indexes that can hold the wanted key64s, in one batch of range reads: per table
    (by name) (page numbers, their first key64s), ascending. A table with its whole top in memory gives it
    whole; of one looked up through its root, the blocks of PAGE top entries whose key range covers a wanted
    key64 (and the block before, where a key64 equals a block's first: its run may start there)."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    plans: list[tuple] = []
    reqs: list[tuple[str, int, int]] = []
    for m, w in wanted:
        if m.top is not None:
            out[m.table.name] = (np.arange(len(m.top)), m.top)
            continue
        assert m.root is not None
        hi = np.searchsorted(m.root, w, "right") - 1
        lo = np.maximum(np.searchsorted(m.root, w, "left") - 1, 0)
        runs = [hi] + [np.arange(lo[i], hi[i]) for i in np.flatnonzero(lo < hi)]
        blocks = np.unique(np.concatenate(runs))
        p0 = blocks * PAGE
        p1 = np.minimum(p0 + PAGE, m.n_top)
        gid, gs, ge = coalesce(m.top_off + p0 * 8, m.top_off + p1 * 8, gap)
        plans.append((m, gs, ge, len(reqs)))
        reqs.extend((m.table.path, int(a), int(b)) for a, b in zip(gs, ge))
    got = reader.read(reqs) if reqs else []
    for m, gs, ge, at in plans:
        parts = all_read(got[at:at + len(gs)])
        if parts is None:
            gone.add(m.table.name)
            continue
        pages = np.concatenate([np.arange((a - m.top_off) // 8, (b - m.top_off) // 8) for a, b in zip(gs, ge)])
        out[m.table.name] = (pages, np.concatenate([np.frombuffer(p, dtype="<u8") for p in parts]))
    return out


class TableWriter:
    """One new table at ``path``, streamed: value lines added in (key64, key) order go out as they come, their
    key64, offsets and top entries wait in local files under ``tmp`` and follow them, then the root and the
    footer; memory stays bounded whatever the table's size. ``add`` takes one entry, ``add_block`` many at once
    (their arrays). The object is visible only once ``commit`` returns (``AtomicWriter``)."""

    def __init__(self, path, tmp: str):
        self._w = AtomicWriter(path)
        self._kf = open(os.path.join(tmp, "keys"), "w+b")
        self._of = open(os.path.join(tmp, "offsets"), "w+b")
        self._tf = open(os.path.join(tmp, "top"), "w+b")
        self._keys: list[int] = []
        self._offs: list[int] = []
        self._top: list[int] = []
        self._n_top = 0
        self._out = bytearray()
        self._pos = 0
        self._min_t, self._max_t = math.inf, -math.inf
        self._first_k64: int | None = None
        self._last_k64 = 0
        self.n = 0

    def add(self, k64: int, t: float, line: bytes) -> None:
        if self.n % PAGE == 0:
            self._top.append(k64)
        if self._first_k64 is None:
            self._first_k64 = k64
        self._keys.append(k64)
        self._offs.append(self._pos)
        self._out += line
        self._pos += len(line)
        if len(self._out) >= 1 << 20:
            self._w.write(bytes(self._out))
            self._out.clear()
        self.n += 1
        self._min_t, self._max_t = min(self._min_t, t), max(self._max_t, t)
        self._last_k64 = k64
        if len(self._keys) >= 1 << 16:
            self._spill_index()

    def add_block(self, k64: np.ndarray, lengths: np.ndarray, data: bytes, min_t: float, max_t: float) -> None:
        """Entries in (key64, key) order after those added so far: their key64s, the byte length of each
        value line, the lines themselves (``data``, concatenated) and the range of their write times."""
        if not len(k64):
            return
        self._spill_index()
        self._w.write(bytes(self._out))
        self._out.clear()
        k64 = np.asarray(k64, dtype="<u8")
        offs = np.empty(len(k64), dtype="<u8")
        offs[0] = self._pos
        np.cumsum(lengths[:-1], out=offs[1:])
        offs[1:] += self._pos
        k64.tofile(self._kf)
        offs.tofile(self._of)
        top = k64[(-self.n) % PAGE::PAGE]
        top.tofile(self._tf)
        self._n_top += len(top)
        self._w.write(data)
        self._pos += len(data)
        if self._first_k64 is None:
            self._first_k64 = int(k64[0])
        self._last_k64 = int(k64[-1])
        self.n += len(k64)
        self._min_t, self._max_t = min(self._min_t, min_t), max(self._max_t, max_t)

    def _spill_index(self) -> None:
        np.asarray(self._keys, dtype="<u8").tofile(self._kf)
        np.asarray(self._offs, dtype="<u8").tofile(self._of)
        np.asarray(self._top, dtype="<u8").tofile(self._tf)
        self._n_top += len(self._top)
        self._keys, self._offs, self._top = [], [], []

    def commit(self) -> int:
        """Writes the indexes and the footer after the values and commits the table; its size in bytes."""
        w = self._w
        w.write(bytes(self._out))
        values_len = self._pos
        self._offs.append(values_len)  # n + 1 offsets: the last one ends the last line
        self._spill_index()
        pad = -values_len % 8
        w.write(b"\n" * pad)
        pos = values_len + pad
        keys_off = pos
        pos += _copy(self._kf, w)
        offsets_off = pos
        pos += _copy(self._of, w)
        top_off = pos
        root: list[np.ndarray] = []
        pos += _copy(self._tf, w, every=PAGE, sample=root)
        root_bytes = np.concatenate(root).astype("<u8").tobytes() if root else b""
        w.write(root_bytes)
        pos += len(root_bytes)
        footer = FOOTER.pack(MAGIC, VERSION, PAGE, self.n, values_len, keys_off, offsets_off, top_off, self._n_top,
                             float(self._min_t), float(self._max_t), self._first_k64 or 0, self._last_k64, MAGIC)
        w.write(footer)
        pos += len(footer)
        w.commit()
        self._close_files()
        return pos

    def abort(self) -> None:
        self._w.abort()
        self._close_files()

    def _close_files(self) -> None:
        self._kf.close()
        self._of.close()
        self._tf.close()


def _copy(src, w: AtomicWriter, *, every: int = 0, sample: list | None = None) -> int:
    """Copies a local index file into the table; with ``every``, also keeps every ``every``-th uint64 of it in
    ``sample`` (the root of the top index)."""
    src.flush()
    src.seek(0)
    n = 0
    while block := src.read(8 * PAGE * 2**14):  # a multiple of 8 * PAGE: the sample stays aligned
        w.write(block)
        if sample is not None:
            sample.append(np.frombuffer(block, dtype="<u8")[::every])
        n += len(block)
    return n
