"""Look-alike spellings of a listed word (``filter.lists[].fold``, ``stages/confusables.py``).

A space inside a Chinese word, letters spaced out, a look-alike letter from another script and a combining
accent each walked past the word lists. With the list's ``fold`` they match, the hit and the mask in the original
text; without it the list matches as before; and the folds cost no extra hits on the shipped sample data (the
figure docs/user-guide.md gives).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from batch_llm.config import FilterConfig, WordListConfig
from batch_llm.stages.confusables import skeleton
from batch_llm.stages.content_filter import ContentFilter

ROOT = Path(__file__).resolve().parents[2]


def _filter(tmp_path, words: list[str], fold: list[str], action: str = "mask") -> ContentFilter:
    path = tmp_path / "words.txt"
    path.write_text("\n".join(words) + "\n", encoding="utf-8")
    return ContentFilter(FilterConfig(lists=[WordListConfig(name="w", path=str(path), action=action, fold=fold)]))


def _masked(f: ContentFilter, text: str) -> str | None:
    out, hits = f.apply({"id": "r", "idx": 0, "output": text})
    return out["output"] if hits else None


@pytest.mark.parametrize("text, expected", [
    ("a b\u0430dword here", "a ******* here"),       # Cyrillic а inside an English word
    ("B\u0410DWORD!", "*******!"),                    # Cyrillic capital А, upper case
    ("\u0455\u04bb\u0456t", "****"),                  # Cyrillic ѕ, һ, і: every letter a look-alike
    ("b\u00e1dword", "*******"),                      # a precomposed accent
    ("ba\u0301dword", "********"),                    # a combining accent: masked with its letter
])
def test_confusables_fold_matches_look_alike_letters_and_accents(tmp_path, text, expected):
    assert _masked(_filter(tmp_path, ["badword", "shit"], []), text) is None  # today's lists let them through
    assert _masked(_filter(tmp_path, ["badword", "shit"], ["confusables"]), text) == expected


@pytest.mark.parametrize("text, expected", [
    ("\u50bb \u903c", "***"),                         # a space inside a Chinese word
    ("\u50bb*\u903c\u554a", "***\u554a"),             # a symbol inside it
    ("\u50bb_-_\u903c", "*****"),                     # a run of separators
    ("b a d w o r d!", "*************!"),             # spaced-out letters
    ("b.a.d.w.o.r.d", "*************"),
    ("s h i t happens", "******* happens"),
])
def test_separators_fold_matches_words_split_by_separators(tmp_path, text, expected):
    words = ["badword", "shit", "\u50bb\u903c"]
    assert _masked(_filter(tmp_path, words, []), text) is None
    assert _masked(_filter(tmp_path, words, ["separators"]), text) == expected


@pytest.mark.parametrize("text", [
    "\u6211\u5f88\u50bb\u3002\u903c\u8feb",          # a sentence ends between the two characters: 。
    "\u6211\u5f88\u50bb\uff0c\u903c\u8feb",          # a full-width comma (NFKC: ",")
])
def test_separators_do_not_join_across_sentences(tmp_path, text):
    assert _masked(_filter(tmp_path, ["\u50bb\u903c"], ["separators", "confusables"]), text) is None


def test_ascii_is_left_as_it_is(tmp_path):
    # TR39 reads "m" as "rn" and "0" as "O"; the fold leaves ASCII alone so English words keep to themselves
    f = _filter(tmp_path, ["rnodern", "ok"], ["confusables"])
    assert _masked(f, "a modern house") is None and _masked(f, "0k then") is None
    assert skeleton("\u0430") == "a" and skeleton("\u03bf") == "o" and skeleton("\u00e1") == "a"


def test_folds_apply_per_list(tmp_path):
    plain, folded = tmp_path / "plain.txt", tmp_path / "folded.txt"
    plain.write_text("badword\n", encoding="utf-8")
    folded.write_text("shit\n", encoding="utf-8")
    f = ContentFilter(FilterConfig(lists=[WordListConfig(name="plain", path=str(plain), action="drop"),
                                          WordListConfig(name="folded", path=str(folded), action="mask",
                                                         fold=["confusables", "separators"])]))
    out, hits = f.apply({"id": "r", "idx": 0, "output": "b\u0430dword and s h \u0456 t"})
    assert out is not None and [h["list"] for h in hits] == ["folded"]  # the drop list did not fold
    assert out["output"] == "b\u0430dword and *******"


def test_listed_words_fold_too(tmp_path):
    # a list written with a look-alike or a separator matches the plain spelling
    f = _filter(tmp_path, ["b\u0430dword", "\u50bb \u903c"], ["confusables", "separators"])
    assert _masked(f, "badword") == "*******" and _masked(f, "\u50bb\u903c") == "**"


def _sample_texts() -> list[str]:
    def strings(v):
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            for x in v.values():
                yield from strings(x)
        elif isinstance(v, list):
            for x in v:
                yield from strings(x)

    texts = []
    for path in sorted((ROOT / "include" / "sample_data").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                texts += list(strings(json.loads(line)))
            except ValueError:
                continue
    return texts


def test_false_positive_cost_on_the_sample_data():
    """docs/user-guide.md's figure: the shipped lists and the demo's watchlist find the same hits in the sample
    data with each fold and each word-form match as without (the folds change the folded text of some rows, no
    hit)."""
    texts = _sample_texts()
    lists = [("en", "builtin:en"), ("zh", "builtin:zh"),
             ("watchlist", str(ROOT / "dags" / "pipelines" / "wordlists" / "demo_watchlist.txt"))]

    def hits(fold: list[str], match: str = "word") -> list[tuple[str, str]]:
        f = ContentFilter(FilterConfig(lists=[WordListConfig(name=n, path=p, action="flag", fold=fold, match=match)
                                              for n, p in lists]))
        return [(h[0].cfg.name, h[3]) for t in texts for h in f.scan(t)]

    plain = hits([])
    assert len(texts) == 97 and len(plain) == 2
    for fold in (["confusables"], ["separators"], ["han_variants"], ["confusables", "separators"],
                 ["confusables", "han_variants", "separators"]):
        assert hits(fold) == plain, fold
    for match in ("prefix", "stem"):
        assert hits([], match) == plain, match
        assert hits(["confusables", "han_variants", "separators"], match) == plain, match
