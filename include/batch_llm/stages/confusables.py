"""Look-alike folding for the word lists (``filter.lists[].fold``): what a reader reads as a listed word, spelled
to get past the list, matches it.

``confusables``: every character becomes its Unicode TR39 skeleton (a Cyrillic ``а`` in ``bаdword`` is the Latin
``a``; ``ο`` Greek omicron is ``o``; the small capitals ``ᴄᴀꜱɪɴᴏ`` are ``casino``), and the combining accents
(U+0300–U+036F and the other combining-diacritics blocks) are dropped (``bádword``, ``b̶a̶d̶``). ASCII is left as
it is: TR39 reads ``m`` as ``rn`` and ``0`` as ``O``, so English words would match other English words. The
skeletons are ICU's, with the Latin small capitals TR39 leaves out (``data/confusables.tsv``, written by
``scripts/confusables_table.py``).

``separators``: a run of separators of any length and kind between two letters or digits is dropped: spaces,
tabs, line breaks, dashes, underscores, dots, symbols (``傻 逼``, ``赌\n博``, ``b  a  d``, ``ca-sino``,
``s.h.i.t``); zero-width characters are gone already (``fold_text``). Clause and sentence punctuation
(``，！？；：``, CJK punctuation) is not a separator. Where one was dropped, the word boundary it made still
counts for the whole-word rule: ``as sign`` holds ``assign``, but ``class`` still does not hold ``ass`` and
``this hit`` does not hold ``shit``.

``han_variants``: each traditional Chinese character reads as its simplified form (``賭博`` is ``赌博``), by the
character table of MediaWiki's zh-Hans conversion (``data/han_variants.tsv``, written by
``scripts/han_variants_table.py`` from the ``zhconv`` package's table; characters only, no phrases).

They apply to the text as ``content_filter.fold_text`` folded it, and keep its map back to the original: hits,
offsets and masks stay in the original text. Their cost in false positives on the shipped sample data is in
docs/user-guide.md ("Content filter").
"""
from __future__ import annotations

import functools
import re
import unicodedata
from importlib import resources

FOLDS = ("confusables", "han_variants", "separators")

# The combining-diacritics blocks: the accents a look-alike spelling puts on a letter (marks of other scripts,
# vowel signs of Indic scripts and Thai, carry meaning and stay)
_ACCENTS = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]")

# One separator: whitespace of every kind (line breaks too), connectors, dashes, the other punctuation but what
# ends a sentence or a clause (ASCII after NFKC: a full-width comma is ","), and symbols
_SEP_CHARS = r"[\s_\-.*/\\|+~^=#@&%$`'\"·•・‧∙⋅◦°×÷]"
# A run of them between two letters or digits (CJK characters are letters to \w), the first perhaps under
# accents (``c̴ a̴ s̴``)
_INNER = re.compile(rf"(?<=[^\W_]|{_ACCENTS.pattern}){_SEP_CHARS}+(?=[^\W_])")


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


@functools.cache
def han_variants() -> dict[str, str]:
    """The shipped traditional -> simplified character table."""
    text = resources.files("batch_llm").joinpath("data", "han_variants.tsv").read_text(encoding="utf-8")
    return dict(line.split("\t") for line in text.splitlines() if line and not line.startswith("#"))


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


def fold_pieces(text: str, folds: tuple[str, ...], casefold: bool) -> tuple[list[str], list[tuple[int, int]]] | None:
    """Each character of ``text`` (already folded by ``fold_text``) as the folds make it (``""``: dropped), and
    the runs of separators the separators fold dropped (start, end); None when the folds change nothing (the
    common case for the character folds: ASCII text)."""
    pieces: list[str] | None = None
    if "confusables" in folds and not text.isascii():
        table = _fold_table(casefold)
        pieces = [table[c] for c in text]
        if all(p == c for p, c in zip(pieces, text)):
            pieces = None
    if "han_variants" in folds and not text.isascii():
        variants = han_variants()
        src = pieces if pieces is not None else list(text)
        mapped = ["".join(variants.get(c, c) for c in p) for p in src]
        if mapped != src:
            pieces = mapped
    runs: list[tuple[int, int]] = []
    if "separators" in folds:
        for m in _INNER.finditer(text):
            pieces = pieces if pieces is not None else list(text)
            pieces[m.start():m.end()] = [""] * (m.end() - m.start())
            runs.append(m.span())
    return None if pieces is None else (pieces, runs)
