"""The plan in parts (``sharding.plan_part_bytes``): the day's input planned by mapped tasks, none of which reads more
than its part, so planning spreads over the workers the way the shards do.

    list_parts ─> scan_part × P ─> join_group × P ─> place_parts ─> write_part × P ─> gather_plan
    (files        (validate its     (one hash-bucket  (counts: each   (its shards and   (the plan manifest:
     grouped)      files, spool,     group of every    part's rows     records, its      every part's shards,
                   id hashes)        part's ids)       and shards)     errors)           errors copied in order)

- **list_parts** groups the day's files, in name order, into parts of about ``plan_part_bytes`` (a bigger file
  is a part of its own; a bigger Parquet file of several row groups is split into parts of its row groups, from
  its footer). No row is read.
- **scan_part** runs the planner's scan (``plan.InputScan``: every row validated, images checked) over its files
  and commits, in the plan's folder, its spool, its row errors and one 32-byte entry a valid row: a 128-bit
  BLAKE2b hash of the row's id, its position in the spool, its file and line, grouped into ``BUCKETS`` buckets by
  the hash's top bits. Equal 128-bit hashes are taken for equal ids (the odds of two ids sharing one are about
  10^-23 at 10^8 rows); the one-task plan compares the ids themselves.
- **join_group** ``g`` reads buckets ``[g * BUCKETS // P, (g + 1) * BUCKETS // P)`` of every part (two range reads a
  part: about one part's worth of entries in all) and finds every id an earlier row of the day holds, in any
  part: the later rows are duplicates, each naming the file and line of the row that keeps the id.
- **place_parts** sums the counts: each part's first row index and its shards (``rows_per_shard`` within the
  part, numbered across the day), and where its duplicates are. It reads manifests only.
- **write_part** reads its own spool once, leaves its duplicates out and writes its shards (sorted inside as
  the one-task plan sorts them), each shard's records, and its errors (row errors and duplicates in input order).
- **gather_plan** writes the plan manifest: the parts' shards in order, the errors of the parts copied into one
  ``errors.jsonl`` (error lines only; no row is read), the counts summed.

A retry or a Clear redoes only what changed: a part whose files and settings are the same keeps its committed
scan; a join group keeps its result while the scans are the ones it read; a part whose first row index, shards
and duplicates are the same keeps its shards (and their ``plan_key``, so their committed inference is resumed,
not redone). A changed file changes its own part's scan, and the shards of the parts after it only where their
row indexes move.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict
from upath import UPath

from batch_llm.config import PipelineConfig
from batch_llm.io.formats import input_files
from batch_llm.io.identity import file_fingerprint, files_key, stable_hash
from batch_llm.io.images import stamps_digest
from batch_llm.io.storage import AtomicWriter, Location, as_path, atomic_writer, copy_object, json_bytes, peak_rss_mb
from batch_llm.layout import RunLayout, shard_name
from batch_llm.manifests import Manifest, PlanManifest, ShardSpec
from batch_llm.stages.plan import (
    InputScan,
    SortedShardWriter,
    check_openai_batch_task,
    image_checker,
    length_history,
    merged_errors,
    plan_input_key,
    plan_settings,
    plan_shards,
    resolve_format,
    shard_order_name,
    shard_sizes,
    spool_lines,
    with_idx,
)

# One entry a valid row: its id's hash (two words), its position in its part's spool, its file and line
ENTRY = np.dtype([("h0", "<u8"), ("h1", "<u8"), ("seq", "<u4"), ("file", "<u4"), ("line", "<u8")])
# Entries are grouped by the hash's top bits; the join's task g takes buckets [g * BUCKETS // P, (g+1) * BUCKETS // P)
# of every part, about one part's worth of entries
BUCKETS = 4096
# A part's entries file: the buckets' starts (BUCKETS + 1 int64, in entries), then the entries bucket by bucket
HEADER_BYTES = (BUCKETS + 1) * 8
# A duplicate found by the join: its part and spool position, and the file and line of the row that keeps the id
DUP = np.dtype([("part", "<u4"), ("seq", "<u4"), ("file", "<u4"), ("line", "<u8")])
READ_THREADS = 16  # the join's reads of every part's slice: round trips to storage, side by side
COPY_BYTES = 1 << 20


class PartSpec(BaseModel):
    """One part of the day: consecutive files of the day's listing, or row groups of one big Parquet file."""

    model_config = ConfigDict(extra="forbid")

    index: int
    first_file: int     # its first file's number in the day's listing
    files: list[str]    # the files' URLs
    bytes: int
    key: str            # part_key when listed (its scan and the join compute it again from the files)
    row_groups: tuple[int, int] | None = None  # one Parquet file's row groups [a, b); None: the whole files


