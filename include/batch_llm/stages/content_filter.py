"""Content filter: scan outputs against sensitive-word lists, each with an action (flag, mask, drop).

Lists are Aho-Corasick automata (pyahocorasick), so a scan costs one pass over the text however many words
the lists hold. Words made of ASCII letters and digits match whole words only, or their forms with a list's
``match: prefix`` / ``stem``; others (Chinese has no word boundaries) match anywhere.

Text and words are compared folded (``fold_text``): NFKC (full-width ``ＢＡＤ`` is ``bad``, the ligature ``ﬁ``
is ``fi``), case-folded unless ``filter.case_sensitive`` (``Straße`` is ``strasse``; ``İ`` is ``i``), and without
invisible characters (zero-width spaces and joiners, soft hyphens, word joiners, BOMs, all of category Cf, and
variation selectors), so none of these hides a listed word. The folded text keeps a map back to the original
characters: hits, their offsets and the masks are in the original text, the text around them untouched. Folding
is linear in the text's length, however many combining marks pile on one letter (``_stream_safe``).
"""
from __future__ import annotations

import bisect
import errno
import functools
import json
import re
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import ahocorasick

from batch_llm import generated_text
from batch_llm.config import FilterConfig, PipelineConfig, WordListConfig
from batch_llm.host import path_policy
from batch_llm.io.storage import (
    Location,
    as_path,
    atomic_writer,
    exists,
    iter_jsonl,
    write_jsonl,
)
from batch_llm.layout import RunLayout
from batch_llm.manifests import (
    FetchManifest,
    FilterManifest,
    FilterPart,
    FilterSummary,
    PlanManifest,
    ReviewSummary,
    ShardManifest,
    ShardResult,
)
from batch_llm.reasoning import THINK_END, THINK_START
from batch_llm.stages.confusables import fold_pieces
from batch_llm.stages.publish import publish_part
from batch_llm.stages.review import (
    ReviewedRows,
    check_reviews,
    flat_results,
    review_active,
    review_verdict_rows,
)

# The fields the lists scan by their ``scan`` (config/filter.py: ScannedField), answer first; the tokens hold both
SCANNED_FIELDS = ("output", "reasoning")


def load_words(path: str, options: dict | None = None) -> list[str]:
    """The words of a list: ``builtin:NAME`` (a shipped list only), a local file or an object, read with the
    path policy's bound (a device, a FIFO or a file over ``MAX_WORD_LIST_BYTES`` is refused, not read)."""
    if path.startswith(path_policy.BUILTIN_PREFIX):
        try:
            p = path_policy.builtin_file(path)
        except path_policy.PathRefused as e:
            raise FileNotFoundError(str(e)) from None
        text = p.read_text(encoding="utf-8")
    else:
        text = path_policy.read_file_bounded(as_path(path, options), path_policy.MAX_WORD_LIST_BYTES).decode("utf-8")
    words = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [w for w in words if w]


def _list_words(wl: WordListConfig, options: dict | None) -> list[str]:
    """The list's words; a list that is not there fails naming the list and its path. The lists load when the
    filter stage starts, before a row is read: an object-storage list is checked here (local files already
    when the pipeline file loads, ``config.filter.word_list_problems``)."""
    try:
        return load_words(wl.path, options)
    except FileNotFoundError as e:
        why = str(e) if wl.path.startswith("builtin:") else "no such file"
        raise FileNotFoundError(errno.ENOENT, f"word list {wl.name!r} (filter.lists): {why}; fix its path or "
                                f"create the file", wl.path) from None
    except path_policy.PathRefused as e:
        raise path_policy.PathRefused(f"word list {wl.name!r} (filter.lists): {e}") from None


@dataclass
class _List:
    cfg: WordListConfig
    automaton: ahocorasick.Automaton


def _is_word_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "_")


# Invisible characters that are not of category Cf (Unicode's Default_Ignorable_Code_Point less Cf): the
# combining grapheme joiner, Hangul fillers, Khmer inherent vowels, Mongolian and other variation selectors.
_INVISIBLE_RANGES = ((0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F), (0x3164, 0x3164),
                     (0xFE00, 0xFE0F), (0xFFA0, 0xFFA0), (0xE0100, 0xE01EF))
_FOLD_CACHE_MAX = 1 << 16  # characters remembered per table: a run's texts use a few thousand


def _is_invisible(c: str) -> bool:
    cp = ord(c)
    return unicodedata.category(c) == "Cf" or any(lo <= cp <= hi for lo, hi in _INVISIBLE_RANGES)


