"""The keyword arguments an engine's constructor takes, read from its installed source without importing it.

A typo in ``engine.extra`` is so refused when the config loads, naming the key and the closest argument, not when
the engine starts (minutes later, on a GPU).

The sources are the capability table's (``EngineCapabilities.engine_args``): vLLM's ``EngineArgs`` fields and its
``LLM`` constructor's own parameters, SGLang's ``ServerArgs`` fields. They are read with ``ast`` from the files
``importlib`` finds, not imported: importing vLLM takes seconds (torch, its platform probes), and every DAG file's
parse loads a config. Where the package is not installed here (the scheduler of a GPU pool, say) or its source no
longer holds the class, the keys cannot be checked: ``EngineArgsUnchecked`` says so, as a warning, rather than
accepting them silently. LMDeploy's keys are checked against its engine configs' fields in ``engines/lmdeploy_config.py``.
"""
from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import os
import warnings
from typing import Any

from batch_llm.config.capabilities import capabilities


class EngineArgsUnchecked(UserWarning):
    """``engine.extra`` keys that could not be checked: the engine's package is not installed here."""


def _package_dir(package: str) -> str | None:
    """The installed package's folder, found without importing it; None where it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a module in sys.modules without a spec (a stand-in)
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _names_in(tree: ast.Module, target: str) -> set[str] | None:
    """``Class`` (its annotated fields, a dataclass's) or ``Class.method`` (its parameters) in a module's tree."""
    cls_name, _, method = target.partition(".")
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    if cls is None:
        return None
    if not method:
        return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    fn = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
    if fn is None:
        return None
    a = fn.args
    return {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)} - {"self"}


@functools.lru_cache(maxsize=8)
def engine_arg_names(kind: str) -> frozenset[str] | None:
    """The keyword arguments engine ``kind``'s constructor takes, from its installed source; None where they
    cannot be read (the package not installed, or a source without the class), or the table names no sources."""
    sources = capabilities(kind).engine_args
    if not sources:
        return None
    names: set[str] = set()
    for source in sources:
        path, _, target = source.partition(":")
        package, _, rel = path.partition("/")
        folder = _package_dir(package)
        if folder is None:
            return None
        try:
            with open(os.path.join(folder, rel), encoding="utf-8") as f:
                found = _names_in(ast.parse(f.read()), target)
        except (OSError, SyntaxError, ValueError):
            return None
        if found is None:
            return None
        names |= found
    return frozenset(names)


def extra_problems(kind: str, extra: dict[str, Any]) -> list[str]:
    """One refusal per ``engine.extra`` key that engine ``kind``'s constructor does not take, with the closest
    argument it does take. Keys that cannot be checked here: an ``EngineArgsUnchecked`` warning, no refusal."""
    caps = capabilities(kind)
    if not extra or not caps.engine_args:
        return []
    names = engine_arg_names(kind)
    if names is None:
        package = caps.engine_args[0].partition("/")[0]
        warnings.warn(f"engine.extra ({', '.join(sorted(extra))}): not checked: {package} is not installed here (or "
                      f"its source no longer holds {', '.join(caps.engine_args)}), so its engine arguments could not "
                      f"be read; a key it does not take fails when the engine starts", EngineArgsUnchecked, stacklevel=2)
        return []
    takes = ", ".join(dict.fromkeys(s.partition(":")[2].split(".")[0] for s in caps.engine_args))
    problems = []
    for key in sorted(set(extra) - names):
        close = difflib.get_close_matches(key, sorted(names), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append(f"engine.extra.{key}: not an argument {caps.title or kind} takes (the installed {takes}){hint}")
    return problems
