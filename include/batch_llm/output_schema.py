"""Structured outputs: the JSON Schema every output must match, the check of one output, and the typed
columns the published dataset gets from it.

``sampling.output_schema`` names a JSON Schema file (JSON or YAML, relative to the pipeline's YAML) or a
pydantic model (``package.module:Class``); the config loads it once into the schema itself, so the schema
travels with the config to every worker and is part of the result cache's namespace. vLLM then decodes
under it (``StructuredOutputsParams(json=...)``, the xgrammar backend) unless ``sampling.guided_decoding`` is
off (or ``fallback``: freely first, then only the misses under it); either way every output is checked here:
a valid one is published as typed columns, an invalid one is an ``invalid_output`` row with the reason (not a
failed task).

    schema = OutputSchema(cfg.sampling.output_schema)
    value, reason = schema.check('{"aspect": "battery", "sentiment": "负面"}')
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from batch_llm.host import path_policy

INVALID_OUTPUT = "invalid_output"


# keywords whose values are data or names, not schemas: a property called "maxLength" is not a bound
_DATA_KEYWORDS = ("enum", "const", "default", "examples", "required")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
STRING_LENGTH_BOUNDS = ("minLength", "maxLength")


def without_string_length_bounds(schema: Any) -> Any:
    """The schema with every string's minLength / maxLength taken out (``sampling.guided_length_bounds: check``).

    Why: a bounded string makes the grammar count characters, so its token mask cannot be cached: with a
    7B model's tokenizer xgrammar's mask work per token is ~26x that of the same schema unbounded (``python -m
    bench grammar-cost``). The full schema still checks every output.
    """
    if isinstance(schema, list):
        return [without_string_length_bounds(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in STRING_LENGTH_BOUNDS:
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: without_string_length_bounds(s) for name, s in value.items()}
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = without_string_length_bounds(value)
    return out


def load_schema(ref: str) -> dict:
    """The JSON Schema a reference names: a .json/.yaml file, or ``module:Class`` of a pydantic model."""
    if ":" in ref and not ref.lower().endswith((".json", ".yaml", ".yml")) and "/" not in ref.split(":")[0]:
        module, _, name = ref.partition(":")
        try:
            model = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import the output model {ref!r}: {e}") from None
        if not hasattr(model, "model_json_schema"):
            raise ValueError(f"{ref!r} is not a pydantic model (no model_json_schema)")
        return model.model_json_schema()
    schema = _read_schema_file(ref)
    if not isinstance(schema, dict):
        raise ValueError(f"{ref} does not hold a JSON Schema object")
    return schema


def _read_schema_file(ref: str) -> Any:
    """The parsed JSON or YAML of a schema file, read within the path policy's bounds."""
    path = Path(ref)
    try:  # bounded: a device, a FIFO or a huge file is refused, not read into memory
        text = path_policy.read_local_bounded(str(path), path_policy.MAX_SCHEMA_BYTES).decode("utf-8")
    except OSError as e:
        raise ValueError(f"cannot read the output schema file {ref}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{ref} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except path_policy.PathRefused as e:
        raise ValueError(f"output schema file: {e}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            schema = path_policy.load_yaml(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{ref} is not valid YAML: {e}") from None
        except ValueError as e:  # it expands too far
            raise ValueError(f"{ref}: {e}") from None
    else:
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ref} is not JSON: {e.msg} (line {e.lineno})") from None
        except RecursionError:
            raise ValueError(f"{ref}: nested too deeply") from None
    return schema


