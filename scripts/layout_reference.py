"""Writes the code layout table of docs/user-guide.md (between its ``layout`` markers): every package and module
under include/ with the first sentence of its docstring, so the table lists the tree as it is.

    .venv/bin/python scripts/layout_reference.py           # rewrite the table
    .venv/bin/python scripts/layout_reference.py --check   # exit 1 when the table is out of date

``tests/unit/test_docs.py`` runs the check: a module added, moved or removed without the table following fails it.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "include"
GUIDE = ROOT / "docs" / "user-guide.md"
BEGIN, END = "<!-- layout:begin (scripts/layout_reference.py) -->", "<!-- layout:end -->"
PACKAGES = ("batch_llm", "batch_llm_airflow")


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split())
    sentences = re.findall(r".+?(?:[.:;](?=\s|$)|$)", text)
    line = sentences[0].strip() if sentences else ""
    if len(line.split()) < 4 and len(sentences) > 1:  # a title ("The doctor."): its next sentence says what
        line = f"{line.rstrip('.:;')}: {sentences[1].strip()}"
    line = line.rstrip(".:;")
    return line.replace("|", "\\|") or "(no docstring)"


def rows() -> list[tuple[str, str]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((INCLUDE / pkg).rglob("*.py"), key=lambda p: p.relative_to(INCLUDE).parts):
            rel = path.relative_to(INCLUDE)
            if "__pycache__" in rel.parts or path.name == "__main__.py":
                continue
            name = f"{rel.parent}/" if path.name == "__init__.py" else str(rel)
            out.append((name, first_sentence(path)))
    return out


def render() -> str:
    lines = [BEGIN, "", "| module | what it holds |", "| --- | --- |"]
    lines += [f"| `{name}` | {what} |" for name, what in rows()]
    return "\n".join([*lines, "", END])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = GUIDE.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + render() + text[end:]
    if args.check:
        if new != text:
            print("docs/user-guide.md: the layout table is out of date; run scripts/layout_reference.py", file=sys.stderr)
            return 1
        return 0
    GUIDE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