def _char_class(ranges: list[tuple[int, int]]) -> re.Pattern:
    """A regex matching one character of the given code point ranges (merged where they touch)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return re.compile("[" + "".join(f"{re.escape(chr(lo))}-{re.escape(chr(hi))}" for lo, hi in merged) + "]")


@functools.cache
def _invisible_patterns() -> tuple[re.Pattern, re.Pattern]:
    """(quick, exact): ``exact`` matches every invisible character; ``quick`` those of the Basic Multilingual
    Plane and any character beyond it, five times faster a search (one bitmap). Built once (~0.1 s, on the
    first row that is not ASCII)."""
    cf = [(cp, cp) for cp in range(0x110000) if unicodedata.category(chr(cp)) == "Cf"]
    ranges = cf + list(_INVISIBLE_RANGES)
    return (_char_class([r for r in ranges if r[1] < 0x10000] + [(0x10000, 0x10FFFF)]), _char_class(ranges))


def _has_invisible(text: str) -> bool:
    quick, exact = _invisible_patterns()
    return quick.search(text) is not None and exact.search(text) is not None


# Unicode's stream-safe bound (UAX #15): at most this many non-starters in a row before a normalisation
_MAX_NON_STARTERS = 30


@functools.cache
def _long_non_starter_run() -> re.Pattern:
    """``_MAX_NON_STARTERS`` characters in a row that decompose to combining marks only (a combining class
    other than 0), followed by another: where ``_stream_safe`` breaks the run. Built once (~0.1 s)."""
    marks = [(cp, cp) for cp in range(0x110000) if unicodedata.combining(chr(cp)) or (
        unicodedata.decomposition(chr(cp)) and unicodedata.combining(unicodedata.normalize("NFKD", chr(cp))[0]))]
    mark = _char_class(marks).pattern
    return re.compile(f"{mark}{{{_MAX_NON_STARTERS}}}(?={mark})")


def _stream_safe(s: str) -> str:
    """``s`` with a combining grapheme joiner (U+034F, a starter, invisible: folding drops it again) after every
    ``_MAX_NON_STARTERS`` combining marks of a run. CPython's normalisation orders a run of marks by insertion
    sort, quadratic in the run's length: one letter under 80,000 marks of mixed classes took 5 s a call. Only
    the order of marks beyond the 30th changes, which no listed word holds."""
    if len(s) <= _MAX_NON_STARTERS:
        return s
    return _long_non_starter_run().sub("\\g<0>\u034f", s)


def _fold_string(s: str, casefold: bool) -> str:
    """Invisible characters dropped, NFKD, (casefold) full case folding, NFKC: Unicode's compatibility caseless
    match, composed. ``İ`` folds to ``i`` (Unicode's Turkic folding) rather than ``i`` plus a combining dot, so
    ``SHİT`` reads as ``shit``."""
    invisible = _invisible_patterns()[1]
    # invisible ones first: they would keep an accent off its letter
    s = unicodedata.normalize("NFKD", _stream_safe(invisible.sub("", s)))
    if casefold:
        s = (_without_dot_above_capital_i(s) if "\u0307" in s else s).casefold()
    return invisible.sub("", unicodedata.normalize("NFKC", s))


def _without_dot_above_capital_i(s: str) -> str:
    """``s`` (decomposed) without the combining dot above of each ``İ``: the dot follows its ``I`` after any
    marks that sort before it (a dot below)."""
    out, after_i = [], False
    for c in s:
        if c == "\u0307" and after_i:
            after_i = False
            continue
        if c == "I":
            after_i = True
        elif unicodedata.combining(c) in (0, 230):  # another letter, or another mark above: not İ's dot
            after_i = False
        out.append(c)
    return "".join(out)


class _FoldTable(dict):
    """Each character's folded form (``""`` for an invisible one), computed once: a dict lookup per character
    is what keeps folding cheap on the rows that need it character by character."""

    def __init__(self, casefold: bool):
        super().__init__()
        self.casefold = casefold

    def __missing__(self, c: str) -> str:
        if len(self) >= _FOLD_CACHE_MAX:  # bounded whatever the texts hold
            self.clear()
        folded = self[c] = "" if _is_invisible(c) else _fold_string(c, self.casefold)
        return folded


_TABLES = {True: _FoldTable(casefold=True), False: _FoldTable(casefold=False)}


@dataclass
class Folded:
    """A text as the word lists see it (``text``), with each of its characters' place in the original:
    ``starts[k]``/``ends[k]`` are the first and last original characters that folded character ``k`` came
    from; ``None``: the same place, the common case of ASCII and most other text. Where the characters folded
    one by one (``pieces``, one per original character), the places are counted on the first hit: most rows
    have none."""

    text: str
    starts: list[int] | None = None
    ends: list[int] | None = None
    pieces: list[str] | None = None
    # Where the separators fold dropped a run of separators: the folded characters right after one, each the
    # start of a word for the whole-word rule
    joins: frozenset[int] = frozenset()

    def span(self, first: int, last: int) -> tuple[int, int]:
        """The original characters (start, end) that folded characters ``first``..``last`` came from, any
        invisible ones between them included."""
        if self.pieces is not None and self.starts is None:
            self.starts = self.ends = [i for i, piece in enumerate(self.pieces) for _ in piece]
        if self.starts is None or self.ends is None:  # set together: both None or both lists
            return first, last + 1
        return self.starts[first], self.ends[last] + 1


def fold_text(text: str, casefold: bool = True) -> Folded:
    """``text`` folded as the module docstring says, with the map back to it. Most rows fold in C calls: ASCII,
    and text that is NFKC already, whose every character case-folds to one character, with nothing invisible
    (Chinese, accented Latin, Cyrillic). Other rows fold character by character (cached); where that leaves
    characters that compose with the one before them (a letter followed by its combining accent, Hangul jamo),
    those fold together, as NFKC of the whole text would."""
    if text.isascii():  # NFKC leaves ASCII as it is, and ASCII has no invisible characters
        return Folded(text.lower() if casefold else text)
    hay = text.casefold() if casefold else text
    if len(hay) == len(text) and "\u0307" not in text and unicodedata.is_normalized("NFKC", text) and \
            unicodedata.is_normalized("NFKC", hay) and not _has_invisible(text):
        return Folded(hay)  # one character each (folding never shortens one): the places are unchanged
    pieces = list(map(_TABLES[casefold].__getitem__, text))
    hay = "".join(pieces)
    # Folded one by one, characters are folded as in the whole text unless the result composes further (not
    # NFC), or holds what case folding and İ treat apart from their neighbours: a dot above, a Greek iota
    # (the fold of U+0345, which moves it among the accents). Only then is the whole text folded to compare.
    if (not unicodedata.is_normalized("NFC", hay) or "\u0307" in hay or "\u03b9" in hay) and \
            hay != _fold_string(text, casefold):
        return _fold_by_cluster(text, pieces, casefold)
    if len(hay) == len(text) and "" not in pieces:
        return Folded(hay)
    return Folded(hay, pieces=pieces)


def _fold_by_cluster(text: str, pieces: list[str], casefold: bool) -> Folded:
    """``fold_text`` for a text with characters that compose with the previous one: a cluster (a character and
    those that combine with it) folds as one string, and each of its folded characters maps to all of it."""
    # [first, last, source characters, folded or None while marks join it] each, in the original's order: a
    # cluster folds again only when a character that is not a mark asks whether it composes with it, and once
    # at the end, so a letter under thousands of marks folds once, not once a mark. A character that is not a
    # mark composes only with the one right before it (any mark between blocks it): its last character is what
    # it is checked against, not the whole cluster.
    clusters: list[list] = []
    for i, piece in enumerate(pieces):
        if not piece:  # invisible: no part of a cluster, inside whichever span surrounds it
            continue
        cur = clusters[-1] if clusters else None
        if cur and unicodedata.combining(piece[0]):
            cur[1], cur[3] = i, None
            cur[2].append(text[i])
            continue
        if cur and cur[3] is None:
            cur[3] = _fold_string("".join(cur[2]), casefold)
        if cur and not unicodedata.is_normalized("NFC", cur[3][-1:] + piece):
            cur[1], cur[3] = i, None
            cur[2].append(text[i])
        else:
            clusters.append([i, i, [text[i]], piece])
    for c in clusters:
        if c[3] is None:
            c[3] = _fold_string("".join(c[2]), casefold)
    return Folded("".join(c[3] for c in clusters), [c[0] for c in clusters for _ in c[3]],
                  [c[1] for c in clusters for _ in c[3]])


def refold(folded: Folded, folds: tuple[str, ...], casefold: bool = True) -> Folded:
    """``folded`` with a list's look-alike folds applied (``filter.lists[].fold``: ``stages.confusables``), its
    map back to the original text kept: each character maps to the original characters of the one it came from."""
    if not folds:
        return folded
    got = fold_pieces(folded.text, folds, casefold)
    if got is None:
        return folded
    pieces, runs = got
    src = [j for j, piece in enumerate(pieces) for _ in piece]  # each new character's place in ``folded.text``
    # and the last character of ``folded.text`` it stands for: the accents the fold dropped after it too (a mask
    # leaves no mark hanging), not a dropped run of separators; the characters after such a run start a word
    upto = [n - 1 for n in src[1:]] + [len(pieces) - 1]
    joins: set[int] = set()
    for start, end in runs:
        k = bisect.bisect_left(src, end)  # ``src`` is in order
        if 0 < k < len(src):
            joins.add(k)
            upto[k - 1] = start - 1
    if src:
        folded.span(0, 0)  # counts the places of a text folded character by character
    starts, ends = src, upto  # ``folded`` in the places of the original: the common case
    if folded.starts is not None and folded.ends is not None:
        starts, ends = [folded.starts[j] for j in src], [folded.ends[j] for j in upto]
    return Folded("".join(pieces), starts, ends, joins=frozenset(joins))


# The word forms of ``match: stem`` (English endings after the listed word) and ``match: prefix`` (any letters
# and digits, up to 32: the hit takes them, so the mask covers ``casinos``, not ``casino`` and an ``s``); any
# case, for a list under filter.case_sensitive
_FORM_MAX = 32
_WORD_FORMS = {"stem": re.compile(r"(?:s|es|ed|d|ing|ings|er|ers)?(?![a-z0-9])", re.IGNORECASE),
               "prefix": re.compile(f"[a-z0-9]{{0,{_FORM_MAX}}}", re.IGNORECASE)}


def _word_end(folded: Folded, first: int, last: int, word: str, match: str) -> int | None:
    """Where a hit of ``word`` at folded characters ``first``..``last`` ends (its last folded character), or None
    when the list does not match it there. Words of ASCII letters match whole words (``ass`` is not in
    ``class``; ``_`` is a letter there); ``match: prefix`` any word that starts with the listed one, ``match:
    stem`` the word with an English ending (``casinos``; ``_`` ends a word: ``casino_bonus``). A separator that
    the separators fold dropped still ends a word (``joins``)."""
    hay, joins = folded.text, folded.joins
    if _is_word_char(word[0]) and first > 0 and _is_word_char(hay[first - 1]) and first not in joins:
        return None
    if not _is_word_char(word[-1]) or last + 1 == len(hay) or last + 1 in joins:
        return last
    if match == "word":
        return None if _is_word_char(hay[last + 1]) else last
    # a dropped separator ends the word form (looked for as far as the longest form reaches)
    limit = next((k for k in range(last + 2, min(len(hay), last + 2 + _FORM_MAX)) if k in joins), len(hay))
    form = _WORD_FORMS[match].match(hay, last + 1, limit)
    return None if form is None else form.end() - 1


class ContentFilter:
    def __init__(self, cfg: FilterConfig, storage_options: dict | None = None):
        self.cfg = cfg
        self.casefold = not cfg.case_sensitive
        self.lists: list[_List] = []
        self.longest = 0  # the longest word, folded
        for wl in cfg.lists:
            a = ahocorasick.Automaton()
            for w in _list_words(wl, storage_options):
                key = self._fold(w, tuple(wl.fold)).text  # words fold as the texts do
                if key:
                    a.add_word(key, key)
                    self.longest = max(self.longest, len(key))
            if len(a):
                a.make_automaton()
                self.lists.append(_List(wl, a))

    def scan(self, text: str, field: str | None = None) -> list[tuple[_List, int, int, str]]:
        """Every hit as (list, start, end, word): offsets in ``text``, the word as folded; whole-word rule for
        ASCII words. ``field``: only the lists that scan that field (``output``, ``reasoning``); None: all. The
        thinking's markers (``<think>``, ``</think>``) are read past, as the invisible characters are: a word
        around one (the end of the thinking and the start of the answer, in the tokens) is a hit over it."""
        lists = [lst for lst in self.lists if field is None or field in (lst.cfg.scan or self.cfg.scan)]
        if not lists:
            return []
        hay_text, places = _without_markers(text)
        base = fold_text(hay_text, self.casefold)
        by_folds: dict[tuple[str, ...], Folded] = {(): base}  # lists of the same folds share one folded text
        hits = []
        for lst in lists:
            folds = tuple(lst.cfg.fold)
            if folds not in by_folds:
                by_folds[folds] = refold(base, folds, self.casefold)
            folded = by_folds[folds]
            for last, word in lst.automaton.iter(folded.text):
                first = last - len(word) + 1
                end = _word_end(folded, first, last, word, lst.cfg.match)
                if end is not None:
                    start, stop = folded.span(first, end)
                    if places is not None:  # back from the text without the thinking's markers to the row's
                        start, stop = places[start], places[stop - 1] + 1
                    hits.append((lst, start, stop, word))
        return hits

    def _fold(self, text: str, folds: tuple[str, ...]) -> Folded:
        return refold(fold_text(text, self.casefold), folds, self.casefold)

    def apply(self, row: dict) -> tuple[dict | None, list[dict]]:
        """(the row after its actions, or None when dropped; the hits as dicts). Every copy of generated text in
        the row (``generated_text.copies``: each sample's answer and thinking, the log-probabilities' tokens and
        their alternatives) is scanned: the answer and the thinking by the lists that scan them (``scan``),
        the tokens, which hold both, by every list, and so is each sample's thinking and answer read as one,
        for a word around the thinking's end. A drop hit in any copy drops the row; masks apply to every copy
        the hit is in (``generated_text.masked``). Each hit names its ``field`` where not the answer, its
        ``sample`` where the row has several, and an alternative's ``place`` (token, rank); the row's
        ``filter_hits`` are these, less the word of a mask hit."""
        hits = [(c, h) for c in generated_text.copies(row)
                for h in self.scan(c.text, c.field if c.field in SCANNED_FIELDS else None)]
        many = generated_text.sample_count(row) > 1
        across = [h for k in range(generated_text.sample_count(row)) for h in self._across_thinking_end(row, k)]
        found = [_hit(h, c, row, many) for c, h in hits] + [hit for hit, _ in across]
        if not found:
            return row, []
        if any(h["action"] == "drop" for h in found):
            return None, found
        spans: generated_text.Spans = {}
        for c, (lst, start, end, _) in hits:
            if lst.cfg.action == "mask":
                spans.setdefault(c.key, []).extend(_unmarked(c.text, start, end))
        for hit, parts in across:
            if hit["action"] == "mask":
                for key, span in parts:
                    spans.setdefault(key, []).append(span)
        out = generated_text.masked(row, spans, self.cfg.mask_char)
        out = dict(out) if out is row else out
        # a mask hit's word is the masked text: the published hit names its list and place, not the word
        out["filter_hits"] = [{k: v for k, v in h.items() if k != "word" or h["action"] != "mask"} for h in found]
        return out, found

    def _across_thinking_end(self, row: dict, k: int) -> list[tuple[dict, list]]:
        """Hits of a word begun at the end of sample ``k``'s thinking and ended at the start of its answer (each
        field alone holds part of it), each with the spans it covers in the two fields."""
        reasoning, answer = (generated_text.text_of(row, f, k) for f in ("reasoning", "output"))
        if not (reasoning and answer and self.lists):
            return []
        # Only the text around the end can hold such a word. In ASCII a word of n folded characters spans at most
        # 2n - 1 (letters spaced out, the separators fold); other text may hide any number of invisible
        # characters in a word, so it is read whole.
        width = 2 * self.longest + 8
        skip = max(len(reasoning) - width, 0)
        tail, head = reasoning[skip:], answer[:width]
        if not (tail.isascii() and head.isascii()):
            skip, tail, head = 0, reasoning, answer
        cut = len(tail) + len(THINK_END)
        found = []
        for lst, start, end, word in self.scan(tail + THINK_END + head):
            if start < len(tail) and end > cut:
                start += skip
                hit = {"list": lst.cfg.name, "word": word, "action": lst.cfg.action, "start": start,
                       "end": end + skip, "field": "reasoning+output"}
                if generated_text.sample_count(row) > 1:
                    hit["sample"] = k
                found.append((hit, [(("reasoning", k), (start, len(reasoning))), (("output", k), (0, end - cut))]))
        return found


_MARKERS = re.compile("|".join(re.escape(m) for m in (THINK_START, THINK_END)))


def _without_markers(text: str) -> tuple[str, list[int] | None]:
    """``text`` without the thinking's markers, and each kept character's place in ``text`` (None: none cut)."""
    if THINK_START not in text and THINK_END not in text:
        return text, None
    kept: list[str] = []
    places: list[int] = []
    at = 0
    for m in _MARKERS.finditer(text):
        kept.append(text[at:m.start()])
        places += range(at, m.start())
        at = m.end()
    kept.append(text[at:])
    places += range(at, len(text))
    return "".join(kept), places


def _unmarked(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The span ``start``..``end`` of ``text`` less the thinking's markers in it: a mask over a word around
    ``</think>`` leaves the marker readable (where the thinking ends is no part of the word)."""
    spans, at = [], start
    for m in _MARKERS.finditer(text, start, end):
        if m.start() > at:
            spans.append((at, m.start()))
        at = m.end()
    if end > at:
        spans.append((at, end))
    return spans