class PartsManifest(Manifest):
    stage: str = "plan_parts"
    format: str
    input_files: int
    first_file: str     # the day's first file: the one its format was told from
    parts: list[PartSpec]


class PartScan(Manifest):
    stage: str = "plan_scan"
    part: int
    key: str
    rows_read: int
    valid: int          # rows spooled (duplicates among them are found by the join)
    capped: int
    has_references: bool
    spool: str
    errors: str         # file_no \t line \t JSON error line, in input order
    entries: str        # the buckets' starts, then ENTRY records bucket by bucket (HEADER_BYTES)
    images_read: str | None = None
    images_digest: str | None = None
    length_history: dict | None = None  # the output-length history its order read (plan.length_history)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0


class GroupJoin(Manifest):
    """One task of the join: the duplicates among a group of hash buckets of every part."""

    stage: str = "plan_join"
    group: int
    buckets: tuple[int, int]
    scans: str                      # the scans' keys it read (stable_hash): a scan made since makes it stale
    entries: int
    dups: str | None                # DUP records sorted by (part, seq); None: no duplicate
    part_starts: list[int] | None   # parts + 1 offsets into dups, in records; None: no duplicate
    seconds: float = 0.0
    peak_rss_mb: float = 0.0


class PartPlace(BaseModel):
    """Where a part's rows go, as the join decided: its first row index, its shards, its duplicates."""

    model_config = ConfigDict(extra="forbid")

    part: int
    first_idx: int
    first_shard: int
    shard_rows: list[int]
    duplicates: int
    dups: list[tuple[str, int, int]] = []  # the join's DUP files and record ranges holding this part's duplicates
    key: str            # the scan's key and its place: what its shards are made from, with its duplicates


class JoinManifest(Manifest):
    stage: str = "plan_place"
    input_key: str
    places: list[PartPlace]
    seconds: float = 0.0
    peak_rss_mb: float = 0.0


class PartWrite(Manifest):
    stage: str = "plan_write"
    part: int
    key: str             # its place's key and its duplicates: its shards' plan_key
    place_key: str
    shards: list[ShardSpec]
    errors: str          # its error lines (JSON), in input order
    error_rows: int
    seconds: float = 0.0
    peak_rss_mb: float = 0.0


def _parts_dir(layout: RunLayout) -> Location:
    return layout.stage("plan").child("parts")


def _part_dir(layout: RunLayout, index: int) -> Location:
    return _parts_dir(layout).child(f"part-{index:05d}")


# ------------------------------------------------------------------------------------------------ list the parts
def list_parts(cfg: PipelineConfig, layout: RunLayout) -> PartsManifest:
    """The day's files grouped into parts of about ``sharding.plan_part_bytes``, in name order (listing and stat
    only: no row is read, but the first file's first line, which tells the format)."""
    part_bytes = cfg.sharding.plan_part_bytes
    if part_bytes is None:
        raise ValueError("sharding.plan_part_bytes is not set for this run, but its DAG plans in parts (the DAG's "
                         "shape follows the pipeline file's setting): set it in the pipeline file, not at trigger time")
    files = input_files(layout.input.path())
    fmt = resolve_format(files, cfg.input.format, cfg.input.max_line_bytes)
    check_openai_batch_task(cfg, fmt, files[0])
    parts: list[PartSpec] = []
    group: list[tuple[int, UPath, int]] = []

    def close() -> None:
        if group:
            fs = [f for _, f, _ in group]
            parts.append(PartSpec(index=len(parts), first_file=group[0][0], files=[str(f) for f in fs],
                                  bytes=sum(n for _, _, n in group), key=""))
            group.clear()

    for no, f in enumerate(files):
        size = int(file_fingerprint(f).get("size") or 0)
        if group and sum(n for _, _, n in group) + size > part_bytes:
            close()
        groups = _row_group_bytes(f) if size > part_bytes and fmt == "parquet" else []
        if len(groups) > 1:  # a big Parquet file: parts of its row groups, each about part_bytes
            close()
            for a, b, n in _ranges(groups, part_bytes):
                parts.append(PartSpec(index=len(parts), first_file=no, files=[str(f)], bytes=n, key="",
                                      row_groups=(a, b)))
            continue
        group.append((no, f, size))
    close()
    for spec in parts:
        spec.key = part_key(cfg, fmt, spec, layout.input.options)
    m = PartsManifest(format=fmt, input_files=len(files), first_file=str(files[0]), parts=parts)
    m.write(_parts_dir(layout).path())
    return m


