"""The content filter matches words as a reader sees them, not as their code points happen to be spelled.

Lower-casing ``İ`` gives two characters, and the filter then scanned the whole row
case-sensitively, so one ``İ`` anywhere let ``BADWORD`` through a drop list. Full-width letters, ``ß`` for
``ss``, zero-width characters between letters and decomposed accents were further ways past a list. These tests
pin the folded matching (NFKC, case folding, invisible characters dropped) and that hits, offsets and masks
stay in the original text, the text around a hit byte-for-byte the same.
"""
from __future__ import annotations

import io
import json

import pytest
from batch_llm.config import FilterConfig, WordListConfig
from batch_llm.stages.content_filter import ContentFilter, filter_rows

# Invisible characters between letters: zero-width space, non-joiner, joiner, word joiner, BOM, soft hyphen,
# invisible times (another Cf), Mongolian vowel separator (Cf) and a variation selector (not Cf, but invisible).
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u2062", "\u180e", "\ufe0f"]


def _filter(tmp_path, words: list[str], action: str = "mask", **cfg) -> ContentFilter:
    path = tmp_path / f"{action}.txt"
    path.write_text("\n".join(words) + "\n", encoding="utf-8")
    return ContentFilter(FilterConfig(lists=[WordListConfig(name="w", path=str(path), action=action)], **cfg))


def _hit_texts(f: ContentFilter, text: str) -> list[str]:
    """The original characters of each hit."""
    return [text[start:end] for _, start, end, _ in f.scan(text)]


def test_dotted_capital_i_elsewhere_does_not_turn_off_case_folding(tmp_path):
    drop = _filter(tmp_path, ["badword"], "drop")
    row = {"id": "r1", "output": "İstanbul: BADWORD"}
    assert drop.apply(row)[0] is None
    assert drop.apply({"id": "r2", "output": "İ and BadWord"})[0] is None
    # The dotted capital reads as its letter: "SHİT" is "shit".
    shit = _filter(tmp_path, ["shit"])
    assert _hit_texts(shit, "oh SHİT.") == ["SHİT"]
    assert _hit_texts(shit, "oh SHI\u0307T.") == ["SHI\u0307T"]  # the same İ, spelled I + combining dot


def test_dotted_capital_i_row_dropped_through_filter_rows(tmp_path):
    path = tmp_path / "w.txt"
    path.write_text("badword\n")
    cfg = FilterConfig(lists=[WordListConfig(name="w", path=str(path), action="drop")])
    dropped = io.BytesIO()
    kept = filter_rows([{"id": "a", "idx": 0, "output": "İ BADWORD"}, {"id": "b", "idx": 1, "output": "İ fine"}],
                       cfg, dropped=dropped)
    assert [r["id"] for r in kept] == ["b"]
    assert kept.summary().rows_dropped == 1
    (line,) = dropped.getvalue().decode().splitlines()
    assert json.loads(line)["hits"] == [{"list": "w", "word": "badword", "action": "drop", "start": 2, "end": 9}]


@pytest.mark.parametrize("listed", ["strasse", "Straße"])
def test_sharp_s_folds_to_ss(tmp_path, listed):
    f = _filter(tmp_path, [listed])
    for text in ["STRASSE", "Straße", "strasse", "STRAẞE"]:
        assert _hit_texts(f, f"die {text} hier") == [text], text
        out, hits = f.apply({"output": f"die {text} hier"})
        assert out["output"] == "die " + "*" * len(text) + " hier"
        assert hits[0]["word"] == "strasse"  # the word as folded, whichever way the list spelled it


def test_full_width_letters_match(tmp_path):
    f = _filter(tmp_path, ["badword"])
    assert _hit_texts(f, "say ＢＡＤＷＯＲＤ now") == ["ＢＡＤＷＯＲＤ"]
    assert _hit_texts(f, "say ｂａｄword now") == ["ｂａｄword"]
    # A list written in full-width letters is folded too.
    assert _hit_texts(_filter(tmp_path, ["ＢＡＤＷＯＲＤ"]), "a badword") == ["badword"]


