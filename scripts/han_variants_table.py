"""Writes include/batch_llm/data/han_variants.tsv: each traditional Chinese character and its simplified form, as the
content filter's ``fold: [han_variants]`` reads it (``stages/confusables.py``).

    .venv/bin/python scripts/han_variants_table.py          # needs the zhconv package (in the project's lock)

The mapping is the character table of MediaWiki's zh-Hans conversion as the ``zhconv`` package ships it
(``zhcdict.json``, ``zh2Hans``): its one-character entries only (phrases are left out: the fold maps character by
character, so a text keeps its length and its offsets) and of Chinese characters only, the same character-level mapping OpenCC's
``TSCharacters`` gives. The project needs no zhconv at run time: the table is shipped. One line per character:
the traditional character and its simplified form, separated by a tab. The file's first line names the source.
"""
from __future__ import annotations

import json
import sys
import unicodedata
from importlib import metadata, resources
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "include" / "batch_llm" / "data" / "han_variants.tsv"


def _han(c: str) -> bool:
    """A Chinese character (the table also turns corner brackets into quotes: punctuation is no word's part)."""
    return unicodedata.name(c, "").startswith("CJK ") and "IDEOGRAPH" in unicodedata.name(c, "")


def table_text() -> str:
    """The table's file as this script writes it."""
    try:
        table = json.loads(resources.files("zhconv").joinpath("zhcdict.json").read_text(encoding="utf-8"))
    except ModuleNotFoundError:
        sys.exit("the zhconv package is not installed (it is in requirements.lock)")
    pairs = sorted((k, v) for k, v in table["zh2Hans"].items()
                   if len(k) == 1 and len(v) == 1 and k != v and _han(k) and _han(v))
    return (f"# Traditional -> simplified Chinese characters, zhconv {metadata.version('zhconv')} zh2Hans "
            "(MediaWiki's conversion table; scripts/han_variants_table.py)\n"
            + "".join(f"{k}\t{v}\n" for k, v in pairs))


def main() -> int:
    text = table_text()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    print(f"{OUT}: {text.count(chr(10)) - 1} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