def _row_group_bytes(f: UPath) -> list[int]:
    """A Parquet file's row groups' compressed sizes, from its footer (no row read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with f.open("rb") as fh:
            meta = pq.ParquetFile(fh).metadata
            return [sum(meta.row_group(i).column(j).total_compressed_size for j in range(meta.num_columns))
                    for i in range(meta.num_row_groups)]
    except (OSError, ValueError, pa.ArrowException):  # an unreadable file: one part, whose scan reports it
        return []


def _ranges(sizes: list[int], limit: int) -> Iterator[tuple[int, int, int]]:
    """Consecutive ranges [a, b) of ``sizes`` summing to at most ``limit`` (one item more where one alone
    exceeds it), with their sums."""
    a, held = 0, 0
    for i, n in enumerate(sizes):
        if held and held + n > limit:
            yield a, i, held
            a, held = i, 0
        held += n
    yield a, len(sizes), held


def part_key(cfg: PipelineConfig, fmt: str, spec: PartSpec, options: dict) -> str:
    """What a part's scan is made of, as its files are now: their fingerprints, where they sit in the day, the
    format and the planner's settings. Computed again by its scan and the join, so a file changed after the
    listing makes its part's scan run again when that task is cleared."""
    files = [Location(u, options).path() for u in spec.files]
    return stable_hash({"files": files_key(files), "first_file": spec.first_file, "format": fmt,
                        **({"row_groups": list(spec.row_groups)} if spec.row_groups else {}), **plan_settings(cfg)})


# ------------------------------------------------------------------------------------------------ scan a part
def scan_part(cfg: PipelineConfig, layout: RunLayout, index: int) -> PartScan:
    """Part ``index`` validated and spooled, its entries bucketed; the committed scan while its key (and what its
    rows read of images) is unchanged."""
    parts = PartsManifest.read(_parts_dir(layout).path())
    spec = parts.parts[index]
    key = part_key(cfg, parts.format, spec, layout.input.options)
    where = _part_dir(layout, index)
    done = PartScan.read_if_done(where.path())
    if done is not None and done.key == key and _images_same(done, where.options, layout.input.options,
                                                                   cfg.input.image_workers):
        return done
    t0 = time.perf_counter()
    opts = layout.input.options
    files = [Location(u, opts).path() for u in spec.files]
    with tempfile.TemporaryDirectory(prefix="batch_llm_plan_part_") as tmp_dir:
        tmp = Path(tmp_dir)
        history = length_history(cfg, layout)
        scan = InputScan(cfg, parts.format, tmp, image_checker(cfg, layout.input), history)
        scan.run(files, first_no=spec.first_file, day_first=Location(parts.first_file, opts).path(),
                 row_groups=spec.row_groups)
        entries, starts = _entries(scan.spool_path)
        _upload(scan.spool_path, where.child("spool.tsv"))
        _upload(scan.errors_path, where.child("errors.tsv"))
        with atomic_writer(where.child("entries.bin").path()) as w:
            w.write(starts.tobytes())
            w.write(entries.tobytes())
        images_read = digest = None
        if scan.reads.count:
            _upload(scan.reads.path, where.child("images-read.jsonl"))
            images_read, digest = where.child("images-read.jsonl").url, scan.reads.digest()
    m = PartScan(part=index, key=key, rows_read=scan.rows_read, valid=len(entries), capped=scan.capped,
                 has_references=scan.has_references, spool=where.child("spool.tsv").url,
                 errors=where.child("errors.tsv").url, entries=where.child("entries.bin").url,
                 images_read=images_read, images_digest=digest,
                 length_history=history.summary() if history is not None else None,
                 seconds=round(time.perf_counter() - t0, 2), peak_rss_mb=peak_rss_mb())
    m.write(where.path())
    return m


