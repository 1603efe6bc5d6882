"""Content filter: scan outputs against sensitive-word lists, each with an action (flag, mask, drop).

Lists are Aho-Corasick automata (pyahocorasick), so a scan costs one pass over the text however many words
the lists hold. Words made of ASCII letters and digits match whole words only; others (Chinese has no word
boundaries) match anywhere.
"""
from __future__ import annotations

import errno
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import ahocorasick

from batch_llm.config import BUILTIN_WORDLISTS, FilterConfig, WordListConfig
from batch_llm.manifests import FilterSummary
from batch_llm.storage import as_path

BUILTIN = BUILTIN_WORDLISTS


def load_words(path: str, options: dict | None = None) -> list[str]:
    if path.startswith("builtin:"):
        p = BUILTIN / f"{path.removeprefix('builtin:')}.txt"
        if not p.exists():
            raise FileNotFoundError(f"no built-in word list {path!r}; built-ins: "
                                    f"{', '.join('builtin:' + f.stem for f in BUILTIN.glob('*.txt'))}")
        text = p.read_text(encoding="utf-8")
    else:
        text = as_path(path, options).read_text(encoding="utf-8")
    words = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [w for w in words if w]


def _list_words(wl: WordListConfig, options: dict | None) -> list[str]:
    """The list's words; a list that is not there fails naming the list and its path. The lists load when the
    filter stage starts, before a row is read: an object-storage list is checked here (local files already
    when the pipeline file loads, ``config.word_list_problems``)."""
    try:
        return load_words(wl.path, options)
    except FileNotFoundError as e:
        why = str(e) if wl.path.startswith("builtin:") else "no such file"
        raise FileNotFoundError(errno.ENOENT, f"word list {wl.name!r} (filter.lists): {why}; fix its path or "
                                f"create the file", wl.path) from None


@dataclass
class _List:
    cfg: WordListConfig
    automaton: ahocorasick.Automaton


def _is_word_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "_")


class ContentFilter:
    def __init__(self, cfg: FilterConfig, storage_options: dict | None = None):
        self.cfg = cfg
        self.lists: list[_List] = []
        for wl in cfg.lists:
            a = ahocorasick.Automaton()
            for w in _list_words(wl, storage_options):
                key = w if cfg.case_sensitive else w.lower()
                a.add_word(key, key)
            if len(a):
                a.make_automaton()
                self.lists.append(_List(wl, a))

    def scan(self, text: str) -> list[tuple[_List, int, int, str]]:
        """Every hit as (list, start, end, word); whole-word rule for ASCII words."""
        hay = text if self.cfg.case_sensitive else text.lower()
        if len(hay) != len(text):  # a lowercase form of another length would shift the offsets
            hay = text
        hits = []
        for lst in self.lists:
            for end, word in lst.automaton.iter(hay):
                start = end - len(word) + 1
                if _is_word_char(word[0]) and start > 0 and _is_word_char(hay[start - 1]):
                    continue
                if _is_word_char(word[-1]) and end + 1 < len(hay) and _is_word_char(hay[end + 1]):
                    continue
                hits.append((lst, start, end + 1, word))
        return hits

    def apply(self, row: dict, text_key: str = "output") -> tuple[dict | None, list[dict]]:
        """(the row after its actions, or None when dropped; the hits as dicts). A row with several samples
        (``outputs``, n > 1) is scanned in every sample: a drop hit in any drops the row, masks apply to each,
        and each hit names its ``sample``; ``output`` stays the first sample, masked as it is."""
        samples = row.get("outputs") if text_key == "output" else None
        texts = samples if isinstance(samples, list) and samples else [row.get(text_key)]
        hits = [(i, h) for i, text in enumerate(texts) if text for h in self.scan(text)]
        if not hits:
            return row, []
        found = [_hit(h, i if texts is samples else None) for i, h in hits]
        if any(h[0].cfg.action == "drop" for _, h in hits):
            return None, found
        out = dict(row)
        masked = [self._masked(text, [h for j, h in hits if j == i]) for i, text in enumerate(texts)]
        if texts is samples:
            out["outputs"] = masked
        out[text_key] = masked[0]
        out["filter_hits"] = found
        return out, found

    def _masked(self, text: str | None, hits: list) -> str | None:
        if not text or not hits:
            return text
        chars = list(text)
        for lst, start, end, _ in hits:
            if lst.cfg.action == "mask":
                chars[start:end] = self.cfg.mask_char * (end - start)
        return "".join(chars)


def _hit(h, sample: int | None = None) -> dict:
    lst, start, end, word = h
    hit = {"list": lst.cfg.name, "word": word, "action": lst.cfg.action, "start": start, "end": end}
    if sample is not None:
        hit["sample"] = sample
    return hit


# Dropped ids listed in the manifest; every dropped row is in ``dropped.jsonl``.
DROPPED_IDS_SHOWN = 100


class FilteredRows:
    """The rows that survive the lists (masked or flagged), streamed; dropped rows' ids and hits go to
    ``dropped`` (a writer) as they pass. Counts per list and word are bounded by the word lists."""

    def __init__(self, rows: Iterable[dict], cfg: FilterConfig, storage_options: dict | None = None, *,
                 dropped=None):
        self.rows, self.filter, self.dropped = rows, ContentFilter(cfg, storage_options), dropped
        self.per_list: Counter = Counter()
        self.per_word: dict[str, Counter] = defaultdict(Counter)
        self.counts: Counter = Counter()
        self.dropped_ids: list[str] = []

    def __iter__(self) -> Iterator[dict]:
        for row in self.rows:
            self.counts["scanned"] += 1
            out, hits = self.filter.apply(row)
            if hits:
                self.counts["affected"] += 1
                for h in hits:
                    self.per_list[h["list"]] += 1
                    self.per_word[h["list"]][h["word"]] += 1
                actions = {h["action"] for h in hits}
                self.counts["flagged"] += "flag" in actions
                self.counts["masked"] += "mask" in actions
            if out is None:
                self.counts["dropped"] += 1
                if len(self.dropped_ids) < DROPPED_IDS_SHOWN:
                    self.dropped_ids.append(row["id"])
                if self.dropped is not None:
                    self.dropped.write((json.dumps({"id": row["id"], "idx": row["idx"], "hits": hits},
                                                   ensure_ascii=False) + "\n").encode("utf-8"))
                continue
            yield out

    def summary(self, *, dropped: str | None = None) -> FilterSummary:
        c = self.counts
        return FilterSummary(
            rows_scanned=c["scanned"], rows_affected=c["affected"], rows_dropped=c["dropped"],
            rows_flagged=c["flagged"], rows_masked=c["masked"], hits_per_list=dict(self.per_list),
            hits_per_word={k: dict(v) for k, v in self.per_word.items()}, dropped_ids=self.dropped_ids,
            dropped=dropped, lists=[{"name": lst.cfg.name, "path": lst.cfg.path, "action": lst.cfg.action}
                                    for lst in self.filter.lists])


def filter_rows(rows: Iterable[dict], cfg: FilterConfig, storage_options: dict | None = None, *,
                dropped=None) -> FilteredRows:
    """The surviving rows (iterate once); ``.summary()`` afterwards says what the lists did."""
    return FilteredRows(rows, cfg, storage_options, dropped=dropped)