def _hit(h, copy: generated_text.Copy, row: dict, many_samples: bool) -> dict:
    lst, start, end, word = h
    hit = {"list": lst.cfg.name, "word": word, "action": lst.cfg.action, "start": start, "end": end}
    if many_samples:
        hit["sample"] = copy.sample
    if copy.field != "output":  # a hit in the thinking or the tokens; offsets are into that copy
        hit["field"] = copy.field
    if copy.field == generated_text.ALTERNATIVE:  # offsets into the alternative at its place (token, rank)
        i, j, at = generated_text.alternative_at(row, copy.sample, start)
        hit.update(place=[i, j], start=at, end=at + end - start)
    return hit


# Dropped ids listed in the manifest; every dropped row is in ``dropped.jsonl``.
DROPPED_IDS_SHOWN = 100


class FilteredRows:
    """The rows that survive the lists (masked or flagged), streamed; dropped rows' ids and hits go to
    ``dropped`` (a writer) as they pass. Counts per list and word are bounded by the word lists."""

    def __init__(self, rows: Iterable[dict], cfg: FilterConfig, storage_options: dict | None = None, *,
                 dropped=None, review: ReviewedRows | None = None, lists: ContentFilter | None = None):
        self.rows, self.dropped = rows, dropped
        self.filter = lists or ContentFilter(cfg, storage_options)
        self.review = review  # filter.review: the verdicts, joined after the word lists
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
            reason = None
            if out is not None and self.review is not None:
                out, reason = self.review.take(out)
            if out is None:
                self.counts["dropped"] += 1
                if len(self.dropped_ids) < DROPPED_IDS_SHOWN:
                    self.dropped_ids.append(row["id"])
                if self.dropped is not None:
                    # a row the review dropped says why (stage review); the word lists' drops carry their hits
                    why = {"stage": "review", "reason": reason} if reason else {}
                    self.dropped.write((json.dumps({"id": row["id"], "idx": row["idx"], "hits": hits, **why},
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
                dropped=None, review: ReviewedRows | None = None) -> FilteredRows:
    """The surviving rows (iterate once); ``.summary()`` afterwards says what the lists (and ``review``: the
    review's verdicts, ``stages.review``) did."""
    return FilteredRows(rows, cfg, storage_options, dropped=dropped, review=review)


def content_filter(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest,
                   shards: Sequence[ShardResult | ShardManifest | dict | list],
                   reviews: Sequence[ShardResult | ShardManifest | dict | list] | None = None) -> FilterManifest:
    """The whole filter pass in this process (the CLI, the benchmarks): every shard through ``filter_shard``, then
    ``join_filter``. The DAG runs the same two steps as tasks: ``filter_shard`` mapped over the shard tasks, and
    the ``content_filter`` task, which joins their counts and reads no row.

    ``shards``: one result per shard, or, from tasks of several shards (``sharding.shards_per_task``), one list of
    results per task. ``reviews``: the review pass's shard results (``filter.review``, ``stages.review``), handed
    over the same way; their verdicts join the rows after the word lists."""
    results = flat_results(shards)
    check_shards_of_plan(plan, results)
    by_shard: dict[int, ShardResult] = {}
    if review_active(cfg) and cfg.filter.enabled and cfg.engine.task == "generate":
        if reviews is None:
            raise ValueError(_NO_REVIEWS)
        reviewed = flat_results(reviews)
        check_reviews(cfg, results, reviewed, layout.output_root.options)
        by_shard = {r.shard: r for r in reviewed}
    parts = [filter_shard(cfg, layout, plan, r, by_shard.get(r.shard)) for r in results]
    return join_filter(cfg, layout, plan, results, parts)


_NO_REVIEWS = ("filter.review is set but no review results were handed to the content filter; run the review of "
               "every shard first (the review task)")


def filter_shard(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest, shard: ShardResult | ShardManifest | dict,
                 review: ShardResult | ShardManifest | dict | None = None) -> FilterPart:
    """One shard's rows through the word lists, then the review's verdicts (``review``: the shard's review result,
    ``filter.review``): its kept rows to ``<run>/filter/shard-NNNNN/outputs.jsonl`` and its dropped rows (ids and
    hits) to ``dropped.jsonl`` beside it, streamed; its inference errors stay in the shard's own file. Reads this
    shard only, so the work spreads over the workers the way the shards do, and a Clear of one shard's filter
    redoes that shard alone. Done again each time it runs (the word lists may have changed): a new
    ``generation``."""
    result = ShardResult.of(shard)
    check_shards_of_plan(plan, [result], whole=False)
    opts = layout.output_root.options
    out_dir = layout.shard_dir(result.shard, "filter")
    skipped = f"task {cfg.engine.task}" if cfg.engine.task != "generate" else None  # vectors, classes: no words
    # the lists load first: a missing one fails before a file is read or written
    lists = ContentFilter(cfg.filter, opts) if cfg.filter.enabled and skipped is None else None
    source = _fingerprint(result.outputs, opts)
    rows = iter_jsonl(Location(result.outputs, opts).path())
    if lists is not None:
        reviewed = None
        if review_active(cfg):
            if review is None:
                raise ValueError(_NO_REVIEWS)
            reviewed = _reviewed_rows(cfg, layout, [result], [review])
        dropped_loc = out_dir.child("dropped.jsonl")
        with atomic_writer(dropped_loc.path()) as dropped:
            kept = FilteredRows(rows, cfg.filter, opts, dropped=dropped, review=reviewed[0] if reviewed else None,
                                lists=lists)
            n_kept = write_jsonl(out_dir.child("outputs.jsonl").path(), kept)
        summary = kept.summary(dropped=dropped_loc.url)
        if reviewed:
            summary.review = reviewed[0].summary(reviewed[1])
        outputs = out_dir.child("outputs.jsonl").url
    else:  # nothing to change in a row: the part is the shard's own file, not a copy of it
        outputs = result.outputs
        n_kept = _lines(outputs, opts)
        summary = FilterSummary(enabled=False, rows_scanned=n_kept)
    part = FilterPart(shard=result.shard, outputs=outputs, rows=n_kept, inference_errors=result.errors,
                      inference_error_rows=_lines(result.errors, opts), summary=summary, skipped=skipped,
                      plan_key=result.plan_key, source=source)
    if cfg.output.parts and cfg.output.table is None:
        part = publish_part(cfg, layout, plan, part)
    part.write(out_dir.path())
    return part


def _lines(url: str, opts: dict) -> int:
    """The rows of a JSON-lines file, counted as it is (the rows a part lists are the rows its files hold)."""
    n = 0
    with Location(url, opts).path().open("rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
    return n


def _fingerprint(url: str, opts: dict) -> str:
    from batch_llm.io.identity import file_fingerprint, stable_hash

    return stable_hash(file_fingerprint(Location(url, opts).path()))[:16]


def join_filter(cfg: PipelineConfig, layout: RunLayout, plan: PlanManifest,
                shards: Sequence[ShardResult | ShardManifest | dict | list],
                parts: Sequence[FilterPart | dict | list]) -> FilterManifest:
    """The filter pass of the run: the shards' parts (``filter_shard``) joined by their counts, no row read.
    Refuses shards made for another plan, and parts missing or made from other shard outputs than the shards'
    now (a shard run again after its filter), naming the shards to clear. Each join is a new ``generation``,
    which evaluate and publish go by."""
    results = flat_results(shards)
    check_shards_of_plan(plan, results)
    opts = layout.output_root.options
    got = {p.shard: p for p in _flat_parts(parts)}
    missing = [r.shard for r in results if r.shard not in got]
    stale = [r.shard for r in results if r.shard in got and got[r.shard].source != _fingerprint(r.outputs, opts)]
    if missing or stale:
        raise ValueError(f"the content filter's parts do not match the shards: not filtered {missing or 'none'}, "
                         f"filtered from other outputs {stale or 'none'}; clear filter_shard with its downstream "
                         f"tasks for those shards")
    ordered = [got[r.shard] for r in sorted(results, key=lambda r: r.shard)]
    skipped = next((p.skipped for p in ordered if p.skipped), None)
    m = FilterManifest(rows=sum(p.rows for p in ordered), plan_key=plan.input_key,
                       inference_error_rows=sum(p.inference_error_rows for p in ordered),
                       summary=joined_summary([p.summary for p in ordered]), skipped=skipped,
                       parts=[p.ref() for p in ordered])
    m.write(layout.stage("filter").path())
    return m


def _flat_parts(parts: Sequence[FilterPart | dict | list]) -> list[FilterPart]:
    """Parts as XCom hands them over (one per task, or a list per task of several shards)."""
    return [p if isinstance(p, FilterPart) else FilterPart.model_validate(p)
            for t in parts for p in (t if isinstance(t, (list, tuple)) else [t])]


def joined_summary(summaries: list[FilterSummary]) -> FilterSummary:
    """The run's filter summary from its shards' (in shard order): counts added, the first dropped ids kept."""
    if not summaries:
        return FilterSummary()
    per_list: Counter = Counter()
    per_word: dict[str, Counter] = defaultdict(Counter)
    ids: list[str] = []
    for s in summaries:
        per_list.update(s.hits_per_list)
        for name, words in s.hits_per_word.items():
            per_word[name].update(words)
        ids.extend(s.dropped_ids[:DROPPED_IDS_SHOWN - len(ids)])
    first = summaries[0]
    out = FilterSummary(
        enabled=first.enabled, rows_scanned=sum(s.rows_scanned for s in summaries),
        rows_affected=sum(s.rows_affected for s in summaries), rows_dropped=sum(s.rows_dropped for s in summaries),
        rows_flagged=sum(s.rows_flagged for s in summaries), rows_masked=sum(s.rows_masked for s in summaries),
        hits_per_list=dict(per_list), hits_per_word={k: dict(v) for k, v in per_word.items()}, dropped_ids=ids,
        lists=first.lists)
    reviews = [s.review for s in summaries if s.review is not None]
    if reviews:
        out.review = _joined_review(reviews)
    return out


def _joined_review(reviews: list[ReviewSummary]) -> ReviewSummary:
    def added(field: str) -> dict:
        total: Counter = Counter()
        for r in reviews:
            total.update(getattr(r, field))
        return dict(total)

    counts = {k: sum(getattr(r, k) for r in reviews) for k in (
        "rows_reviewed", "rows_flagged", "rows_masked", "rows_dropped", "requests", "cached_requests",
        "input_tokens", "output_tokens")}
    return ReviewSummary(model=reviews[0].model, task=reviews[0].task, verdicts=added("verdicts"),
                         categories=added("categories"), shards=[i for r in reviews for i in r.shards], **counts)


def _reviewed_rows(cfg: PipelineConfig, layout: RunLayout, shards: list[ShardResult],
                   reviews: Sequence | None) -> tuple[ReviewedRows, list[ShardResult]] | None:
    """The review's verdicts to join (``filter.review``), checked against the shards; None without a review."""
    if not review_active(cfg):
        return None
    assert cfg.filter.review is not None
    if reviews is None:
        raise ValueError("filter.review is set but no review results were handed to the content filter; run the "
                         "review of every shard first (the review task)")
    opts = layout.output_root.options
    results = flat_results(reviews)
    check_reviews(cfg, shards, results, opts)
    model = ""
    fetched = layout.review_model.path()
    if exists(fetched / "manifest.json"):
        model = FetchManifest.read(fetched).model_key
    return (ReviewedRows(cfg.filter.review, review_verdict_rows(results, opts), cfg.filter.mask_char, model),
            results)


def check_shards_of_plan(plan: PlanManifest, shards: list[ShardResult], *, whole: bool = True) -> None:
    """Every planned shard committed (``whole``; else only these), for this plan (a plan made again after its
    shards ran has other rows)."""
    got = {s.shard: s for s in shards}
    missing = [s.index for s in plan.shards if s.index not in got] if whole else []
    planned = {s.index: s.plan_key for s in plan.shards}  # a plan in parts keys each part's shards apart
    stale = [s.shard for s in shards if s.plan_key and planned.get(s.shard) and s.plan_key != planned[s.shard]]
    if missing or stale:
        raise ValueError(f"the shards handed over do not match the run's plan ({len(plan.shards)} shards): "
                         f"missing {missing or 'none'}, made for another plan {stale or 'none'}; clear the plan "
                         f"task with its downstream tasks so that every shard runs on the current plan")