def _images_same(done: PartScan, store: dict, options: dict, workers: int) -> bool:
    """Whether the images a committed scan's rows read are as they were (each one's stamp again, read with the
    input's ``options``; the list in the plan's ``store``)."""
    if done.images_read is None:
        return True
    try:
        return stamps_digest(Location(done.images_read, store).path(), options, workers) == done.images_digest
    except (OSError, ValueError):
        return False


def _entries(spool: Path) -> tuple[np.ndarray, np.ndarray]:
    """The part's entries, bucket by bucket (in spool order inside a bucket), and the buckets' starts."""
    digests, files, lines = bytearray(), array("I"), array("Q")  # flat buffers: no Python object a row
    for fields in spool_lines(spool):
        digests += hashlib.blake2b(fields[3], digest_size=16).digest()
        files.append(int(fields[0]))
        lines.append(int(fields[1]))
    n = len(files)
    h = np.frombuffer(bytes(digests), dtype="<u8").reshape(n, 2) if n else np.empty((0, 2), dtype="<u8")
    e = np.empty(n, dtype=ENTRY)
    e["h0"], e["h1"], e["seq"] = h[:, 0], h[:, 1], np.arange(n, dtype=np.uint32)
    e["file"], e["line"] = np.frombuffer(files, dtype=np.uint32), np.frombuffer(lines, dtype=np.uint64)
    bucket = _bucket(e["h0"])
    order = np.argsort(bucket, kind="stable")
    e = e[order]
    starts = np.searchsorted(bucket[order], np.arange(BUCKETS + 1)).astype("<i8")
    return e, starts


def _bucket(h0: np.ndarray) -> np.ndarray:
    """An entry's bucket: the top bits of its hash."""
    return (h0 >> np.uint64(64 - BUCKETS.bit_length() + 1)).astype(np.int64)


def _upload(src: Path, dst: Location) -> None:
    """A local file of the scan into the plan's storage (a hard link on the same local disk)."""
    copy_object(as_path(str(src)), dst.path())


def _concatenate(sources: list[str], dst: Location) -> None:
    """The files at ``sources`` (in the plan's storage), one after the other, into ``dst``: streamed."""
    with atomic_writer(dst.path()) as out:
        for url in sources:
            with Location(url, dst.options).path().open("rb") as fh:
                while chunk := fh.read(COPY_BYTES):
                    out.write(chunk)


# ------------------------------------------------------------------------------------------------ join the parts
def bucket_range(group: int, n_parts: int) -> tuple[int, int]:
    """The hash buckets of the join's task ``group`` (one task a part)."""
    return group * BUCKETS // n_parts, (group + 1) * BUCKETS // n_parts


def join_group(cfg: PipelineConfig, layout: RunLayout, group: int) -> GroupJoin:
    """The duplicates among one group of hash buckets of every part's entries: of each id, every row after the
    day's first (part, then spool order: input order) is a duplicate naming the first's file and line. The
    committed result while the parts' scans are the ones it read."""
    t0 = time.perf_counter()
    parts = PartsManifest.read(_parts_dir(layout).path())
    n = len(parts.parts)
    store = layout.stage("plan").options
    with ThreadPoolExecutor(READ_THREADS) as pool:
        scans = list(pool.map(lambda p: PartScan.read(_part_dir(layout, p.index).path()), parts.parts))
        digest = stable_hash([s.key for s in scans])
        where = layout.stage("plan").child("join", f"group-{group:05d}")
        done = GroupJoin.read_if_done(where.path())
        if done is not None and done.scans == digest:
            return done
        lo, hi = bucket_range(group, n)
        slices = list(pool.map(lambda s: _entries_slice(Location(s.entries, store), lo, hi), scans))
    owners = [np.full(len(a), p, dtype=np.uint32) for p, a in enumerate(slices)]
    e = np.concatenate(slices) if slices else np.empty(0, dtype=ENTRY)
    part = np.concatenate(owners) if owners else np.empty(0, dtype=np.uint32)
    del slices, owners  # the group is held once, plus the sort's copy
    out = _duplicates(e, part)
    url, starts = None, None
    if len(out):
        loc = where.child("dups.bin")
        with atomic_writer(loc.path()) as w:
            w.write(out.tobytes())
        url, starts = loc.url, np.searchsorted(out["part"], np.arange(n + 1)).tolist()
    m = GroupJoin(group=group, buckets=(lo, hi), scans=digest, entries=len(e), dups=url, part_starts=starts,
                  seconds=round(time.perf_counter() - t0, 2), peak_rss_mb=peak_rss_mb())
    m.write(where.path())
    return m


