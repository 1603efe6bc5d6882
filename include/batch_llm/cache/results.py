"""The result cache: generated rows keyed by content, in object storage; a lookup costs what the run asks for,
not what the history holds.

A key hashes everything that decides an output: the namespace what a run's rows share (``namespace``: the
model's weights, adapter and quantization, the chat template, the sampling, the engine's settings), the row key
the prompt that is rendered (chat messages or token ids) and the row's own parameters. A hit is only ever an
earlier result for the same full key, never older than ``max_age_days``.

The tables a namespace holds, their format and why it is shaped so: ``cache/table.py``; a lookup of a run's keys
against them: ``cache/lookup.py``.

Writes: a shard streams its newly generated rows into ``write_table`` at its end; the entries are sorted in
bounded memory (runs of 50k entries spilled to local temporary files, ``io/external_sort.py``) and streamed into
``atomic_writer``: the object is visible only once complete. A retry writes the table again, which is harmless
(a duplicate is dropped at compaction).

Maintenance (``maintain``, run by the publish task): tables whose newest entry is expired (by the name, then
checked in the footer) are deleted; once ``compact_after_tables`` shard tables exist they are merged (an
external merge in blocks, ``cache/merge.py``: bounded memory, newest entry of a key wins, expired entries
dropped) into one run; when more than ``max_runs`` runs
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
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator

from batch_llm.cache.lookup import Lookup
from batch_llm.cache.merge import merge_tables
from batch_llm.cache.table import (
    LOCAL_GAP_BYTES,
    REMOTE_GAP_BYTES,
    TABLE_NAME,
    RangeReader,
    Table,
    TableMeta,
    TableWriter,
    entry_line,
    key64,
    open_tables,
    table_name,
)
from batch_llm.io.external_sort import ExternalSort
from batch_llm.io.identity import stable_hash
from batch_llm.io.storage import Location, is_local, iter_jsonl, read_json, write_json

log = logging.getLogger("batch_llm.cache.results")
SORT_RUN_ENTRIES = 50_000        # entries sorted in memory before a run is spilled to a local file
SORT_RUN_BYTES = 64 * 2**20
_DAY = 86400.0
RETENTION_PREFIX = "_retention."  # <ns>/_retention.<pipeline>.json: the settings of a pipeline that writes ns
RETENTION_FORMAT = 1


# Folders under the cache root that hold other records than results: the precision gate's decisions, the output
# lengths (a namespace is a 24-digit hash, never one of these)
BESIDE_THE_CACHE = ("lengths", "precision")


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

    def tables(self) -> list[Table]:
        """The namespace's tables, newest first (by the write time of their newest entry)."""
        out = []
        for name, size in self._entries():
            m = TABLE_NAME.match(name)
            if m:
                out.append(Table(name, self._fs_path(name), size, m.group(1), int(m.group(2))))
        return sorted(out, key=lambda t: (-t.max_t, t.name))

    def _cutoff(self, max_age_days: float | None) -> float | None:
        return None if max_age_days is None else self.clock() - max_age_days * _DAY

    def _delete(self, table: Table) -> None:
        try:
            if self.local:
                os.unlink(table.path)
            else:
                self.fs.rm_file(table.path)
        except FileNotFoundError:
            pass

    # ---------------------------------------------------------------------------------- lookup
    def lookup(self, keys: Iterable[str]) -> Lookup:
        """The cached entries of the wanted keys, streamed: iterate the result (each key found comes once, as
        its stored entry: key, t, output, finish_reason, token counts); ``.stats`` holds what it cost. The keys
        are taken and the namespace listed now; the tables are read as it is iterated."""
        return Lookup(keys, ns=self.ns, list_tables=self.tables,
                      open_reader=lambda stats: RangeReader(self.fs, self.local, stats), gap_bytes=self.gap_bytes,
                      cutoff=self._cutoff(self.max_age_days))

    # ---------------------------------------------------------------------------------- writes
    def write_table(self, entries: Iterable[dict], *, kind: str = "s") -> dict | None:
        """Writes the entries (key, output, finish_reason, token counts; ``t`` defaults to now) as one new
        table, sorted in bounded memory, one entry per key (the newest). Returns {name, entries, bytes}, or
        None when there was nothing to write."""
        now = self.clock()
        with tempfile.TemporaryDirectory(prefix="batch_llm_sst_") as tmp:
            sorter: ExternalSort[tuple] = ExternalSort(tmp, run_items=SORT_RUN_ENTRIES, run_bytes=SORT_RUN_BYTES)
            max_t = None
            for e in entries:
                t = e.get("t")
                if t is None:
                    t = int(now)
                line = entry_line(e, t)
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
        name = table_name(kind, max_t)
        w: TableWriter | None = None
        last_key = None
        with tempfile.TemporaryDirectory(prefix="batch_llm_sst_idx_") as tmp:
            try:
                for k64, key, neg_t, line in items:
                    stats["entries_in"] += 1
                    if key == last_key:
                        stats["duplicates_dropped"] += 1
                        continue
                    last_key = key
                    if cutoff is not None and -neg_t < cutoff:
                        stats["expired_entries_dropped"] += 1
                        continue
                    if w is None:  # the object is opened only once there is an entry to write
                        w = TableWriter(self.dir.child(name).path(), tmp)
                    w.add(k64, -neg_t, line)
                if w is None:
                    return None
                size = w.commit()
            except BaseException:
                if w is not None:
                    w.abort()
                raise
        stats["entries_written"] += w.n
        stats["bytes_written"] += size
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

    def _delete_expired(self, tables: list[Table], cutoff: float | None, stats: dict) -> list[Table]:
        """Deletes the tables whose newest entry is older than ``cutoff``, once their footer is read and says
        so; returns the others, less those it could not read (kept, named in the stats, not merged)."""
        if cutoff is None:
            return tables
        expired = [t for t in tables if t.max_t < cutoff]
        if not expired:
            return tables
        reader = RangeReader(self.fs, self.local, stats)
        try:
            metas, gone = open_tables(reader, expired)
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

    def _merge(self, inputs: list[Table], cutoff: float | None, stats: dict) -> str | None:
        reader = RangeReader(self.fs, self.local, stats)
        try:
            metas, gone = open_tables(reader, inputs)
            if gone:
                stats["aborted"] = f"{len(gone)} input tables were deleted meanwhile (a concurrent compaction)"
                return None
            # A table it cannot read (a newer worker's format) is neither merged nor deleted: its entries stay.
            stats["unreadable_tables_kept"] += [t.name for t in _unread(inputs, metas, gone)]
            if not metas:
                return None
            # An external merge in blocks (``cache/merge.py``): bounded memory whatever the tables' sizes or number.
            name = table_name("r", max(m.max_t for m in metas))
            opened: list[TableWriter] = []  # the output, opened at its first entry (aborted on any failure)
            try:
                with tempfile.TemporaryDirectory(prefix="batch_llm_sst_idx_") as tmp:

                    def open_writer() -> TableWriter:
                        opened.append(TableWriter(self.dir.child(name).path(), tmp))
                        return opened[0]

                    try:
                        w = merge_tables(reader, metas, cutoff, open_writer, stats)
                        if w is not None:
                            stats["bytes_written"] += w.commit()
                            stats["entries_written"] += w.n
                            stats["tables_written"] += 1
                    except BaseException:
                        for x in opened:
                            x.abort()
                        raise
            except FileNotFoundError:
                stats["aborted"] = "an input table was deleted meanwhile (a concurrent compaction)"
                return None
        finally:
            reader.close()
        stats["tables_merged"] = len(metas)
        for m in metas:  # only after the output is committed, and only what was read into it
            self._delete(m.table)
        return name if opened else None

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


def _unread(tables: list[Table], metas: list[TableMeta], gone: list[Table]) -> list[Table]:
    """The tables that exist but whose footer could not be read (``open_tables`` skipped them)."""
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
    # the other records kept beside the cache (engines/precision_gate.py, cache/lengths.py) are not namespaces
    return sorted(n for n in names if n not in BESIDE_THE_CACHE)


def _merge_stats() -> dict:
    return {"entries_in": 0, "entries_written": 0, "duplicates_dropped": 0, "expired_entries_dropped": 0,
            "tables_written": 0, "bytes_written": 0}
