"""With a list's folds on, the spellings a reader still reads as a listed word match it: separators of any width and
kind between its letters (two spaces, tabs, a line break inside a Chinese word, ``ca-sino``), small capitals and
other look-alike letters, traditional characters for a simplified list (``han_variants``, opted into), and, with
``match: prefix`` / ``stem``, the word's forms (``casinos``, ``casino_bonus``). Each hit masks exactly the
original characters it came from; the whole-word rule still keeps ``ass`` out of ``class`` and ``shit`` out of
``this hit``."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from batch_llm.config import FilterConfig, WordListConfig
from batch_llm.stages.content_filter import ContentFilter

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["casino", "\u8d4c\u535a", "shit", "ass", "assign"]  # 赌博: simplified
BOTH = ["confusables", "separators"]


def _filter(tmp_path, fold: list[str], match: str = "word", words: list[str] = WORDS) -> ContentFilter:
    path = tmp_path / "words.txt"
    path.write_text("\n".join(words) + "\n", encoding="utf-8")
    return ContentFilter(FilterConfig(lists=[WordListConfig(name="w", path=str(path), action="mask", fold=fold,
                                                            match=match)]))


def _masked(f: ContentFilter, text: str) -> str | None:
    out, hits = f.apply({"id": "r", "idx": 0, "output": text})
    assert out is not None
    return out["output"] if hits else None


@pytest.mark.parametrize("text, expected", [
    ("c  a  s  i  n  o!", "****************!"),           # two spaces between letters
    ("c \t a \t s \t i \t n \t o now", "********************* now"),  # tabs and spaces
    ("play ca-sino games", "play ******* games"),         # a hyphen inside the word
    ("ca__sino", "********"),                             # underscores
    ("ca\u200b-\u200bsino", "*********"),                 # zero-width characters around a hyphen
    ("\u8d4c\n\u535a\u7f51\u7ad9", "***\u7f51\u7ad9"),    # a line break inside a Chinese word
    ("\u8d4c \t \t \u535a", "*******"),                   # a run of spaces and tabs inside it
    ("c\u0334 a\u0334 s\u0334 i\u0334 n\u0334 o\u0334", "*" * 17),  # struck-through letters spaced out
    ("a s s i g n", "***********"),                       # the longer word's hit covers it all
])
def test_separators_of_any_width_and_kind_between_letters(tmp_path, text, expected):
    assert _masked(_filter(tmp_path, []), text) is None
    assert _masked(_filter(tmp_path, BOTH), text) == expected


@pytest.mark.parametrize("text", [
    "the class is open",                  # ass inside a word
    "this hit the news",                  # shit across two words: "this" ends in s, no word starts there
    "\u6211\u5f88\u8d4c\u3002\u535a\u58eb",   # a sentence ends between the two characters
])
def test_separators_keep_word_boundaries(tmp_path, text):
    assert _masked(_filter(tmp_path, BOTH), text) is None


def test_small_capitals_read_as_their_letters(tmp_path):
    text = "go to the \u1d04\u1d00\ua731\u026a\u0274\u1d0f now"  # ᴄᴀꜱɪɴᴏ
    assert _masked(_filter(tmp_path, []), text) is None
    assert _masked(_filter(tmp_path, ["confusables"]), text) == "go to the ****** now"
    # negative squared capitals and regional indicators too: 🅲🅰🆂🅸🅽🅾
    squared = "\U0001f172\U0001f170\U0001f182\U0001f178\U0001f17d\U0001f17e"
    assert _masked(_filter(tmp_path, ["confusables"]), squared) == "******"


def test_traditional_characters_match_a_simplified_list_when_the_list_opts_in(tmp_path):
    text = "\u6b61\u8fce\u8ced\u535a\u7db2\u7ad9"  # 歡迎賭博網站: 賭 is traditional for 赌
    assert _masked(_filter(tmp_path, BOTH), text) is None  # not without han_variants
    assert _masked(_filter(tmp_path, ["han_variants"]), text) == "\u6b61\u8fce**\u7db2\u7ad9"
    # a list written in traditional characters matches simplified text
    trad = _filter(tmp_path, ["han_variants"], words=["\u8ced\u535a"])
    assert _masked(trad, "\u8d4c\u535a") == "**"


@pytest.mark.parametrize("match, text, expected", [
    ("stem", "two casinos here", "two ******* here"),
    ("stem", "casino_bonus", "******_bonus"),
    ("stem", "the casinoes", "the ********"),
    ("stem", "casinobonus", None),                         # a longer word, no ending of English
    ("prefix", "two casinos here", "two ******* here"),    # the mask covers the word form
    ("prefix", "casinobonus now", "*********** now"),
    ("prefix", "casino_bonus", "******_bonus"),
    ("prefix", "acasino", None),                           # the word still starts the hit
])
def test_a_list_may_match_word_forms(tmp_path, match, text, expected):
    assert _masked(_filter(tmp_path, []), text) is None
    assert _masked(_filter(tmp_path, [], match), text) == expected


def test_word_forms_with_separators(tmp_path):
    # the separators fold's dropped separator ends a word form: "casino s" is casino and a word "s"
    f = _filter(tmp_path, BOTH, "stem")
    assert _masked(f, "ca-sinos tonight") == "******** tonight"
    assert _masked(f, "ca sino bonus") == "******* bonus"


def test_a_word_form_is_bounded(tmp_path):
    """A prefix hit takes at most 32 letters after the word: a long run costs one short look per hit."""
    text = "casino" + "x" * 100
    assert _masked(_filter(tmp_path, [], "prefix"), text) == "*" * 38 + "x" * 68


def test_word_forms_under_case_sensitive_matching(tmp_path):
    """A case-sensitive list's word forms take an ending in any case, the listed word in its own."""
    path = tmp_path / "words.txt"
    path.write_text("Casino\n", encoding="utf-8")
    f = ContentFilter(FilterConfig(case_sensitive=True, lists=[WordListConfig(name="w", path=str(path),
                                                                              match="stem")]))
    assert _masked(f, "CASINOS and CasinoS") == "CASINOS and *******"


def test_the_shipped_han_variants_table_is_what_its_script_writes():
    """data/han_variants.tsv follows scripts/han_variants_table.py and the zhconv table it reads."""
    spec = importlib.util.spec_from_file_location("han_variants_table", ROOT / "scripts" / "han_variants_table.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert (ROOT / "include" / "batch_llm" / "data" / "han_variants.tsv").read_text(encoding="utf-8") == \
        script.table_text()