def _entries_slice(entries: Location, lo: int, hi: int) -> np.ndarray:
    """Buckets [lo, hi) of a part's entries file: two range reads (their starts, then their entries)."""
    with entries.path().open("rb") as fh:
        fh.seek(lo * 8)
        a, b = np.frombuffer(fh.read(16 if hi == lo + 1 else (hi - lo + 1) * 8), dtype="<i8")[[0, -1]]
        if b <= a:
            return np.empty(0, dtype=ENTRY)
        fh.seek(HEADER_BYTES + int(a) * ENTRY.itemsize)
        return np.frombuffer(fh.read(int(b - a) * ENTRY.itemsize), dtype=ENTRY)


def _duplicates(e: np.ndarray, part: np.ndarray) -> np.ndarray:
    """DUP records of the entries whose hash an earlier entry (by part, then spool position) has, sorted by
    (part, seq)."""
    if len(e) < 2:
        return np.empty(0, dtype=DUP)
    order = np.lexsort((e["seq"], part, e["h1"], e["h0"]))
    e, part = e[order], part[order]
    same = np.zeros(len(e), dtype=bool)
    same[1:] = (e["h0"][1:] == e["h0"][:-1]) & (e["h1"][1:] == e["h1"][:-1])
    dup = np.flatnonzero(same)
    out = np.empty(len(dup), dtype=DUP)
    if not len(dup):
        return out
    starts = np.flatnonzero(~same)
    first = starts[np.searchsorted(starts, dup, side="right") - 1]
    out["part"], out["seq"] = part[dup], e["seq"][dup]
    out["file"], out["line"] = e["file"][first], e["line"][first]
    return np.sort(out, order=["part", "seq"])


def place_parts(cfg: PipelineConfig, layout: RunLayout) -> JoinManifest:
    """Each part's place from the join's counts: its first row index and its shards (``rows_per_shard`` within
    the part, numbered across the day), and where its duplicates are. Refuses a plan whose steps disagree (a part
    changed since its scan, a join older than the scans), naming the task to clear."""
    t0 = time.perf_counter()
    parts = PartsManifest.read(_parts_dir(layout).path())
    opts = layout.input.options
    now = [str(f) for f in input_files(layout.input.path())]
    if now != list(dict.fromkeys(u for p in parts.parts for u in p.files)):  # a file split in parts: once
        raise RuntimeError("the input's files are not those plan_parts listed (a file was added, removed or "
                           "renamed since): clear plan_parts with its downstream tasks")
    scans = [PartScan.read(_part_dir(layout, p.index).path()) for p in parts.parts]
    for p, s in zip(parts.parts, scans):
        if s.key != part_key(cfg, parts.format, p, opts):
            raise RuntimeError(f"plan part {p.index}: its committed scan is of other files or settings than this "
                               "plan's (its file changed and its plan_scan task did not run again): clear that "
                               "plan_scan task with its downstream tasks")
    digest = stable_hash([s.key for s in scans])
    n = len(parts.parts)
    groups = [GroupJoin.read(layout.stage("plan").child("join", f"group-{g:05d}").path()) for g in range(n)]
    stale = [g.group for g in groups if g.scans != digest]
    if stale:
        raise RuntimeError(f"plan_join group(s) {stale} ran before the parts' last scans: clear plan_join with its "
                           "downstream tasks")
    places: list[PartPlace] = []
    idx = shard = 0
    for p, s in zip(parts.parts, scans):
        slices = [(g.dups, g.part_starts[p.index], g.part_starts[p.index + 1]) for g in groups
                  if g.dups is not None and g.part_starts is not None
                  and g.part_starts[p.index + 1] > g.part_starts[p.index]]
        duplicates = sum(b - a for _, a, b in slices)
        kept = s.valid - duplicates
        rows = shard_sizes(kept, cfg.sharding, cfg.sampling.max_tokens)
        key = stable_hash({"scan": s.key, "first_idx": idx, "first_shard": shard, "rows": rows})
        places.append(PartPlace(part=p.index, first_idx=idx, first_shard=shard, shard_rows=rows,
                                duplicates=duplicates, dups=slices, key=key))
        idx += kept
        shard += len(rows)
    m = JoinManifest(input_key=plan_input_key(cfg, layout.input), places=places,
                     seconds=round(time.perf_counter() - t0, 2), peak_rss_mb=peak_rss_mb())
    m.write(layout.stage("plan").child("place").path())
    return m


