"""Writes include/batch_llm/data/confusables.tsv: the Unicode TR39 skeleton of every character that has one other
than itself, as the content filter's ``fold: [confusables]`` reads it (``stages/content_filter.py``).

    .venv/bin/python scripts/confusables_table.py          # needs the ICU library (Debian: libicu72)

The skeletons come from ICU's spoof checker (``uspoof_getSkeleton``, Unicode's confusables.txt as that ICU
ships it), called through ctypes, so the project needs no ICU at run time: the table is shipped. One line per
character: its code point and its skeleton's code points, hexadecimal. Left out: ASCII (the filter keeps it as it
is), characters NFKC changes (texts are NFKC-folded before the skeleton step), characters with a canonical
decomposition (the skeleton of one is that of its decomposition's characters, so the filter derives it) and
characters that are their own skeleton. The file's first line names the ICU version it came from.

A second source fills in Latin letters that TR39 leaves as themselves though a reader reads them as the letter:
by their Unicode names (``LOOK_ALIKE_NAMES``), the small capitals (``ᴄᴀꜱɪɴᴏ``), the negative circled and squared
capitals (``🅒``, ``🅲``) and the regional indicator letters (``🇨``), each as its small Latin letter.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import re
import sys
import unicodedata
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "include" / "batch_llm" / "data" / "confusables.tsv"


def _icu() -> tuple[ctypes.CDLL, str]:
    """The ICU i18n library and its symbol suffix (``_72``: ICU versions its C symbols)."""
    paths = sorted(glob.glob("/usr/lib/*/libicui18n.so.*") + glob.glob("/usr/lib/libicui18n.so.*"))
    name = ctypes.util.find_library("icui18n") or (paths[0] if paths else None)
    if not name:
        sys.exit("ICU's libicui18n is not installed (Debian: apt-get install libicu72)")
    lib = ctypes.CDLL(name)
    for major in range(90, 49, -1):
        if hasattr(lib, f"uspoof_open_{major}"):
            return lib, f"_{major}"
    if hasattr(lib, "uspoof_open"):
        return lib, ""
    sys.exit(f"{name}: no uspoof_open symbol")


# Unicode names of characters read as the Latin letter they name (NFKC leaves them): small capitals, negative
# circled and squared capitals, regional indicators
LOOK_ALIKE_NAMES = re.compile(r"LATIN LETTER SMALL CAPITAL ([A-Z])|NEGATIVE (?:CIRCLED|SQUARED) LATIN CAPITAL "
                              r"LETTER ([A-Z])|REGIONAL INDICATOR SYMBOL LETTER ([A-Z])")


def look_alikes_by_name(done: set[int]) -> list[str]:
    """Table lines for the characters ``LOOK_ALIKE_NAMES`` names that are not in ``done`` (their own skeleton)."""
    lines = []
    for cp in range(0x80, 0x110000):
        m = LOOK_ALIKE_NAMES.fullmatch(unicodedata.name(chr(cp), ""))
        if m and cp not in done and unicodedata.normalize("NFKC", chr(cp)) == chr(cp):
            lines.append(f"{cp:04X}\t{ord(next(g for g in m.groups() if g).lower()):04X}")
    return lines


def main() -> int:
    lib, suffix = _icu()
    status = ctypes.c_int(0)
    open_ = getattr(lib, "uspoof_open" + suffix)
    open_.restype = ctypes.c_void_p
    checker = open_(ctypes.byref(status))
    if status.value > 0:
        sys.exit(f"uspoof_open failed: ICU error {status.value}")
    skeleton_of = getattr(lib, "uspoof_getSkeleton" + suffix)
    skeleton_of.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                            ctypes.c_int32, ctypes.POINTER(ctypes.c_int)]
    skeleton_of.restype = ctypes.c_int32
    dest = ctypes.create_string_buffer(256)
    lines = []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        # ASCII is left as it is (``m`` is ``rn``, ``0`` is ``O`` there: English words would match others); a
        # character NFKC changes never reaches the skeleton step (texts are NFKC-folded first); unassigned ones
        # and one with a canonical decomposition (a skeleton is that of its decomposition's characters: Hangul
        # syllables, accented letters)
        if cp < 0x80 or unicodedata.normalize("NFKC", c) != c or unicodedata.normalize("NFD", c) != c \
                or unicodedata.category(c) == "Cn":
            continue
        src = c.encode("utf-16-le")
        status.value = 0
        n = skeleton_of(checker, 0, src, len(src) // 2, dest, 128, ctypes.byref(status))
        if status.value > 0:
            continue
        skeleton = dest.raw[:2 * n].decode("utf-16-le")
        if skeleton != unicodedata.normalize("NFD", c):
            lines.append(f"{cp:04X}\t{' '.join(f'{ord(s):04X}' for s in skeleton)}")
    lines = sorted(lines + look_alikes_by_name({int(line.split("\t")[0], 16) for line in lines}),
                   key=lambda line: int(line.split("\t")[0], 16))
    version = re.sub(r"^_", "", suffix) or "unknown"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(f"# Unicode TR39 skeletons from ICU {version} and look-alikes by name (scripts/confusables_table.py); "
                   "code point\tskeleton\n"
                   + "\n".join(lines) + "\n", encoding="utf-8")
    print(f"{OUT}: {len(lines)} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
