"""Look-alike folding for the word lists (``filter.lists[].fold``): what a reader reads as a listed word, spelled
to get past the list, matches it.

``confusables``: every character becomes its Unicode TR39 skeleton (a Cyrillic ``а`` in ``bаdword`` is the Latin
``a``; ``ο`` Greek omicron is ``o``), and the combining accents (U+0300–U+036F and the other combining-diacritics
blocks) are dropped (``bádword``, ``b̶a̶d̶``). ASCII is left as it is: TR39 reads ``m`` as ``rn`` and ``0`` as ``O``,
so English words would match other English words. The skeletons are ICU's (``data/confusables.tsv``, written by
``scripts/confusables_table.py``).

``separators``: separators inside a CJK word (``傻 逼``, ``傻*逼``, ``傻_逼``: a run of up to three spaces,
dashes, dots, symbols between two CJK characters, not ``，！？；：`` nor CJK punctuation, which end a sentence) and
between spaced-out letters (``b a d w o r d``, ``b.a.d``: three or more single letters, one separator between
each) are dropped.

Both apply to the text as ``content_filter.fold_text`` folded it, and keep its map back to the original: hits,
offsets and masks stay in the original text. Their cost in false positives on the shipped sample data is in
docs/user-guide.md ("Content filter").
"""
from __future__ import annotations

import functools
import re
import unicodedata
from importlib import resources

FOLDS = ("confusables", "separators")

# The combining-diacritics blocks: the accents a look-alike spelling puts on a letter (marks of other scripts,
# vowel signs of Indic scripts and Thai, carry meaning and stay)
_ACCENTS = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]")

_CJK = "\u2e80-\u2fdf\u3040-\u30ff\u3100-\u312f\u31a0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff" \
       "\U00020000-\U0003134f"
# One separator: whitespace but line breaks, connectors, dashes, the other punctuation but what ends a sentence or
# a clause (ASCII after NFKC: a full-width comma is ","), and symbols
_SEP_CHARS = r"[^\S\n\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]|[_\-.*/\\|+~^=#@&%$`'\"·•・‧∙⋅◦°×÷]"
_CJK_INNER = re.compile(f"(?<=[{_CJK}])(?:{_SEP_CHARS}){{1,3}}(?=[{_CJK}])")
_SPACED = re.compile(rf"(?<!\w)(?:[^\W\d_](?:{_SEP_CHARS})){{2,}}[^\W\d_](?!\w)")
_SEP = re.compile(_SEP_CHARS)


@functools.cache
def _skeleton_table() -> dict[str, str]:
    """The shipped TR39 skeletons: character -> skeleton (characters without a canonical decomposition)."""
    text = resources.files("batch_llm").joinpath("data", "confusables.tsv").read_text(encoding="utf-8")
    table = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            cp, skeleton = line.split("\t")
            table[chr(int(cp, 16))] = "".join(chr(int(x, 16)) for x in skeleton.split())
    return table


def skeleton(c: str) -> str:
    """TR39's skeleton of one character (NFD, each character's prototype, NFD again), its accents dropped."""
    table = _skeleton_table()
    mapped = "".join(table.get(d, d) for d in unicodedata.normalize("NFD", c))
    return _ACCENTS.sub("", unicodedata.normalize("NFD", mapped))


class _SkeletonFold(dict):
    """Each folded character's look-alike form, computed once; case-folded and NFKC-composed again as
    ``content_filter.fold_text`` folds (a skeleton may be an upper-case letter: ``Α`` is ``A``)."""

    def __init__(self, casefold: bool):
        super().__init__()
        self.casefold = casefold

    def __missing__(self, c: str) -> str:
        if len(self) >= 1 << 16:  # bounded whatever the texts hold
            self.clear()
        value = skeleton(c) if not c.isascii() else c
        value = self[c] = unicodedata.normalize("NFKC", value.casefold() if self.casefold else value)
        return value


@functools.cache
def _fold_table(casefold: bool) -> _SkeletonFold:
    return _SkeletonFold(casefold)


def _separator_positions(text: str) -> set[int]:
    """Where the separators inside a CJK word or between spaced-out letters are."""
    drop: set[int] = set()
    for m in _CJK_INNER.finditer(text):
        drop.update(range(m.start(), m.end()))
    for m in _SPACED.finditer(text):
        drop.update(m.start() + i.start() for i in _SEP.finditer(m.group()))
    return drop


def fold_pieces(text: str, folds: tuple[str, ...], casefold: bool) -> list[str] | None:
    """Each character of ``text`` (already folded by ``fold_text``) as the folds make it (``""``: dropped), or
    None when they change nothing (the common case: ASCII text without spaced-out letters)."""
    pieces: list[str] | None = None
    if "confusables" in folds and not text.isascii():
        table = _fold_table(casefold)
        pieces = [table[c] for c in text]
        if all(p == c for p, c in zip(pieces, text)):
            pieces = None
    if "separators" in folds:
        drop = _separator_positions(text)
        if drop:
            pieces = pieces if pieces is not None else list(text)
            for i in drop:
                pieces[i] = ""
    return pieces
