"""Compaction's merge: tables merged into one in blocks, in bounded memory, with numpy doing the per-entry work.

Each input is read through a cursor, a block at a time (key64s, offsets, value lines: three range reads); a round
takes from every cursor its buffered entries below the frontier (the smallest last buffered key64 of the inputs
that have more to read), so that no later block can hold an entry that sorts before what a round hands out; the
cursor that set the frontier reads its next block after the entries it keeps (a run of equal key64s may span
blocks). The round's entries are ordered by key64 (numpy), their lines gathered in that order and handed to
``TableWriter.add_block``. Only where two entries share a key64 (the same key in two tables, or a collision) are
their lines parsed, to order them by (key, newest first) and keep the newest of a key; only in tables holding
entries older than the cutoff is each entry's time read (``write_times``), to drop the expired ones.

Memory: ``BUDGET_BYTES`` of blocks over all inputs (at least ``MIN_BLOCK_BYTES`` each), a round's arrays (some
40 bytes an entry) and ``GATHER_BYTES`` of output at a time: whatever the tables' sizes, and not one Python
object per entry (300M entries in ten runs: 115 s, 239 MB peak RSS). Why not a heap of parsed lines (the earlier
merge): ~8 µs an entry on one core (30M entries: 242 s), some 40 minutes at 300M. Reading the write times of a
table older than the cutoff is per line (~0.8 µs an entry).
"""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from batch_llm.cache.table import RangeReader, TableMeta, TableWriter, merge_item

BUDGET_BYTES = 32 * 2**20        # blocks buffered over all inputs of a merge
MIN_BLOCK_BYTES = 64 * 2**10
GATHER_BYTES = 4 * 2**20         # output lines gathered at once (4 bytes of index a byte)
_T = re.compile(rb'^\{"key":"[^"\\]*","t":(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)[,}]')


