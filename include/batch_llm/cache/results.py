"""The result cache: generated rows keyed by content, in object storage; a lookup costs what the run asks for,
not what the history holds.

A key hashes everything that decides an output: the namespace what a run's rows share (``namespace``: the
model's weights, adapter and quantization, the chat template, the sampling, the engine's settings), the row key
the prompt that is rendered (chat messages or token ids) and the row's own parameters. A hit is only ever an
earlier result for the same full key, never older than ``max_age_days``.

Layout: ``<root>/<namespace>/{s,r}-<max_t>-<uuid>.sst``, immutable sorted-string tables. ``s-`` is a shard's
table (one per shard, written once at its end), ``r-`` a compacted run; ``max_t`` (unix seconds, the newest
entry's write time) is in the name so that retention deletes a dead table from a listing, without reading it;
the uuid makes names unique, so concurrent shards never write the same object. One table::

    values    one JSON line per entry, sorted by (key64, key): {"key": <full key>, "t": <unix s>, "output", ...}
    (pad to 8)
    keys      uint64 key64 of every entry (the first 16 hex digits of the key), ascending
    offsets   uint64 n+1 byte offsets of the lines in ``values``
    top       uint64 the first key64 of every page of 64 index entries
    footer    104 bytes: magic, version, page size, n, section offsets, min/max t, min/max key64, magic

Why this shape: a lookup of k keys against a table of n entries reads the footer and the top index (one range
read from the end: 8 bytes per 64 entries), then only the 512-byte key pages that can hold a wanted key, then
16 bytes of offsets per candidate, then the value lines of the candidates: about min(512 k, 8 n) bytes of
key pages per table plus 16 bytes and one entry per hit, never the history's values. Ranges closer than
``gap_bytes`` are read as one (a request costs more than a few KiB
of transfer); every round is one batch of range reads over all tables (``fs.cat_ranges``, which s3fs runs
concurrently): one round for the footers, then three per 64k wanted keys (key pages, offsets, values),
whatever the number of tables. Every candidate is verified against its full key (key64 only narrows the
search) and its write time. A miss costs only key pages: no offsets, no values.

Writes: a shard streams its newly generated rows into ``write_table`` at its end; the entries are sorted in
bounded memory (runs of 50k entries spilled to local temporary files, then ``heapq.merge``) and streamed into
``atomic_writer``: the object is visible only once complete. A retry writes the table again, which is harmless
(a duplicate is dropped at compaction).

Maintenance (``maintain``, run by the publish task): tables whose newest entry is expired (by the name, then
checked in the footer) are deleted; once ``compact_after_tables`` shard tables exist they are merged (streamed
k-way merge, newest entry of a key wins, expired entries dropped) into one run; when more than ``max_runs`` runs
would exist, all runs are merged into one. It merges only the tables it listed, commits its output, and only
then deletes its inputs, so shards writing meanwhile lose nothing; two compactions racing can leave duplicates,
never a lost or wrong entry. A table it cannot read (a newer format, a damaged file) is never deleted nor
merged: it is kept and named in the stats (``unreadable_tables_kept``). A lookup that meets a table deleted
under it lists again and retries once for what is still missing (at worst a miss: the row is generated again).
With maintenance after each run a namespace holds at most ``compact_after_tables - 1 + max_runs`` tables, plus
the shards of the runs since the last maintenance: with the defaults (64, 8) and shard counts of a few hundred,
fewer than 1,000 objects whatever the history.

Each namespace is maintained with the settings of the pipelines that write it, not of the pipeline whose
publish runs maintenance: publish records its pipeline's settings (``record_retention``) in the namespaces its
run wrote (``<ns>/_retention.<pipeline>.json``); ``maintain_all`` applies, per namespace, the longest retention
any of them asked for (null, keep forever, wins). A namespace without a record is only compacted, never expired;
one with a record it cannot read is left alone.

An entry's ``t`` is when it was generated, not when it was last served: ``max_age_days`` bounds how old a
reused result can be. The legacy layout (``seg-<uuid>.jsonl`` segments) is not read by lookups; ``maintain``
folds any it finds into a table.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import logging
import math
import os
import pickle
import re
import struct
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from batch_llm.io.identity import stable_hash
from batch_llm.io.storage import AtomicWriter, Location, is_local, iter_jsonl, read_json, write_json

log = logging.getLogger("batch_llm.cache.results")

PAGE = 64                        # index entries per page of the top index
SORT_RUN_ENTRIES = 50_000        # entries sorted in memory before a run is spilled to a local file
SORT_RUN_BYTES = 64 * 2**20
WAVE_KEYS = 65_536               # wanted keys looked up per round trip, at most...
WAVE_PAGE_BYTES = 64 * 2**20     # ...and fewer when their key pages would come to more than this
MAX_RANGE_BYTES = 8 * 2**20      # merged ranges are split at this size (parallel reads, bounded memory)
BATCH_BYTES = 64 * 2**20         # bytes asked for in one batch of range reads
BATCH_RANGES = 1024
TAIL_BYTES = 64 * 2**10          # read from a table's end at first: the footer and, mostly, the top index
LOCAL_GAP_BYTES = 4 * 2**10      # ranges closer than this are read as one: a local read costs little...
REMOTE_GAP_BYTES = 32 * 2**10    # ...an object-store request about as much as this many bytes of transfer
MAGIC = b"BLLMSST1"
VERSION = 1
FOOTER = struct.Struct("<8sIIQQQQQQddQQ8s")
_NAME = re.compile(r"^([sr])-(\d{10,})-([0-9a-f]{32})\.sst$")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_DAY = 86400.0
_ENCODE = msgspec.json.Encoder(enc_hook=str).encode  # compact, non-ASCII kept, key order kept
_DECODE = msgspec.json.Decoder().decode
RETENTION_PREFIX = "_retention."  # <ns>/_retention.<pipeline>.json: the settings of a pipeline that writes ns
RETENTION_FORMAT = 1


def namespace(identity: dict) -> str:
    """The namespace of the rows made with ``identity`` (``identity.output_identity``: everything a run's rows
    share that changes an output); changing any of it misses the cache."""
    return stable_hash(identity)[:24]


def prompt_key(prompt: list | dict, params: dict | None = None) -> str:
    """What is rendered: the chat messages (the template is in the namespace), a completion text or
    pre-tokenized ids, plus the row's own sampling parameters when it sets any (``RowParams.to_json``)."""
    if params and set(params) == {"max_tokens"}:
        params = params["max_tokens"]  # the key rows with their own max_tokens had before other row params
    blob = json.dumps(prompt if not params else [prompt, params], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def key64(key: str) -> int:
    """The index key: the first 16 hex digits of a sha256-hex key; any other string is hashed first."""
    head = key[:16]
    if len(head) == 16 and _HEX16.fullmatch(head):
        return int(head, 16)
    return int(hashlib.sha256(key.encode()).hexdigest()[:16], 16)


_HEX_RUN = re.compile(r"[0-9a-f]*")


def _key64_array(keys: list[str]) -> np.ndarray:
    """``key64`` of many keys: one hex decode when they all are sha256-hex keys (the usual case)."""
    heads = "".join(k[:16] for k in keys)
    if len(heads) == 16 * len(keys) and _HEX_RUN.fullmatch(heads):
        return np.frombuffer(bytes.fromhex(heads), dtype=">u8").astype(np.uint64)
    return np.fromiter(map(key64, keys), dtype=np.uint64, count=len(keys))


# ------------------------------------------------------------------------------------------ table parts
@dataclass(frozen=True)
class _Table:
    name: str
    path: str      # the filesystem's own path (a local path, or bucket/key)
    size: int
    kind: str      # "s" shard table, "r" compacted run
    max_t: int


@dataclass
class _Meta:
    table: _Table
    n: int
    values_len: int
    keys_off: int
    offsets_off: int
    top: np.ndarray
    min_t: float
    max_t: float
    min_k64: int
    max_k64: int


def _parse_footer(table: _Table, tail: bytes) -> tuple:
    if len(tail) < FOOTER.size:
        raise ValueError(f"{table.name}: {len(tail)} bytes, shorter than a footer")
    f = FOOTER.unpack(tail[-FOOTER.size:])
    if f[0] != MAGIC or f[-1] != MAGIC or f[1] != VERSION:
        raise ValueError(f"{table.name}: not a result-cache table (magic {f[0]!r}, version {f[1]})")
    return f


def _meta(table: _Table, f: tuple, top: np.ndarray) -> _Meta:
    _, _, _page, n, values_len, keys_off, offsets_off, _top_off, _n_top, min_t, max_t, min_k, max_k, _ = f
    return _Meta(table, n, values_len, keys_off, offsets_off, top, min_t, max_t, min_k, max_k)


def _item(line: bytes) -> tuple[int, str, float, bytes]:
    """(key64, key, -t, line) of a value line: the merge order, newest first within a key. The fast path
    reads the key and t from where ``_line`` puts them; anything else is parsed as JSON."""
    if line.startswith(b'{"key":"'):
        end = line.find(b'"', 8)
        if end > 0 and b"\\" not in line[8:end] and line.startswith(b',"t":', end + 1):
            i = j = end + 6
            while line[j] not in b",}":
                j += 1
            key = line[8:end].decode("utf-8")
            tb = line[i:j]
            return key64(key), key, -(float(tb) if b"." in tb or b"e" in tb else int(tb)), line
    d = _DECODE(line)
    return key64(d["key"]), d["key"], -d["t"], line


def _line(entry: dict, t: float) -> bytes:
    """A value line: compact JSON, the key first and t second (``_item`` reads them without parsing)."""
    return _ENCODE({"key": entry["key"], "t": t, **{k: v for k, v in entry.items() if k not in ("key", "t")}}) + b"\n"


def _coalesce(starts: np.ndarray, ends: np.ndarray, gap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranges sorted by start, merged when closer than ``gap`` (and split at MAX_RANGE_BYTES boundaries):
    (the merged range of each input, merged starts, merged ends)."""
    run_end = np.maximum.accumulate(ends)
    brk = np.ones(len(starts), dtype=bool)
    if len(starts) > 1:
        brk[1:] = ((starts[1:] - run_end[:-1] > gap) |
                   (starts[1:] // MAX_RANGE_BYTES != starts[:-1] // MAX_RANGE_BYTES))
    first = np.flatnonzero(brk)
    return np.cumsum(brk) - 1, starts[first], np.maximum.reduceat(ends, first)


def _all_read(parts: list[bytes | FileNotFoundError]) -> list[bytes] | None:
    """The bytes of every part, or None when one was missing (its table deleted under the reader)."""
    found = [p for p in parts if not isinstance(p, FileNotFoundError)]
    return found if len(found) == len(parts) else None


class _Reader:
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


def _open_tables(reader: _Reader, tables: list[_Table]) -> tuple[list[_Meta], list[_Table]]:
    """Footers and top indexes of the tables, in two batched rounds at most: (metas, tables gone)."""
    tails = reader.read([(t.path, max(0, t.size - TAIL_BYTES), t.size) for t in tables])
    gone, parsed, more = [], [], []
    for t, tail in zip(tables, tails):
        if isinstance(tail, FileNotFoundError):
            gone.append(t)
            continue
        tail_start = max(0, t.size - TAIL_BYTES)
        try:
            f = _parse_footer(t, tail)
        except ValueError as e:
            log.warning("result cache: skipping %s: %s", t.path, e)
            continue
        parsed.append((t, f, tail, tail_start))
        if f[7] < tail_start:  # the top index starts before the tail read
            more.append((t.path, f[7], tail_start))
    extra = dict(zip((m[0] for m in more), reader.read(more))) if more else {}
    metas = []
    for t, f, tail, tail_start in parsed:
        top_off, n_top = f[7], f[8]
        if top_off < tail_start:
            head = extra[t.path]
            if isinstance(head, FileNotFoundError):
                gone.append(t)
                continue
            raw = head + tail[:top_off + 8 * n_top - tail_start]
        else:
            raw = tail[top_off - tail_start:top_off - tail_start + 8 * n_top]
        metas.append(_meta(t, f, np.frombuffer(raw, dtype="<u8")))
    return metas, gone


# ------------------------------------------------------------------------------------------ the cache
class ResultCache:
    """One namespace of the cache. ``gap_bytes``: ranges closer than this are read as one (default 4 KiB on a
    local disk, 32 KiB on an object store); ``clock``: unix seconds (tests and benchmarks fake days)."""

    def __init__(self, root: Location, ns: str, *, max_age_days: float | None = None, gap_bytes: int | None = None,
                 clock: Callable[[], float] = time.time):
        self.ns = ns
        self.dir = root.child(ns)
        self._upath = self.dir.path()
        self.local = is_local(self._upath)
        self.fs = self._upath.fs
        self.max_age_days = max_age_days
        self.gap_bytes = gap_bytes if gap_bytes is not None else (LOCAL_GAP_BYTES if self.local else REMOTE_GAP_BYTES)
        self.clock = clock

    # ---------------------------------------------------------------------------------- listing
    def _fs_path(self, name: str) -> str:
        return f"{str(self._upath) if self.local else self._upath.path.rstrip('/')}/{name}"

    def _entries(self) -> list[tuple[str, int]]:
        """(name, size) of every object directly under the namespace."""
        if self.local:
            out = []
            try:
                with os.scandir(str(self._upath)) as it:
                    for e in it:
                        try:
                            if e.is_file():
                                out.append((e.name, e.stat().st_size))
                        except FileNotFoundError:  # deleted while listed (a compaction): only that one is gone
                            continue
            except FileNotFoundError:
                pass
            return out
        try:
            listing = self.fs.ls(self._upath.path, detail=True)
        except FileNotFoundError:
            return []
        return [(d["name"].rstrip("/").rsplit("/", 1)[-1], int(d.get("size") or 0))
                for d in listing if d.get("type") != "directory"]

    def tables(self) -> list[_Table]:
        """The namespace's tables, newest first (by the write time of their newest entry)."""
        out = []
        for name, size in self._entries():
            m = _NAME.match(name)
            if m:
                out.append(_Table(name, self._fs_path(name), size, m.group(1), int(m.group(2))))
        return sorted(out, key=lambda t: (-t.max_t, t.name))

    def _cutoff(self, max_age_days: float | None) -> float | None:
        return None if max_age_days is None else self.clock() - max_age_days * _DAY

    def _delete(self, table: _Table) -> None:
        try:
            if self.local:
                os.unlink(table.path)
            else:
                self.fs.rm_file(table.path)
        except FileNotFoundError:
            pass

    # ---------------------------------------------------------------------------------- lookup
    def lookup(self, keys: Iterable[str]) -> "Lookup":
        """The cached entries of the wanted keys, streamed: iterate the result (each key found comes once, as
        its stored entry: key, t, output, finish_reason, token counts); ``.stats`` holds what it cost. The keys
        are taken and the namespace listed now; the tables are read as it is iterated."""
        return Lookup(self, keys)

    # ---------------------------------------------------------------------------------- writes
    def write_table(self, entries: Iterable[dict], *, kind: str = "s") -> dict | None:
        """Writes the entries (key, output, finish_reason, token counts; ``t`` defaults to now) as one new
        table, sorted in bounded memory, one entry per key (the newest). Returns {name, entries, bytes}, or
        None when there was nothing to write."""
        now = self.clock()
        with tempfile.TemporaryDirectory(prefix="batch_llm_sst_") as tmp:
            sorter = _ExternalSort(tmp)
            max_t = None
            for e in entries:
                t = e.get("t")
                if t is None:
                    t = int(now)
                line = _line(e, t)
                sorter.add((key64(e["key"]), e["key"], -t, line), len(line))
                max_t = t if max_t is None or t > max_t else max_t
            if max_t is None:
                return None
            items = sorter.sorted_items()
            stats = _merge_stats()
            out = self._write_sorted(items, kind, max_t, None, stats)
        return {"name": out, "entries": stats["entries_written"], "bytes": stats["bytes_written"]} if out else None

    def _write_sorted(self, items: Iterator[tuple], kind: str, max_t: float, cutoff: float | None,
                      stats: dict) -> str | None:
        """Streams (key64, key, -t, line) items in order into one new table: the first item of a key wins (the
        newest), expired ones are dropped. Returns the table's name, or None when nothing was left."""
        name = f"{kind}-{math.ceil(max_t):010d}-{uuid.uuid4().hex}.sst"
        w: AtomicWriter | None = None
        with tempfile.TemporaryDirectory(prefix="batch_llm_sst_idx_") as tmp:
            kf = open(os.path.join(tmp, "keys"), "w+b")
            of = open(os.path.join(tmp, "offsets"), "w+b")
            try:
                keys: list[int] = []
                offs: list[int] = []
                top: list[int] = []
                pos = n = 0
                out = bytearray()
                last_key = None
                min_t, hi_t = math.inf, -math.inf
                for k64, key, neg_t, line in items:
                    stats["entries_in"] += 1
                    if key == last_key:
                        stats["duplicates_dropped"] += 1
                        continue
                    last_key = key
                    if cutoff is not None and -neg_t < cutoff:
                        stats["expired_entries_dropped"] += 1
                        continue
                    if w is None:
                        w = AtomicWriter(self.dir.child(name).path())
                    if n % PAGE == 0:
                        top.append(k64)
                    keys.append(k64)
                    offs.append(pos)
                    out += line
                    pos += len(line)
                    if len(out) >= 1 << 20:
                        w.write(bytes(out))
                        out.clear()
                    n += 1
                    min_t, hi_t = min(min_t, -neg_t), max(hi_t, -neg_t)
                    if len(keys) >= 1 << 16:
                        np.asarray(keys, dtype="<u8").tofile(kf)
                        np.asarray(offs, dtype="<u8").tofile(of)
                        keys, offs = [], []
                if w is None:
                    return None
                w.write(bytes(out))
                min_k = top[0]
                max_k = keys[-1] if keys else None
                np.asarray(keys, dtype="<u8").tofile(kf)
                np.asarray(offs + [pos], dtype="<u8").tofile(of)
                if max_k is None:  # the last key is in the spilled part
                    kf.seek(-8, os.SEEK_END)
                    max_k = int(np.frombuffer(kf.read(8), dtype="<u8")[0])
                values_len = pos
                pad = -pos % 8
                w.write(b"\n" * pad)
                pos += pad
                keys_off = pos
                pos += _copy(kf, w)
                offsets_off = pos
                pos += _copy(of, w)
                top_off = pos
                top_bytes = np.asarray(top, dtype="<u8").tobytes()
                w.write(top_bytes)
                pos += len(top_bytes)
                footer = FOOTER.pack(MAGIC, VERSION, PAGE, n, values_len, keys_off, offsets_off, top_off, len(top),
                                     float(min_t), float(hi_t), min_k, max_k, MAGIC)
                w.write(footer)
                pos += len(footer)
                w.commit()
            except BaseException:
                if w is not None:
                    w.abort()
                raise
            finally:
                kf.close()
                of.close()
        stats["entries_written"] += n
        stats["bytes_written"] += pos
        stats["tables_written"] += 1
        return name

    # ---------------------------------------------------------------------------------- maintenance
    def maintain(self, *, max_age_days: float | None = 90.0, compact_after_tables: int = 64,
                 max_runs: int = 8) -> dict:
        """Retention and compaction of this namespace (see the module docstring); returns what it did."""
        t0 = time.perf_counter()
        stats = {"tables_before": 0, "tables_after": 0, "expired_tables_deleted": 0, "tables_merged": 0,
                 "legacy_segments_folded": 0, **_merge_stats(), "bytes_read": 0, "ranges_read": 0,
                 "objects_read": 0, "unreadable_tables_kept": [], "aborted": None, "seconds": 0.0}
        cutoff = self._cutoff(max_age_days)
        self._fold_legacy(stats)
        tables = self.tables()
        stats["tables_before"] = len(tables)
        live = self._delete_expired(tables, cutoff, stats)
        shards = [t for t in live if t.kind == "s"]
        runs = [t for t in live if t.kind == "r"]
        inputs = shards if len(shards) >= compact_after_tables else []
        if len(runs) + (1 if inputs else 0) > max_runs:
            inputs = runs + inputs
        if inputs:
            self._merge(inputs, cutoff, stats)
        stats["tables_after"] = len(self.tables())  # shards that committed meanwhile included
        stats["seconds"] = round(time.perf_counter() - t0, 3)
        return stats

    def _delete_expired(self, tables: list[_Table], cutoff: float | None, stats: dict) -> list[_Table]:
        """Deletes the tables whose newest entry is older than ``cutoff``, once their footer is read and says
        so; returns the others, less those it could not read (kept, named in the stats, not merged)."""
        if cutoff is None:
            return tables
        expired = [t for t in tables if t.max_t < cutoff]
        if not expired:
            return tables
        reader = _Reader(self.fs, self.local, stats)
        try:
            metas, gone = _open_tables(reader, expired)
        finally:
            reader.close()
        unreadable = _unread(expired, metas, gone)
        stats["unreadable_tables_kept"] += [t.name for t in unreadable]
        dead = {m.table.name for m in metas if m.max_t < cutoff}
        for m in metas:
            if m.table.name in dead:
                self._delete(m.table)
        stats["expired_tables_deleted"] += len(dead)
        skip = dead | {t.name for t in gone} | {t.name for t in unreadable}
        return [t for t in tables if t.name not in skip]

    def _merge(self, inputs: list[_Table], cutoff: float | None, stats: dict) -> str | None:
        reader = _Reader(self.fs, self.local, stats)
        try:
            metas, gone = _open_tables(reader, inputs)
            if gone:
                stats["aborted"] = f"{len(gone)} input tables were deleted meanwhile (a concurrent compaction)"
                return None
            # A table it cannot read (a newer worker's format) is neither merged nor deleted: its entries stay.
            stats["unreadable_tables_kept"] += [t.name for t in _unread(inputs, metas, gone)]
            if not metas:
                return None
            chunk = int(min(MAX_RANGE_BYTES, max(256 * 2**10, BATCH_BYTES // max(1, len(metas)))))
            items = heapq.merge(*(_iter_values(reader, m, chunk) for m in metas))
            try:
                name = self._write_sorted(items, "r", max(m.max_t for m in metas), cutoff, stats)
            except FileNotFoundError:
                stats["aborted"] = "an input table was deleted meanwhile (a concurrent compaction)"
                return None
        finally:
            reader.close()
        stats["tables_merged"] = len(metas)
        for m in metas:  # only after the output is committed, and only what was read into it
            self._delete(m.table)
        return name

    def _fold_legacy(self, stats: dict) -> None:
        """Segments of the earlier layout (``seg-*.jsonl``) become one shard table, then are deleted."""
        segs = sorted(n for n, _ in self._entries() if n.startswith("seg-") and n.endswith(".jsonl"))
        if not segs:
            return
        paths = [self.dir.child(n).path() for n in segs]
        self.write_table(e for p in paths for e in iter_jsonl(p) if e.get("key"))
        for p in paths:
            p.unlink(missing_ok=True)
        stats["legacy_segments_folded"] = len(segs)


def _unread(tables: list[_Table], metas: list[_Meta], gone: list[_Table]) -> list[_Table]:
    """The tables that exist but whose footer could not be read (``_open_tables`` skipped them)."""
    seen = {m.table.name for m in metas} | {t.name for t in gone}
    return [t for t in tables if t.name not in seen]


def record_retention(root: Location, ns: str, pipeline: str, *, max_age_days: float | None,
                     compact_after_tables: int, max_runs: int) -> None:
    """Records in namespace ``ns`` the cache settings of a pipeline that writes it (one file per pipeline,
    replaced at each of its publishes): maintenance then applies them, whichever pipeline runs it."""
    write_json(root.child(ns, f"{RETENTION_PREFIX}{pipeline}.json").path(),
               {"format": RETENTION_FORMAT, "pipeline": pipeline, "max_age_days": max_age_days,
                "compact_after_tables": compact_after_tables, "max_runs": max_runs, "recorded_at": time.time()})


def recorded_settings(cache: ResultCache) -> dict | None:
    """The maintenance settings of a namespace from its writers' records: the longest retention (null, keep
    forever, wins over any age), the largest compaction thresholds; None when no pipeline recorded any.
    ValueError when a record cannot be read (a newer format, a damaged file): then nothing is known."""
    records = []
    for name, _ in cache._entries():
        if not (name.startswith(RETENTION_PREFIX) and name.endswith(".json")):
            continue
        try:
            rec = read_json(cache.dir.child(name).path())
            if rec.get("format") != RETENTION_FORMAT:
                raise ValueError(f"format {rec.get('format')!r}, this version reads {RETENTION_FORMAT}")
            ages = rec["max_age_days"]
            records.append((None if ages is None else float(ages), int(rec["compact_after_tables"]),
                            int(rec["max_runs"]), str(rec["pipeline"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{name}: {e}") from e
    if not records:
        return None
    ages = [r[0] for r in records]
    return {"max_age_days": None if None in ages else max(ages), "compact_after_tables": max(r[1] for r in records),
            "max_runs": max(r[2] for r in records), "pipelines": sorted(r[3] for r in records)}


def maintain_namespace(cache: ResultCache, *, compact_after_tables: int = 64, max_runs: int = 8) -> dict:
    """``ResultCache.maintain`` with the settings the namespace's writers recorded; without a record, only
    compaction (with the thresholds given), nothing expired. Never raises: a failure is in the stats
    (``error``), and a namespace whose record cannot be read is left alone (``skipped``)."""
    try:
        settings = recorded_settings(cache)
    except ValueError as e:
        return {"skipped": f"its retention record cannot be read ({e}); nothing deleted"}
    if settings is None:  # written before records existed, or by no pipeline that published since
        settings = {"max_age_days": None, "compact_after_tables": compact_after_tables, "max_runs": max_runs,
                    "pipelines": []}
    try:
        stats = cache.maintain(max_age_days=settings["max_age_days"],
                               compact_after_tables=settings["compact_after_tables"], max_runs=settings["max_runs"])
    except Exception as e:  # noqa: BLE001 - one namespace's failure must not stop the others' maintenance
        log.warning("result cache: maintenance of %s failed: %s", cache.ns, e, exc_info=True)
        return {"error": f"{type(e).__name__}: {e}", "settings": settings}
    return {**stats, "settings": settings}


def maintain_all(root: Location, *, compact_after_tables: int = 64, max_runs: int = 8) -> dict:
    """``maintain_namespace`` for every namespace under the cache root, each with its own writers' settings
    (the thresholds given only where a namespace has no record): {namespace: stats}."""
    return {ns: maintain_namespace(ResultCache(root, ns), compact_after_tables=compact_after_tables,
                                   max_runs=max_runs)
            for ns in _namespaces(root)}


def _namespaces(root: Location) -> list[str]:
    probe = ResultCache(root, "")
    names = []
    if probe.local:
        try:
            names = [e.name for e in os.scandir(str(root.path())) if e.is_dir() and not e.name.startswith(".")]
        except FileNotFoundError:
            pass
    else:
        p = root.path()
        try:
            names = [d["name"].rstrip("/").rsplit("/", 1)[-1] for d in p.fs.ls(p.path, detail=True)
                     if d.get("type") == "directory"]
        except FileNotFoundError:
            pass
    return sorted(names)


def _merge_stats() -> dict:
    return {"entries_in": 0, "entries_written": 0, "duplicates_dropped": 0, "expired_entries_dropped": 0,
            "tables_written": 0, "bytes_written": 0}


def _copy(src, w: AtomicWriter) -> int:
    src.flush()
    src.seek(0)
    n = 0
    while block := src.read(8 * 2**20):
        w.write(block)
        n += len(block)
    return n


class _ExternalSort:
    """Sorts more items than fit in memory: sorted runs of at most SORT_RUN_ENTRIES / SORT_RUN_BYTES spill to
    local files in ``tmp``, then one heap merge reads them back in order."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.runs: list[str] = []
        self.buf: list[tuple] = []
        self.size = 0

    def add(self, item: tuple, size: int) -> None:
        self.buf.append(item)
        self.size += size
        if len(self.buf) >= SORT_RUN_ENTRIES or self.size >= SORT_RUN_BYTES:
            self._spill()

    def _spill(self) -> None:
        self.buf.sort()
        path = os.path.join(self.tmp, f"run-{len(self.runs):05d}")
        with open(path, "wb") as f:
            for i in range(0, len(self.buf), 4096):
                pickle.dump(self.buf[i:i + 4096], f, protocol=pickle.HIGHEST_PROTOCOL)
        self.runs.append(path)
        self.buf, self.size = [], 0

    def sorted_items(self) -> Iterator[tuple]:
        if not self.runs:
            self.buf.sort()
            return iter(self.buf)
        if self.buf:
            self._spill()
        return heapq.merge(*(_iter_run(p) for p in self.runs))


def _iter_run(path: str) -> Iterator[tuple]:
    with open(path, "rb") as f:
        while True:
            try:
                block = pickle.load(f)
            except EOFError:
                return
            yield from block


def _iter_values(reader: _Reader, m: _Meta, chunk: int) -> Iterator[tuple]:
    """A table's value lines in order, read in ``chunk``-byte ranges."""
    pos, rest = 0, b""
    while pos < m.values_len:
        end = min(pos + chunk, m.values_len)
        data = rest + reader.read_one(m.table.path, pos, end)
        lines = data.split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield _item(line + b"\n")
        pos = end
    if rest.strip():
        yield _item(rest)


# ------------------------------------------------------------------------------------------ lookup
class Lookup:
    """An iterator of the found entries of one lookup; ``stats``: namespace, keys, hits, expired (candidates older
    than max_age), tables (consulted), objects_read, ranges_read, bytes_read, cache_bytes (of the tables
    consulted), retried (a table was deleted under it), seconds (its own time, not the consumer's)."""

    def __init__(self, cache: ResultCache, keys: Iterable[str]):
        t0 = time.perf_counter()
        self.cache = cache
        uniq = list(set(keys))
        k64 = _key64_array(uniq)
        order = np.argsort(k64, kind="stable")
        self._k64 = k64[order]
        self._keys = [uniq[i] for i in order]
        self._found = np.zeros(len(uniq), dtype=bool)
        self._gstart = np.flatnonzero(np.r_[True, self._k64[1:] != self._k64[:-1]]) if len(uniq) else \
            np.zeros(0, dtype=np.int64)
        self._gk = self._k64[self._gstart]
        self._cutoff = cache._cutoff(cache.max_age_days)
        listed = cache.tables()
        self._tables = [t for t in listed if self._cutoff is None or t.max_t >= self._cutoff]
        self.stats: dict[str, Any] = {
            "namespace": cache.ns, "keys": len(uniq), "hits": 0, "expired": 0, "tables": 0, "objects_read": 0,
            "ranges_read": 0, "bytes_read": 0, "cache_bytes": 0, "retried": False, "seconds": time.perf_counter() - t0}
        self._it: Iterator[dict] | None = None

    def __iter__(self) -> Iterator[dict]:
        if self._it is None:
            self._it = self._run()
        return self._it

    def __next__(self) -> dict:
        return next(iter(self))

    def _run(self) -> Iterator[dict]:
        t = time.perf_counter()
        reader = _Reader(self.cache.fs, self.cache.local, self.stats)
        consulted: set[str] = set()
        try:
            tables = self._tables if len(self._keys) else []
            for attempt in range(2):
                metas, gone = _open_tables(reader, tables)
                consulted.update(x.name for x in tables)
                self.stats["tables"] = len(consulted)
                self.stats["cache_bytes"] += sum(m.table.size for m in metas)
                gone_names = {x.name for x in gone}
                wave = WAVE_KEYS
                while wave > 1024 and sum(min(wave, len(m.top)) for m in metas) * PAGE * 8 > WAVE_PAGE_BYTES:
                    wave //= 2
                for a in range(0, len(self._keys), wave):
                    for entry in self._wave(reader, metas, gone_names, a, min(a + wave, len(self._keys))):
                        self.stats["seconds"] += time.perf_counter() - t
                        yield entry
                        t = time.perf_counter()
                if not gone_names or attempt or self._found.all():
                    break
                # A table was deleted under us (a compaction committed its output first): list again.
                self.stats["retried"] = True
                tables = [x for x in self.cache.tables() if x.name not in consulted
                          and (self._cutoff is None or x.max_t >= self._cutoff)]
        finally:
            reader.close()
            self.stats["seconds"] = round(self.stats["seconds"] + time.perf_counter() - t, 4)

    def _wave(self, reader: _Reader, metas: list[_Meta], gone: set[str], a: int, b: int) -> Iterator[dict]:  # noqa: C901
        """Looks up wanted keys [a, b) in every table: key pages, then offsets of candidates, then values."""
        gap = self.cache.gap_bytes
        todo = np.flatnonzero(~self._found[a:b]) + a
        if not len(todo):
            return
        w_all = self._k64[todo]
        # Round 1: the key pages that can hold a wanted key.
        plans = []
        reqs: list[tuple[str, int, int]] = []
        for rank, m in enumerate(metas):
            if m.table.name in gone or m.n == 0:
                continue
            w = w_all[(w_all >= m.min_k64) & (w_all <= m.max_k64)]
            if not len(w):
                continue
            hi = np.searchsorted(m.top, w, "right") - 1
            lo = np.maximum(np.searchsorted(m.top, w, "left") - 1, 0)
            page_runs = [hi]
            for i in np.flatnonzero(lo < hi):  # a key64 equal to a page's first: the run may start a page back
                page_runs.append(np.arange(lo[i], hi[i]))
            pages = np.unique(np.concatenate(page_runs))
            e0 = pages * PAGE
            e1 = np.minimum(e0 + PAGE, m.n)
            _, gs, ge = _coalesce(m.keys_off + e0 * 8, m.keys_off + e1 * 8, gap)
            plans.append((rank, m, w, gs, ge, len(reqs)))
            reqs.extend((m.table.path, int(s), int(e)) for s, e in zip(gs, ge))
        got = reader.read(reqs) if reqs else []
        # Candidates: (rank, entry index, key64) for every key-page slot equal to a wanted key64.
        cands = []
        for rank, m, w, gs, ge, at in plans:
            parts = _all_read(got[at:at + len(gs)])
            if parts is None:
                gone.add(m.table.name)
                continue
            kc = np.concatenate([np.frombuffer(p, dtype="<u8") for p in parts])
            span0 = (gs - m.keys_off) // 8  # entry index of each span's first key
            lens = (ge - gs) // 8
            cum = np.cumsum(lens) - lens    # its position in kc
            i = np.searchsorted(kc, w, "left")
            j = np.searchsorted(kc, w, "right")
            hit = j > i
            if not hit.any():
                continue
            i, j = i[hit], j[hit]
            cnt = j - i
            pos = np.repeat(i, cnt) + (np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt))
            g = np.searchsorted(cum, pos, "right") - 1
            idx, first = np.unique(span0[g] + pos - cum[g], return_index=True)
            cands.append((rank, m, idx, kc[pos][first]))
        if not cands:
            return
        # Round 2: the offsets of the candidates, hence their value ranges.
        reqs = []
        offset_plans = []
        for rank, m, idx, ks in cands:
            gid, gs, ge = _coalesce(m.offsets_off + idx * 8, m.offsets_off + idx * 8 + 16, gap)
            offset_plans.append((rank, m, idx, ks, gid, gs, len(reqs)))
            reqs.extend((m.table.path, int(s), int(e)) for s, e in zip(gs, ge))
        got = reader.read(reqs)
        rows = []  # (key64, rank, value start, value end, table) per candidate
        for rank, m, idx, ks, gid, gs, at in offset_plans:
            parts = _all_read(got[at:at + len(gs)])
            if parts is None:
                gone.add(m.table.name)
                continue
            starts, ends = np.empty(len(idx), dtype=np.int64), np.empty(len(idx), dtype=np.int64)
            bounds = np.searchsorted(gid, np.arange(len(gs) + 1))
            for g, part in enumerate(parts):
                arr = np.frombuffer(part, dtype="<u8").astype(np.int64)
                x, y = bounds[g], bounds[g + 1]
                rel = (m.offsets_off + idx[x:y] * 8 - int(gs[g])) // 8
                starts[x:y], ends[x:y] = arr[rel], arr[rel + 1]
            rows.append((ks, np.full(len(idx), rank), starts, ends, m))
        # Round 3 (and more only when a key has candidates in several tables, or collides): the values.
        tried = [np.zeros(len(r[0]), dtype=bool) for r in rows]
        while True:
            pick = self._pick(rows, tried)
            if not pick:
                return
            yield from self._read_values(reader, pick, gone, gap)

    def _pick(self, rows, tried) -> list:
        """For every wanted key64 still missing, its untried candidate in the newest table: [(meta, starts,
        ends)] per table."""
        ks_l, rank_l, owner_l = [], [], []
        # per key64 of the wanted keys: all of its keys found already
        done = np.minimum.reduceat(self._found.view(np.uint8), self._gstart).astype(bool)
        for t, (ks, ranks, _, _, _) in enumerate(rows):
            sel = np.flatnonzero(~tried[t])
            if not len(sel):
                continue
            open_ = ~done[np.searchsorted(self._gk, ks[sel])]
            tried[t][sel[~open_]] = True
            sel = sel[open_]
            ks_l.append(ks[sel])
            rank_l.append(ranks[sel])
            owner_l.append(np.stack([np.full(len(sel), t), sel], axis=1))
        if not ks_l or not sum(len(k) for k in ks_l):
            return []
        k, r, own = np.concatenate(ks_l), np.concatenate(rank_l), np.concatenate(owner_l)
        order = np.lexsort((r, k))
        k, own = k[order], own[order]
        first = np.ones(len(k), dtype=bool)
        first[1:] = k[1:] != k[:-1]
        own = own[first]
        out = []
        for t in np.unique(own[:, 0]):
            sel = np.sort(own[own[:, 0] == t][:, 1])
            tried[t][sel] = True
            ks, _, starts, ends, m = rows[t]
            out.append((m, starts[sel], ends[sel], ks[sel]))
        return out

    def _read_values(self, reader: _Reader, pick: list, gone: set[str], gap: int) -> Iterator[dict]:
        reqs, owners = [], []
        for m, starts, ends, ks in pick:
            if m.table.name in gone:
                continue
            order = np.argsort(starts, kind="stable")
            starts, ends, ks = starts[order], ends[order], ks[order]
            gid, gs, ge = _coalesce(starts, ends, gap)
            bounds = np.searchsorted(gid, np.arange(len(gs) + 1))
            for g in range(len(gs)):
                reqs.append((m.table.path, int(gs[g]), int(ge[g])))
                x, y = bounds[g], bounds[g + 1]
                owners.append((m, starts[x:y], ends[x:y], ks[x:y]))
        # Read in batches of about BATCH_BYTES, parse and hand out the entries as each batch arrives.
        i = 0
        while i < len(reqs):
            j, size = i, 0
            while j < len(reqs) and (j == i or size + reqs[j][2] - reqs[j][1] <= BATCH_BYTES):
                size += reqs[j][2] - reqs[j][1]
                j += 1
            got = reader.read(reqs[i:j])
            for (_, base, _), (m, starts, ends, ks), buf in zip(reqs[i:j], owners[i:j], got):
                if isinstance(buf, FileNotFoundError):
                    gone.add(m.table.name)
                    continue
                lo = np.searchsorted(self._k64, ks, "left").tolist()
                hi = np.searchsorted(self._k64, ks, "right").tolist()
                for s, e, x, y in zip(starts.tolist(), ends.tolist(), lo, hi):
                    entry = _DECODE(buf[s - base:e - base])
                    if self._accept(entry, x, y):
                        yield entry
            i = j

    def _accept(self, entry: dict, lo: int, hi: int) -> bool:
        """A hit when the entry's full key is one of the wanted keys [lo, hi) of its key64, not found yet,
        and not expired."""
        key = entry.get("key")
        for x in range(lo, hi):
            if self._keys[x] == key:
                if self._found[x]:
                    return False
                if self._cutoff is not None and entry.get("t", 0) < self._cutoff:
                    self.stats["expired"] += 1
                    return False
                self._found[x] = True
                self.stats["hits"] += 1
                return True
        return False
