"""The fields of ms-swift's ``InferArguments`` (every flag ``swift infer`` takes), read from ms-swift's source.

::

    pip download --no-deps ms-swift==4.6.0 -d /tmp/swift
    python scripts/swift_infer_fields.py /tmp/swift/ms_swift-4.6.0-py3-none-any.whl   # prints the module
    python scripts/swift_infer_fields.py /tmp/swift/ms_swift-4.6.0-py3-none-any.whl --write

The source is read, not imported (ms-swift imports torch and its trainers): ``InferArguments`` and its bases, found
by name in the package's modules (``swift/arguments/``, ``swift/rlhf_trainers/``, ``swift/ray_utils/``...), their
class-level annotated names in the dataclass's order (a base's fields first, as ``dataclasses.fields`` lists them).
``--write`` regenerates include/batch_llm/frontends/swift_fields.py, which ``batch-llm infer`` checks its flag table
against (tests/unit/test_swift_args.py: every field is a flag there, with what it becomes or why it is refused).
"""
from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "include" / "batch_llm" / "frontends" / "swift_fields.py"
TOP_CLASS = "InferArguments"


def package_sources(src: Path) -> dict[str, str]:
    """Path -> text of the ``swift/**.py`` files of a wheel, of a folder holding ``swift/``, or of ``swift/`` itself."""
    if src.is_file():
        with zipfile.ZipFile(src) as z:
            return {n: z.read(n).decode("utf-8") for n in z.namelist()
                    if n.startswith("swift/") and n.endswith(".py")}
    base = src if (src / "arguments").is_dir() else src / "swift"
    if not base.is_dir():
        raise SystemExit(f"{src}: not an ms-swift wheel, nor a folder with swift/ in it")
    return {"swift/" + p.relative_to(base).as_posix(): p.read_text(encoding="utf-8") for p in base.rglob("*.py")}


def class_table(sources: dict[str, str]) -> dict[str, ast.ClassDef]:
    """Every top-level class of the package by name (the argument classes' names are unique in ms-swift; a name
    defined twice keeps the arguments/ one, then the first by path)."""
    table: dict[str, ast.ClassDef] = {}
    for path in sorted(sources, key=lambda p: (not p.startswith("swift/arguments/"), p)):
        for node in ast.parse(sources[path]).body:
            if isinstance(node, ast.ClassDef):
                table.setdefault(node.name, node)
    return table


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def fields_of(top: str, table: dict[str, ast.ClassDef]) -> list[tuple[str, str]]:
    """(field, class that declares it) of ``top`` in dataclass order: the MRO reversed, each class's annotated
    names in source order, a name redeclared keeping its first place (as ``dataclasses`` does)."""
    order: list[str] = []

    def mro(name: str) -> list[str]:  # C3 linearisation over the classes found
        node = table.get(name)
        if node is None:
            return []
        bases = [b for b in map(_base_name, node.bases) if b in table]
        seqs = [mro(b) for b in bases] + [bases]
        out = [name]
        while any(seqs):
            for seq in seqs:
                head = seq[0] if seq else None
                if head and not any(head in s[1:] for s in seqs):
                    break
            else:
                raise SystemExit(f"{name}: no consistent method resolution order")
            out.append(head)
            seqs = [s[1:] if s and s[0] == head else s for s in seqs]
        return out

    seen: dict[str, str] = {}
    for cls in reversed(mro(top)):
        for stmt in table[cls].body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                name = stmt.target.id
                if name.startswith("_") or "ClassVar" in ast.unparse(stmt.annotation):
                    continue
                if name not in seen:
                    order.append(name)
                seen.setdefault(name, cls)
    return [(n, seen[n]) for n in order]


def version_of(sources: dict[str, str]) -> str:
    for node in ast.parse(sources.get("swift/version.py", "")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            return str(ast.literal_eval(node.value))
    return "unknown"


def render(version: str, fields: list[tuple[str, str]]) -> str:
    lines = [f'"""The fields of ms-swift {version}\'s ``InferArguments`` (every flag of ``swift infer``) and the class',
             "that declares each, read from its source by scripts/swift_infer_fields.py. Generated: run it with",
             '``--write`` on a newer ms-swift rather than editing this file."""', "",
             f"MS_SWIFT_VERSION = {version!r}", "INFER_FIELDS: tuple[tuple[str, str], ...] = ("]
    lines += [f"    ({name!r}, {cls!r})," for name, cls in fields]
    return "\n".join([*lines, ")", ""])


def extract(src: Path) -> str:
    sources = package_sources(src)
    table = class_table(sources)
    if TOP_CLASS not in table:
        raise SystemExit(f"{src}: no class {TOP_CLASS}")
    return render(version_of(sources), fields_of(TOP_CLASS, table))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="an ms-swift wheel, or a folder holding its swift/ package")
    ap.add_argument("--write", action="store_true", help=f"write {TARGET.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    text = extract(args.source)
    if args.write:
        TARGET.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