def _part_dups(place: PartPlace, store: dict) -> np.ndarray:
    """A part's duplicates from the join's files, sorted by spool position."""
    got = []
    for url, a, b in place.dups:
        with Location(url, store).path().open("rb") as fh:
            fh.seek(a * DUP.itemsize)
            got.append(np.frombuffer(fh.read((b - a) * DUP.itemsize), dtype=DUP))
    return np.sort(np.concatenate(got), order="seq") if got else np.empty(0, dtype=DUP)


# ------------------------------------------------------------------------------------------------ write a part
def write_part(cfg: PipelineConfig, layout: RunLayout, index: int) -> PartWrite:
    """Part ``index``'s shards, their records and its errors, from its spool less its duplicates; the committed
    ones while the join placed the part as before."""
    plan_dir = layout.stage("plan")
    store = plan_dir.options
    place = JoinManifest.read(plan_dir.child("place").path()).places[index]
    dups = _part_dups(place, store)
    key = stable_hash({"place": place.key, "dups": hashlib.sha256(dups.tobytes()).hexdigest()})
    where = _part_dir(layout, index).child("write")
    done = PartWrite.read_if_done(where.path())
    if done is not None and done.key == key:
        return done
    t0 = time.perf_counter()
    parts = PartsManifest.read(_parts_dir(layout).path())
    scan = PartScan.read(_part_dir(layout, index).path())
    names = [Path(u).name for u in parts.parts[index].files]
    first_file = parts.parts[index].first_file
    shards: list[ShardSpec] = []
    with tempfile.TemporaryDirectory(prefix="batch_llm_plan_write_") as tmp_dir:
        tmp = Path(tmp_dir)
        dup_errors = tmp / "errors-dups.tsv"
        bounds = iter(place.shard_rows)
        writer: SortedShardWriter | None = None
        own = contextlib.ExitStack()  # the current shard's records file
        rec: AtomicWriter | None = None
        left, idx, ptr = 0, place.first_idx, 0
        with open(dup_errors, "wb") as errors, own:
            for seq, fields in enumerate(spool_lines(Location(scan.spool, store).path())):  # streamed, once
                if ptr < len(dups) and dups[ptr]["seq"] == seq:
                    errors.write(_dup_error(fields, dups[ptr], names, first_file, parts))
                    ptr += 1
                    continue
                if left == 0 or writer is None:  # the shard is full, or this is the part's first row
                    if writer is not None:
                        writer.close()
                    own.close()
                    left = next(bounds)
                    n = place.first_shard + len(shards)
                    loc = plan_dir.child(f"{shard_name(n)}.jsonl")
                    rec_loc = plan_dir.child(f"{shard_name(n)}-records.jsonl")
                    shards.append(ShardSpec(index=n, rows=left, url=loc.url, records=rec_loc.url,
                                            plan_key=key[:16]))
                    writer = SortedShardWriter(loc, tmp, sort=cfg.sharding.sort_by_length)
                    rec = own.enter_context(atomic_writer(rec_loc.path()))
                writer.add(int(fields[2]), idx, with_idx(fields[4], idx))
                assert rec is not None  # opened with the shard, above
                rec.write(with_idx(fields[5], idx))
                idx += 1
                left -= 1
            if writer is not None:
                writer.close()
        errors_loc = where.child("errors.jsonl")
        n_errors = 0
        with atomic_writer(errors_loc.path()) as w:
            for line in merged_errors([Location(scan.errors, store).path(), dup_errors], tmp):
                w.write(line)
                n_errors += 1
    m = PartWrite(part=index, key=key, place_key=place.key, shards=shards, errors=errors_loc.url, error_rows=n_errors,
                  seconds=round(time.perf_counter() - t0, 2), peak_rss_mb=peak_rss_mb())
    m.write(where.path())
    return m


