"""Writes docs/configuration.md, the reference of every pipeline YAML key, from the pydantic models in
``include/batch_llm/config/`` (``PipelineConfig`` and the sections under it): each section with its docstring,
each key with its type, default, bounds and ``Field`` description.

    .venv/bin/python scripts/config_reference.py           # write docs/configuration.md
    .venv/bin/python scripts/config_reference.py --check   # exit 1 when docs/configuration.md is out of date

``tests/unit/test_docs.py`` runs the check, so the page follows the config model.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "configuration.md"
REGENERATE = ".venv/bin/python scripts/config_reference.py"

_BOUNDS = ((annotated_types.Gt, "gt", "> {}"), (annotated_types.Ge, "ge", "≥ {}"), (annotated_types.Lt, "lt", "< {}"),
           (annotated_types.Le, "le", "≤ {}"), (annotated_types.MinLen, "min_length", "length ≥ {}"),
           (annotated_types.MaxLen, "max_length", "length ≤ {}"))


def _config_module():
    try:
        import batch_llm.config as config
    except ImportError:  # run without the package installed: the source tree
        sys.path.insert(0, str(ROOT / "include"))
        import batch_llm.config as config
    return config


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds (``X``, ``X | None``, ``list[X]``), if any."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) is list:
        return True
    return any(_is_list(a) for a in typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union,
                                                                                                   types.UnionType))


def _type_name(annotation: Any, anchors: dict[type, str]) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " \\| ".join(json.dumps(a, ensure_ascii=False) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a, anchors) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0], anchors)}]" if args else "list"
    if origin is dict:
        return "mapping"
    if annotation is typing.Any:
        return "any"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return f"[section](#{anchors[annotation]})" if annotation in anchors else annotation.__name__
    if inspect.isclass(annotation):
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "dict": "mapping"}.get(
            annotation.__name__, annotation.__name__)
    return str(annotation).replace("typing.", "")


def _input_type(model: type[BaseModel], name: str, field: FieldInfo) -> Any:
    """What a YAML key accepts: the field's type, or the wider input a before-validator declares and converts
    (``sampling.output_schema``: the schema or a string naming it)."""
    for dec in model.__pydantic_decorators__.field_validators.values():
        if name in dec.info.fields and dec.info.json_schema_input_type is not PydanticUndefined:
            return dec.info.json_schema_input_type
    return field.annotation


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    if isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    return "`" + json.dumps(value, ensure_ascii=False) + "`"


def _bounds(field: FieldInfo) -> str:
    found = []
    for meta in field.metadata:
        for kind, attr, fmt in _BOUNDS:
            if isinstance(meta, kind):
                found.append(fmt.format(getattr(meta, attr)))
    return ", ".join(found)


def _md(text: str) -> str:
    """Docstring or description text as Markdown: RST ``code`` as `code`, ``<`` outside code spans escaped (GitHub
    would read ``<model cache>`` as a tag)."""
    parts = text.replace("``", "`").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def _cell(text: str) -> str:
    return _md(" ".join(text.split())).replace("|", "\\|")


def _sections(root: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """(dotted path, model) for the top level and every section under it, depth first in field order."""
    out: list[tuple[str, type[BaseModel]]] = []

    def walk(path: str, model: type[BaseModel]) -> None:
        out.append((path, model))
        for name, field in model.model_fields.items():
            sub = _model_of(field.annotation)
            if sub is not None:
                walk(f"{path}.{name}{'[]' if _is_list(field.annotation) else ''}" if path else name, sub)

    walk("", root)
    return out


def _anchor(path: str) -> str:
    # GitHub's heading slug of "`path`": lower case, punctuation but '-' and '_' dropped
    return "top-level" if not path else "".join(c for c in path.lower() if c.isalnum() or c in "-_")


def render() -> str:
    config = _config_module()
    sections = _sections(config.PipelineConfig)
    anchors: dict[type, str] = {}
    for path, model in sections:
        anchors.setdefault(model, _anchor(path))
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/config_reference.py from include/batch_llm/config/; do not edit by hand.",
        f"     Regenerate: {REGENERATE} -->",
        "",
        "Every key of a pipeline YAML file (`dags/pipelines/*.yaml`), generated from the pydantic models in",
        "[`include/batch_llm/config/`](../include/batch_llm/config/). Unknown keys are errors (with the closest",
        "valid key); a value outside its bounds names the file and the dotted key. Airflow Params and",
        "`batch-llm run --set key=value` fill the same models. How the keys are used: [user guide](user-guide.md).",
        "",
        "Sections: " + ", ".join(f"[{'top level' if not p else p}](#{_anchor(p)})" for p, _ in sections) + ".",
        "",
    ]
    for path, model in sections:
        lines.append(f"## {'Top level' if not path else '`' + path + '`'}")
        lines.append("")
        doc = _md(inspect.getdoc(model) or "")
        if doc and model.__doc__ is not None and "__doc__" in vars(model):
            lines += [f"`{model.__name__}`: " + doc.split("\n\n")[0].replace("\n", " "), ""]
            for para in doc.split("\n\n")[1:]:
                lines += [para.replace("\n", " "), ""]
        else:
            lines += [f"`{model.__name__}`.", ""]
        lines += ["| key | type | default | bounds | description |", "| --- | --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            lines.append(f"| `{name}` | {_type_name(_input_type(model, name, field), anchors)} | {_default(field)} | "
                         f"{_bounds(field)} | {_cell(field.description or '')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from what would be written")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is out of date; regenerate it: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