def check_schema(schema: dict) -> dict:
    """The schema, if it is a valid JSON Schema (Draft 2020-12); ValueError with jsonschema's reason."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
        problem = ref_problem(schema)
    except SchemaError as e:
        raise ValueError(f"not a valid JSON Schema: {e.message}") from None
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None
    if problem:
        raise ValueError(problem)
    return schema


class _RefProblem(Exception):
    pass


def _pointer_target(root: dict, ref: str) -> Any:
    """The part of ``root`` the local reference ``ref`` (``#`` or ``#/a/b``, JSON Pointer) names."""
    from urllib.parse import unquote

    node: Any = root
    for token in unquote(ref[1:]).split("/")[1:] if ref != "#" else []:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


class _RefWalk:
    """A depth-first walk of a schema that follows every ``$ref``: a schema met again while it is being walked
    is a cycle. Each schema is walked once (a shared one is not walked again): linear in the schema."""

    def __init__(self, root: dict):
        self.root = root
        self.done: set[int] = set()
        self.entered: dict[int, str] = {}  # the schemas on the current path -> where each was entered

    def visit(self, node: Any, where: str, trail: tuple[str, ...]) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                self.visit(item, f"{where}/{i}", trail)
            return
        if not isinstance(node, dict) or id(node) in self.done:
            return
        if id(node) in self.entered:
            raise _RefProblem(f"$ref cycle: {' -> '.join(trail)} leads back to {self.entered[id(node)]}; a schema "
                              "that refers to itself is never done checking an output and has no column type: "
                              "write its nested levels out")
        self.entered[id(node)] = where
        for key, value in node.items():
            if key in _DATA_KEYWORDS:
                continue
            if key == "$ref" and isinstance(value, str):
                self.follow(value, f"{where}/$ref {value!r}", trail)
            elif key in _NAMED_SCHEMAS and isinstance(value, dict):  # names, not keywords: a property "$ref"
                for name, sub in value.items():
                    self.visit(sub, f"{where}/{key}/{name}", trail)
            elif isinstance(value, dict | list):
                self.visit(value, f"{where}/{key}", trail)
        del self.entered[id(node)]
        self.done.add(id(node))

    def follow(self, ref: str, at: str, trail: tuple[str, ...]) -> None:
        if not ref.startswith("#"):
            raise _RefProblem(f"{at}: only references inside the schema (#/...) are followed")
        target = _pointer_target(self.root, ref)
        if not isinstance(target, dict | bool):
            raise _RefProblem(f"{at} points at no schema inside the schema")
        self.visit(target, ref, (*trail, at))


def ref_problem(schema: dict) -> str | None:
    """Why the schema's ``$ref`` references cannot be followed, None when they can: one pointing outside the
    schema or at nothing, or a cycle (a schema reached again from itself through ``$ref``). A ``$ref`` at its
    own schema makes every check recurse without end (RecursionError on every row), and a recursive type has no
    column type to publish, so any cycle is refused."""
    try:
        _RefWalk(schema).visit(schema, "#", ())
    except _RefProblem as e:
        return str(e)
    return None


class OutputSchema:
    """One compiled schema: ``check`` parses and validates an output; ``arrow_fields`` types its columns."""

    def __init__(self, schema: dict):
        from jsonschema import Draft202012Validator

        self.schema = schema
        self._validator = Draft202012Validator(schema)
        self._fields: list | None = None

    def check(self, text: str) -> tuple[Any, str | None]:
        """(the parsed value, None) when the output matches; (None, the reason) when it does not."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return None, f"{INVALID_OUTPUT}: not JSON ({e.msg} at character {e.pos})"
        error = next(iter(sorted(self._validator.iter_errors(value), key=lambda x: list(x.absolute_path))), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(the whole value)"
            return None, f"{INVALID_OUTPUT}: {where}: {error.message}"
        return value, None

    def columns(self) -> list[str]:
        """The top-level properties that become columns (an object schema), in the schema's order."""
        props = self.schema.get("properties") if self.schema.get("type", "object") == "object" else None
        return list(props) if isinstance(props, dict) else []

    def arrow_fields(self) -> list:
        """pyarrow fields of the columns, typed from the schema (not from the values seen); built once, as
        publish asks for them per row."""
        if self._fields is None:
            import pyarrow as pa

            props = self.schema.get("properties") or {}
            self._fields = [pa.field(name, _arrow_type(props[name], self.schema)) for name in self.columns()]
        return self._fields


def _arrow_type(prop: dict, root: dict):
    import pyarrow as pa

    if "$ref" in prop:  # pydantic puts nested models and enums under $defs
        prop = _deref(prop["$ref"], root)
    if "enum" in prop and "type" not in prop:
        kinds = {type(v) for v in prop["enum"]}
        prop = {**prop, "type": "string" if kinds == {str} else "integer" if kinds == {int} else None}
    kind = prop.get("type")
    if isinstance(kind, list):  # ["string", "null"]: nullable string
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return pa.string()
    if kind == "integer":
        return pa.int64()
    if kind == "number":
        return pa.float64()
    if kind == "boolean":
        return pa.bool_()
    if kind == "array" and isinstance(prop.get("items"), dict):
        return pa.list_(_arrow_type(prop["items"], root))
    if kind == "object" and isinstance(prop.get("properties"), dict):
        return pa.struct([pa.field(k, _arrow_type(v, root)) for k, v in prop["properties"].items()])
    return pa.string()  # anything else (anyOf, free objects) is published as its JSON text


def _deref(ref: str, root: dict) -> dict:
    node: Any = root
    for part in ref.removeprefix("#/").split("/"):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    return node if isinstance(node, dict) else {}


def column_value(value: Any, arrow_type) -> Any:
    """A parsed value as its column holds it: JSON text where the column is text but the value is not."""
    import pyarrow as pa

    if arrow_type == pa.string() and value is not None and not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return value