@pytest.mark.parametrize("invisible", INVISIBLE, ids=lambda c: f"U+{ord(c):04X}")
def test_invisible_characters_between_letters_do_not_hide_a_word(tmp_path, invisible):
    f = _filter(tmp_path, ["badword", "密码"], "drop")
    assert f.apply({"output": f"x B{invisible}AD{invisible}WORD y"})[0] is None
    assert f.apply({"output": f"他的密{invisible}码是"})[0] is None


def test_mask_replaces_exactly_the_hits_original_characters(tmp_path):
    f = _filter(tmp_path, ["badword", "密码"])
    cases = {  # text: the same text masked
        "İ: BADWORD!": "İ: *******!",
        "<B\u200bADWORD>": "<********>",  # the zero-width space inside the hit is one of its characters
        "\u200bBADWORD\u200b.": "\u200b*******\u200b.",  # those around it are not
        "ＢＡＤＷＯＲＤ。ok": "*******。ok",
        "Ｂａｄｗｏｒｄ and ｂａｄ": "******* and ｂａｄ",
        "İ 他的密\u00ad码是 x": "İ 他的***是 x",
    }
    for text, masked in cases.items():
        out, hits = f.apply({"output": text})
        assert out["output"] == masked, text
        (hit,) = hits
        assert masked[hit["start"]:hit["end"]] == "*" * (hit["end"] - hit["start"])
        assert text[:hit["start"]] + text[hit["end"]:] == masked[:hit["start"]] + masked[hit["end"]:]


def test_hit_offsets_are_in_the_original_text(tmp_path):
    f = _filter(tmp_path, ["badword"])
    text = "ﬁne İ ﬁ Straße, B\u200bADWORD"
    (hit,) = f.apply({"output": text})[1]
    assert text[hit["start"]:hit["end"]] == "B\u200bADWORD"
    assert f.apply({"output": text})[0]["output"] == "ﬁne İ ﬁ Straße, ********"


def test_decomposed_accents_match_precomposed_words(tmp_path):
    f = _filter(tmp_path, ["café"])
    decomposed = "un cafe\u0301 noir"
    assert _hit_texts(f, decomposed) == ["cafe\u0301"]
    assert f.apply({"output": decomposed})[0]["output"] == "un ***** noir"  # e and its accent both masked
    assert _hit_texts(f, "UN CAFÉ") == ["CAFÉ"]
    # An unaccented listed word is not a hit on the accented letter, however it is spelled.
    assert _hit_texts(_filter(tmp_path, ["cafe"]), decomposed) == []


def test_whole_word_rule_still_holds_when_text_is_folded(tmp_path):
    f = _filter(tmp_path, ["paris", "ass"])
    # The İ used to send the row down the case-sensitive path, where "Paris" was no hit at all.
    assert _hit_texts(f, "İ: comparison, Paris, class, PARIS!") == ["Paris", "PARIS"]
    assert _hit_texts(f, "ＰＡＲＩＳ ＰＡＲＩＳｉａｎ comＰＡＲＩＳon") == ["ＰＡＲＩＳ"]
    assert _hit_texts(f, "com\u200bparison cl\u200bass pa\u200bris") == ["pa\u200bris"]
    # Words of other scripts still match anywhere, folded too.
    assert _hit_texts(_filter(tmp_path, ["密码"]), "İ 我的密码们") == ["密码"]


def test_case_sensitive_lists_still_fold_width_and_invisibles(tmp_path):
    f = _filter(tmp_path, ["BadWord"], case_sensitive=True)
    assert _hit_texts(f, "İ ＢａｄＷｏｒｄ, Bad\u200bWord, badword") == ["ＢａｄＷｏｒｄ", "Bad\u200bWord"]
