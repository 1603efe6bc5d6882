"""A lookup in the result cache: the wanted keys against every live table of a namespace, in rounds of batched
range reads (top blocks, key pages, then offsets, then values; ``cache/table.py`` says why this shape), the
entries handed out as they arrive. Its memory: the wanted keys (a shard's), each table's root or small top
index, and one wave's pages."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from batch_llm.cache.table import (
    BATCH_BYTES,
    DECODE,
    PAGE,
    RangeReader,
    Table,
    TableMeta,
    all_read,
    coalesce,
    key64_array,
    open_tables,
    read_top_blocks,
)

WAVE_KEYS = 65_536               # wanted keys looked up per round trip, at most...
WAVE_PAGE_BYTES = 64 * 2**20     # ...and fewer when their key pages would come to more than this


class Lookup:
    """An iterator of the found entries of one lookup; ``stats``: namespace, keys, hits, expired (candidates older
    than max_age), tables (consulted), objects_read, ranges_read, bytes_read, cache_bytes (of the tables
    consulted), retried (a table was deleted under it), seconds (its own time, not the consumer's).

    Of the namespace (``ResultCache.lookup`` gives them) it takes: its name ``ns``; ``list_tables``, its tables
    newest first, listed now and again when one was deleted under it; ``open_reader(stats)``, a range reader that
    counts into ``stats``; ``gap_bytes``; ``cutoff``, the oldest write time a hit may have (None: any)."""

    def __init__(self, keys: Iterable[str], *, ns: str, list_tables: Callable[[], list[Table]],
                 open_reader: Callable[[dict], RangeReader], gap_bytes: int, cutoff: float | None):
        t0 = time.perf_counter()
        self._list_tables, self._open_reader, self._gap_bytes = list_tables, open_reader, gap_bytes
        uniq = list(set(keys))
        k64 = key64_array(uniq)
        order = np.argsort(k64, kind="stable")
        self._k64 = k64[order]
        self._keys = [uniq[i] for i in order]
        self._found = np.zeros(len(uniq), dtype=bool)
        self._gstart = np.flatnonzero(np.r_[True, self._k64[1:] != self._k64[:-1]]) if len(uniq) else \
            np.zeros(0, dtype=np.int64)
        self._gk = self._k64[self._gstart]
        self._cutoff = cutoff
        listed = list_tables()
        self._tables = [t for t in listed if self._cutoff is None or t.max_t >= self._cutoff]
        self.stats: dict[str, Any] = {
            "namespace": ns, "keys": len(uniq), "hits": 0, "expired": 0, "tables": 0, "objects_read": 0,
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
        reader = self._open_reader(self.stats)
        consulted: set[str] = set()
        try:
            tables = self._tables if len(self._keys) else []
            for attempt in range(2):
                metas, gone = open_tables(reader, tables)
                consulted.update(x.name for x in tables)
                self.stats["tables"] = len(consulted)
                self.stats["cache_bytes"] += sum(m.table.size for m in metas)
                gone_names = {x.name for x in gone}
                wave = WAVE_KEYS
                while wave > 1024 and _wave_page_bytes(metas, wave, len(self._keys), self._gap_bytes) > WAVE_PAGE_BYTES:
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
                tables = [x for x in self._list_tables() if x.name not in consulted
                          and (self._cutoff is None or x.max_t >= self._cutoff)]
        finally:
            reader.close()
            self.stats["seconds"] = round(self.stats["seconds"] + time.perf_counter() - t, 4)

    def _wave(self, reader: RangeReader, metas: list[TableMeta], gone: set[str], a: int, b: int) -> Iterator[dict]:
        """Looks up wanted keys [a, b) in every table: key pages, then offsets of candidates, then values."""
        gap = self._gap_bytes
        todo = np.flatnonzero(~self._found[a:b]) + a
        if not len(todo):
            return
        cands = _candidates(reader, metas, gone, self._k64[todo], gap)
        if not cands:
            return
        rows = _value_ranges(reader, cands, gone, gap)
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

    def _read_values(self, reader: RangeReader, pick: list, gone: set[str], gap: int) -> Iterator[dict]:
        reqs, owners = [], []
        for m, starts, ends, ks in pick:
            if m.table.name in gone:
                continue
            order = np.argsort(starts, kind="stable")
            starts, ends, ks = starts[order], ends[order], ks[order]
            gid, gs, ge = coalesce(starts, ends, gap)
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
                    entry = DECODE(buf[s - base:e - base])
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


def _wave_page_bytes(metas: list[TableMeta], wave: int, keys: int, gap: int) -> int:
    """About the bytes of key pages a wave of ``wave`` of the ``keys`` wanted keys (in key order: a wave covers
    about wave/keys of each table) reads: per table, the key index over that span where its wanted pages lie
    closer than the gap (read as one), else a page and a gap per key."""
    return sum(min(8 * m.n * wave // max(1, keys), wave * (PAGE * 8 + gap)) for m in metas)


def _candidates(reader: RangeReader, metas: list[TableMeta], gone: set[str], w_all: np.ndarray, gap: int) -> list:
    """Round 1 of a wave (2 where a table is looked up through its root: its top blocks first): the key pages
    that can hold a wanted key64 ``w_all``, read in one batch; returns (rank, table, entry indexes, key64s) per
    table of every key-page slot equal to a wanted key64."""
    wanted = []
    for rank, m in enumerate(metas):
        if m.table.name in gone or m.n == 0:
            continue
        w = w_all[(w_all >= m.min_k64) & (w_all <= m.max_k64)]
        if len(w):
            wanted.append((rank, m, w))
    tops = read_top_blocks(reader, [(m, w) for _, m, w in wanted], gap, gone)
    plans = []
    reqs: list[tuple[str, int, int]] = []
    for rank, m, w in wanted:
        if m.table.name not in tops:
            continue
        page_no, top = tops[m.table.name]
        hi = np.searchsorted(top, w, "right") - 1
        lo = np.maximum(np.searchsorted(top, w, "left") - 1, 0)
        page_runs = [hi]
        for i in np.flatnonzero(lo < hi):  # a key64 equal to a page's first: the run may start a page back
            page_runs.append(np.arange(lo[i], hi[i]))
        pages = page_no[np.unique(np.concatenate(page_runs))]
        e0 = pages * PAGE
        e1 = np.minimum(e0 + PAGE, m.n)
        _, gs, ge = coalesce(m.keys_off + e0 * 8, m.keys_off + e1 * 8, gap)
        plans.append((rank, m, w, gs, ge, len(reqs)))
        reqs.extend((m.table.path, int(s), int(e)) for s, e in zip(gs, ge))
    got = reader.read(reqs) if reqs else []
    # Candidates: (rank, entry index, key64) for every key-page slot equal to a wanted key64.
    cands = []
    for rank, m, w, gs, ge, at in plans:
        parts = all_read(got[at:at + len(gs)])
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
    return cands


def _value_ranges(reader: RangeReader, cands: list, gone: set[str], gap: int) -> list:
    """Round 2 of a wave: the offsets of the candidates, read in one batch; returns (key64s, ranks, value starts,
    value ends, table) per table."""
    reqs: list[tuple[str, int, int]] = []
    offset_plans = []
    for rank, m, idx, ks in cands:
        gid, gs, ge = coalesce(m.offsets_off + idx * 8, m.offsets_off + idx * 8 + 16, gap)
        offset_plans.append((rank, m, idx, ks, gid, gs, len(reqs)))
        reqs.extend((m.table.path, int(s), int(e)) for s, e in zip(gs, ge))
    got = reader.read(reqs)
    rows = []  # (key64, rank, value start, value end, table) per candidate
    for rank, m, idx, ks, gid, gs, at in offset_plans:
        parts = all_read(got[at:at + len(gs)])
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
    return rows