class _Cursor:
    """One input table's entries, a block at a time: ``k`` key64s, ``off`` their line offsets (absolute, one
    more than entries), ``data`` the lines from ``base`` (= ``off[0]``); ``pos`` the first entry not handed
    out yet."""

    def __init__(self, reader: RangeReader, m: TableMeta, rank: int, block_bytes: int):
        self.reader, self.m, self.rank = reader, m, rank
        self.per = max(64, int(block_bytes // max(1.0, m.values_len / max(1, m.n))))  # entries a block
        self.next = 0
        self.k = np.zeros(0, dtype=np.uint64)
        self.off = np.zeros(1, dtype=np.int64)
        self.data = b""
        self.base = 0
        self.pos = 0

    def more(self) -> bool:
        return self.next < self.m.n

    def refill(self) -> None:
        """Reads the next block, after the entries not handed out yet."""
        m, a = self.m, self.next
        b = min(m.n, a + self.per)
        keys, offs = self.reader.read([(m.table.path, m.keys_off + 8 * a, m.keys_off + 8 * b),
                                       (m.table.path, m.offsets_off + 8 * a, m.offsets_off + 8 * (b + 1))])
        if isinstance(keys, FileNotFoundError) or isinstance(offs, FileNotFoundError):
            raise FileNotFoundError(m.table.path)
        off = np.frombuffer(offs, dtype="<u8").astype(np.int64)
        data = self.reader.read_one(m.table.path, int(off[0]), int(off[-1]))
        rest = self.data[int(self.off[self.pos]) - self.base:]
        self.k = np.concatenate([self.k[self.pos:], np.frombuffer(keys, dtype="<u8").astype(np.uint64)])
        self.off = np.concatenate([self.off[self.pos:-1], off])
        self.data = rest + data
        self.base = int(self.off[0])
        self.pos, self.next = 0, b


def write_times(lines: bytes, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The write time ``t`` of each line: read where ``entry_line`` puts it, or the line parsed as JSON."""
    out = np.empty(len(starts), dtype=np.float64)
    for i, (s, n) in enumerate(zip(starts.tolist(), lens.tolist())):
        line = lines[s:s + n]
        m = _T.match(line)
        out[i] = float(m.group(1)) if m else -merge_item(line)[2]
    return out


def merge_tables(reader: RangeReader, metas: list[TableMeta], cutoff: float | None,
                 open_writer: Callable[[], TableWriter], stats: dict) -> TableWriter | None:
    """Merges the tables (newest first) into the writer ``open_writer`` gives (opened at the first entry to
    write): one entry per key, the newest; entries older than ``cutoff`` dropped. Returns the writer (not
    committed), or None when nothing was left."""
    block = max(MIN_BLOCK_BYTES, BUDGET_BYTES // max(1, len(metas)))
    curs = [_Cursor(reader, m, r, block) for r, m in enumerate(metas)]
    expiring = {c.rank for c in curs if cutoff is not None and c.m.min_t < cutoff}
    for c in curs:
        if c.more():
            c.refill()
    w: TableWriter | None = None
    while True:
        active = [c for c in curs if c.pos < len(c.k) or c.more()]
        if not active:
            return w
        pending = [c for c in active if c.more()]
        frontier = min(int(c.k[-1]) for c in pending) if pending else None
        take = []
        for c in active:
            end = len(c.k) if frontier is None else int(np.searchsorted(c.k, np.uint64(frontier), "left"))
            if end > c.pos:
                take.append((c, c.pos, end))
        if take:
            w = _emit(take, cutoff, expiring, w, open_writer, stats)
        for c, _, end in take:
            c.pos = end
        for c in pending:
            if c.pos == len(c.k) or int(c.k[-1]) == frontier:
                c.refill()


def _emit(take: list, cutoff: float | None, expiring: set[int], w: TableWriter | None,
          open_writer: Callable[[], TableWriter], stats: dict) -> TableWriter | None:
    """One round: the entries taken from each cursor, ordered, deduplicated, expired ones dropped, written."""
    parts, ks, ranks, starts, lens = [], [], [], [], []
    at = 0
    for c, a, b in take:
        s0, s1 = int(c.off[a]) - c.base, int(c.off[b]) - c.base
        parts.append(c.data[s0:s1])
        ks.append(c.k[a:b])
        ranks.append(np.full(b - a, c.rank, dtype=np.int64))
        starts.append(c.off[a:b] - int(c.off[a]) + at)
        lens.append(np.diff(c.off[a:b + 1]))
        at += s1 - s0
    buf = b"".join(parts)
    k, rank, start, ln = np.concatenate(ks), np.concatenate(ranks), np.concatenate(starts), np.concatenate(lens)
    stats["entries_in"] += len(k)
    order = np.lexsort((rank, k))
    k, rank, start, ln = k[order], rank[order], start[order], ln[order]
    t = None  # per entry: NaN where not read (its table holds nothing older than the cutoff)
    if expiring:
        sel = np.flatnonzero(np.isin(rank, sorted(expiring)))
        if len(sel):
            t = np.full(len(k), np.nan)
            t[sel] = write_times(buf, start[sel], ln[sel])
    same = np.flatnonzero(k[1:] == k[:-1])
    if len(same):  # runs of equal key64s: ordered by (key, newest first), the newest of a key kept
        idx = np.arange(len(k))
        keep = np.ones(len(k), dtype=bool)
        for g0 in same[np.r_[True, same[1:] != same[:-1] + 1]].tolist():
            g1 = g0 + 1
            while g1 < len(k) and k[g1] == k[g0]:
                g1 += 1
            items = sorted(merge_item(buf[int(start[i]):int(start[i] + ln[i])])[1:3] + (i,) for i in range(g0, g1))
            last = None
            for j, (key, _, i) in enumerate(items):
                idx[g0 + j] = i
                keep[g0 + j] = key != last
                last = key
        stats["duplicates_dropped"] += int((~keep).sum())
        sel = idx[keep]
        k, rank, start, ln = k[sel], rank[sel], start[sel], ln[sel]
        t = t[sel] if t is not None else None
    if t is not None and cutoff is not None:
        live = ~(t < cutoff)  # NaN stays
        stats["expired_entries_dropped"] += int((~live).sum())
        k, rank, start, ln, t = k[live], rank[live], start[live], ln[live], t[live]
    if not len(k):
        return w
    if w is None:
        w = open_writer()
    # Write times for the footer: read where read, else the bounds of the entry's table.
    ranks_taken = np.array(sorted(c.rank for c, _, _ in take))
    lo = np.array([c.m.min_t for c, _, _ in sorted(take, key=lambda x: x[0].rank)])
    hi = np.array([c.m.max_t for c, _, _ in sorted(take, key=lambda x: x[0].rank)])
    src = np.frombuffer(buf, dtype=np.uint8)
    dt = np.int32 if len(buf) < 2**31 else np.int64
    ends = np.cumsum(ln)
    i = 0
    while i < len(k):  # the lines gathered in their new order, GATHER_BYTES at a time (one index a byte)
        j = max(i + 1, int(np.searchsorted(ends, (ends[i - 1] if i else 0) + GATHER_BYTES, "right")))
        n_bytes = int(ends[j - 1] - (ends[i - 1] if i else 0))
        out_start = ends[i:j] - ln[i:j] - (ends[i - 1] if i else 0)
        gather = np.repeat((start[i:j] - out_start).astype(dt), ln[i:j])
        gather += np.arange(n_bytes, dtype=dt)
        pos = np.searchsorted(ranks_taken, rank[i:j])
        tt = t[i:j] if t is not None else np.full(j - i, np.nan)
        known = ~np.isnan(tt)
        w.add_block(k[i:j], ln[i:j], src[gather].tobytes(), float(np.where(known, tt, lo[pos]).min()),
                    float(np.where(known, tt, hi[pos]).max()))
        i = j
    return w