def _dup_error(fields: list[bytes], dup: np.void, names: list[str], first_file: int, parts: PartsManifest) -> bytes:
    """A duplicate's error line (``file_no \\t line \\t JSON``), as the one-task plan writes it."""
    file_no, line, rid = int(fields[0]), int(fields[1]), json.loads(fields[3])
    first_at = f"{_file_name(parts, int(dup['file']))}:{int(dup['line'])}"
    return b"%d\t%d\t" % (file_no, line) + json_bytes({
        "source": names[file_no - first_file], "line": line, "id": rid, "duplicate_of": first_at,
        "reason": f"duplicate id {rid!r} (first at {first_at})"}) + b"\n"


def _file_name(parts: PartsManifest, file_no: int) -> str:
    for p in parts.parts:
        if p.first_file <= file_no < p.first_file + len(p.files):
            return Path(p.files[file_no - p.first_file]).name
    return f"file {file_no}"


# ------------------------------------------------------------------------------------------------ the plan
def gather_plan(cfg: PipelineConfig, layout: RunLayout) -> PlanManifest:
    """The plan manifest of a plan in parts: the parts' shards in order, their errors copied into one file, the
    counts summed; the shard files and records stay where their parts wrote them."""
    t0 = time.perf_counter()
    plan_dir = layout.stage("plan")
    parts = PartsManifest.read(_parts_dir(layout).path())
    join = JoinManifest.read(plan_dir.child("place").path())
    scans = [PartScan.read(_part_dir(layout, p.index).path()) for p in parts.parts]
    groups = [GroupJoin.read(plan_dir.child("join", f"group-{g:05d}").path()) for g in range(len(parts.parts))]
    writes = []
    for place in join.places:
        w = PartWrite.read(_part_dir(layout, place.part).child("write").path())
        if w.place_key != place.key:
            raise RuntimeError(f"plan part {place.part}: its shards were written for another place than the "
                               "plan's (plan_write did not run again): clear plan_place with its downstream tasks")
        writes.append(w)
    errors_loc = plan_dir.child("errors.jsonl")
    _concatenate([w.errors for w in writes], errors_loc)
    images_read = None
    if any(s.images_read for s in scans):
        loc = plan_dir.child("images-read.jsonl")
        _concatenate([s.images_read for s in scans if s.images_read], loc)
        images_read = loc.url
    duplicates = sum(p.duplicates for p in join.places)
    tasks = [*(s.seconds for s in scans), *(g.seconds for g in groups), join.seconds, *(w.seconds for w in writes)]
    m = PlanManifest(
        input=layout.input.url, input_files=parts.input_files, format=parts.format,
        rows_read=sum(s.rows_read for s in scans), valid=sum(s.valid for s in scans) - duplicates,
        invalid=sum(w.error_rows for w in writes), duplicates=duplicates, capped=sum(s.capped for s in scans),
        errors=errors_loc.url, records=None, shards=[s for w in writes for s in w.shards],
        has_references=any(s.has_references for s in scans), seconds=round(sum(tasks) + time.perf_counter() - t0, 2),
        peak_rss_mb=max([*(s.peak_rss_mb for s in scans), *(g.peak_rss_mb for g in groups), join.peak_rss_mb,
                         *(w.peak_rss_mb for w in writes), peak_rss_mb()]),
        input_key=join.input_key, images_read=images_read, parts=len(parts.parts),
        order=shard_order_name(cfg, any(s.length_history for s in scans)), length_history=_histories(scans))
    m.write(plan_dir.path())
    return m


def _histories(scans: list[PartScan]) -> dict | None:
    """The length histories the parts' orders read, as one (each part reads the newest records when it scans)."""
    read = [s.length_history for s in scans if s.length_history]
    if not read:
        return None
    return {**read[-1], "parts": len(read), "rows_estimated": sum(h.get("rows_estimated", 0) for h in read)}


def plan_day(cfg: PipelineConfig, layout: RunLayout) -> PlanManifest:
    """The run's plan in this process: in parts where ``sharding.plan_part_bytes`` is set (step after step; a
    DAG maps them), else the one-task plan (``plan.plan_shards``)."""
    if cfg.sharding.plan_part_bytes is None:
        return plan_shards(cfg, layout)
    parts = list_parts(cfg, layout)
    for p in parts.parts:
        scan_part(cfg, layout, p.index)
    for g in range(len(parts.parts)):
        join_group(cfg, layout, g)
    for place in place_parts(cfg, layout).places:
        write_part(cfg, layout, place.part)
    return gather_plan(cfg, layout)

