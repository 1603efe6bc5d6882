"""The path policy: how a path a user names is opened, where it may point, and how much of it is read.

Every path of a run a user can name (``input.path``, word lists, the output schema file, ``model.ref``,
``model.lora.ref``, ``output.path``, ``output.partition``) is classified here, once, the way it will be opened:

- ``builtin:NAME``: one of the word lists shipped in ``batch_llm/wordlists`` (``builtin:en``, ``builtin:zh``); any
  other name (``builtin:../../x``) is refused.
- a plain path, ``file://`` or ``local://``: a local file (``~`` expanded, relative to the working directory).
- ``s3://``, ``gs://``, ``az://``, ... (``OBJECT_STORAGE_PROTOCOLS``): object storage.
- a caching wrapper in front of one of those (``simplecache::file:///...``, ``filecache::s3://...``): what it
  wraps; fsspec opens the wrapped URL, so a wrapped local path is a local path.
- anything else (``http://``, ``zip::``, ``dir::``, ``reference::``, ...): ``other``, which the trigger form and the
  report app refuse.

What a row makes the pipeline read (its images) is held to one rule, ``RowResources``: a data: URL, an object in the
run's own store, or a local path under the allowed folders; anything else is refused by name before any filesystem
is made for it, and a local file is opened only as a regular file (``open_regular``).

``storage.as_path`` opens a local path at exactly the ``local_path`` classified here, so what a check looked at
(after ``realpath``: ``..`` and symlinks resolved) is what is read.

Files read whole (word lists, schema files, pipeline files) are read through ``read_file_bounded``: a device, a
FIFO or a file over the limit is refused with one line, not read into memory. YAML is loaded through
``load_yaml``, which refuses a document whose aliases expand beyond ``MAX_YAML_VALUES`` values before anything
is built from it.

Nothing here imports Airflow or the rest of the library (it is imported by both).
"""
from __future__ import annotations

import functools
import os
import posixpath
import re
import stat
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

BUILTIN_PREFIX = "builtin:"
BUILTIN_WORDLISTS = Path(__file__).resolve().parents[1] / "wordlists"

LOCAL_PROTOCOLS = ("file", "local")
# fsspec wrappers that keep a local copy of what they wrap and read nothing else
CACHE_WRAPPERS = ("simplecache", "filecache", "blockcache", "cached")
OBJECT_STORAGE_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hf", "memory")

MIB = 2**20
MAX_WORD_LIST_BYTES = 32 * MIB
MAX_SCHEMA_BYTES = 4 * MIB
MAX_PIPELINE_FILE_BYTES = 1 * MIB
MAX_YAML_VALUES = 100_000   # scalars, lists and mappings of a YAML document, aliases counted as expanded
MAX_YAML_DEPTH = 100        # nesting of lists and mappings

PARTITION_PLACEHOLDERS = ("ds",)  # what RunLayout fills: the run's date, YYYY-MM-DD
RESERVED_PARTITIONS = ("runs",)   # <output.path>/<pipeline>/runs holds the run folders


class PathRefused(ValueError):
    """A path the policy does not allow (or a file it does not read); the message is one line saying why."""


Kind = Literal["local", "storage", "builtin", "inline", "other"]


@dataclass(frozen=True)
class ResolvedPath:
    """What a URL names, as it will be opened."""

    url: str
    kind: Kind
    protocol: str = ""              # the target's: "" for a plain path, "file", "local", "s3", ...
    local_path: str | None = None   # local: the absolute path that is opened; builtin: the shipped file
    wrapped: bool = False           # a caching wrapper (simplecache::...) in front of the target

    @property
    def is_local(self) -> bool:
        """A local path opened directly (not through a wrapper)."""
        return self.kind == "local" and not self.wrapped


# as universal_pathlib reads a URL's protocol: "proto://", "proto:/" or "proto::" (a chain)
_PROTOCOL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+]+):(?P<sep>//|/|:)(?P<rest>.*)$", re.S)


def _strip_local(url: str) -> str:
    """The path fsspec's local filesystem opens for a ``file://`` / ``local://`` URL (its ``_strip_protocol``:
    the protocol off, ``~`` expanded, relative to the working directory, not normalized)."""
    for prefix in ("file://", "local://"):
        if url.startswith(prefix):
            url = url[len(prefix):]
            break
    path = os.path.expanduser(url)
    return path if path.startswith("/") else os.path.join(os.getcwd(), path)


def resolve(url: str) -> ResolvedPath:
    """Classifies ``url`` the way ``storage.as_path`` (and fsspec behind it) will open it."""
    if url.startswith(BUILTIN_PREFIX):
        name = url.removeprefix(BUILTIN_PREFIX)
        found = _builtin_names().get(name)
        return ResolvedPath(url, "builtin", local_path=str(found) if found else None)
    if "://" not in url:  # no protocol: as_path opens it as a local path, whatever it holds ("::" included)
        return ResolvedPath(url, "local", local_path=os.path.abspath(os.path.expanduser(url)))
    m = _PROTOCOL.match(url)
    if m is None:  # "://" later in a path without a protocol of its own: a local path too (as UPath reads it)
        return ResolvedPath(url, "local", local_path=os.path.abspath(os.path.expanduser(url)))
    protocol, sep, rest = m["protocol"], m["sep"], m["rest"]
    if sep == "//" and protocol in LOCAL_PROTOCOLS:
        return ResolvedPath(url, "local", protocol, os.path.abspath(_strip_local(url)))
    if sep == "//" and protocol in OBJECT_STORAGE_PROTOCOLS:
        return ResolvedPath(url, "storage", protocol)
    if sep == ":" and protocol in CACHE_WRAPPERS and "://" in rest:
        target = resolve(rest)
        if target.kind == "local" and target.protocol:
            # fsspec hands the wrapped path to its local filesystem as it is (no normalization)
            return ResolvedPath(url, "local", target.protocol, _strip_local(rest), wrapped=True)
        if target.kind == "storage":
            return ResolvedPath(url, "storage", target.protocol, wrapped=True)
    return ResolvedPath(url, "other", protocol)


def is_local(url: str) -> bool:
    """Whether ``url`` is a local path opened directly (plain, ``file://`` or ``local://``)."""
    return resolve(url).is_local


def local_path(url: str) -> str | None:
    """The absolute local path ``url`` opens (wrapped or not); None when it is not local."""
    r = resolve(url)
    return r.local_path if r.kind == "local" else None


# ------------------------------------------------------------------------------------------ built-in lists
def _builtin_names() -> dict[str, Path]:
    return {p.stem: p for p in sorted(BUILTIN_WORDLISTS.glob("*.txt")) if p.is_file()}


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + name for name in _builtin_names()]


def builtin_file(url: str) -> Path:
    """The shipped word list ``builtin:NAME`` names; PathRefused for any other name (``builtin:../x``)."""
    found = _builtin_names().get(url.removeprefix(BUILTIN_PREFIX))
    if found is None:
        raise PathRefused(f"no built-in list {url!r} (built-ins: {', '.join(builtin_names())})")
    return found


# ------------------------------------------------------------------------------------------ allowed roots
def under_roots(path: str, roots: list[str]) -> bool:
    """Whether local ``path`` lies under one of ``roots`` (a root may be a file), both after ``realpath``:
    ``..`` and symlinks resolved, so the file that would be read is the one compared."""
    real = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if real == base or os.path.commonpath([real, base]) == base:
            return True
    return False


# ------------------------------------------------------------------------------------------ a row's resources
# Protocols that name the same store (one connection reads them all)
_STORE_FAMILIES = (("s3", "s3a"), ("gs", "gcs"), ("az", "abfs", "abfss"))


def store_family(protocol: str) -> tuple[str, ...]:
    """The protocols that name the same store as ``protocol`` (``s3`` and ``s3a``, ...); () for none."""
    for family in _STORE_FAMILIES:
        if protocol in family:
            return family
    return (protocol,) if protocol in OBJECT_STORAGE_PROTOCOLS else ()


def input_stores(input_url: str, conn_id: str | None) -> tuple[str, ...]:
    """The object-storage protocols a run's rows may name resources in: the input's own store, and S3 where the
    input has a connection (``input.conn_id`` is an AWS connection). A local input without one: none."""
    stores = list(store_family(resolve(input_url).protocol)) if resolve(input_url).kind == "storage" else []
    if conn_id:
        stores += [p for p in store_family("s3") if p not in stores]
    return tuple(stores)


def join_relative(base: str, rel: str) -> str:
    """A relative reference joined to an input file's folder: a local path, or an object-storage URL whose key's
    ``.`` and ``..`` segments are resolved (S3 keys hold them literally; no store would find the object meant)."""
    if resolve(base).kind == "storage":
        scheme, _, rest = base.rstrip("/").partition("://")
        bucket, _, prefix = rest.partition("/")
        key = posixpath.normpath(posixpath.join("/" + prefix, rel)).lstrip("/")
        return f"{scheme}://{bucket}/{key}"
    return os.path.join(base, rel)


@dataclass(frozen=True)
class RowResources:
    """The one rule for what a row may make the pipeline read (its images): a ``data:`` URL (inline); an object in
    the run's own store (``stores``: ``input_stores``), read with the input's storage options; a local path under
    ``roots`` (after ``realpath``); a path relative to the input file's folder (``base``), under it. Anything else
    (``http://``, ``hf://``, an fsspec wrapper, another store, a NUL byte) is refused by ``check`` with the reason,
    before any filesystem is made for it: a row never reaches the network or a store the run was not given.

    ``roots`` None: a path the plan checked, read again (absolute and canonical: a link put in its place since is
    refused, so the file read is still the one under the roots the plan compared)."""

    stores: tuple[str, ...] = ()
    roots: tuple[str, ...] | None = ()

    def check(self, ref: Any, base: str | None = None) -> ResolvedPath:
        """Where ``ref`` is read: kind ``inline`` (a data: URL), ``storage`` (its URL, joined to ``base`` when
        relative) or ``local`` (``local_path``: its real path); PathRefused naming why it is not read."""
        if not isinstance(ref, str) or not ref.strip():
            raise PathRefused(f"a reference is a non-empty string (a data: URL, a path or a storage URL), got "
                              f"{type(ref).__name__}")
        if "\x00" in ref:
            raise PathRefused("the reference holds a NUL byte")
        if ref.startswith("data:"):
            return ResolvedPath(ref, "inline", "data")
        r = resolve(ref)
        if r.kind == "local" and not r.wrapped and "://" not in ref and base is not None and \
                not os.path.isabs(os.path.expanduser(ref)):
            joined = join_relative(base, ref)
            if resolve(joined).kind == "storage":  # an input in object storage: relative to its folder there
                if not (joined + "/").startswith(base.rstrip("/") + "/"):
                    raise PathRefused(f"{ref} climbs out of the input's folder {base} (a relative path stays under "
                                      "it; name another object by its full URL)")
                return self._stored(resolve(joined))
            r = resolve(joined)
        if r.wrapped or r.kind not in ("local", "storage"):
            scheme = ref.split("::", 1)[0] + "::" if r.wrapped else ref.split(":", 1)[0] + ":" + "//" * ("://" in ref)
            raise PathRefused(f"{scheme} is refused: {self._allowed()}")
        if r.kind == "storage":
            return self._stored(r)
        path = r.local_path or ref
        real = os.path.realpath(path)
        if self.roots is None:
            if real != path:
                raise PathRefused(f"{path} is no longer the file the plan checked (a link, or a folder on its way is "
                                  f"one, now points to {real})")
        elif not under_roots(real, list(self.roots)):
            raise PathRefused(f"{path} is outside the folders images may be read from "
                              f"({', '.join(self.roots) or 'none'}; add its folder to input.image_roots)")
        return ResolvedPath(ref, "local", r.protocol, real)

    def _stored(self, r: ResolvedPath) -> ResolvedPath:
        if r.protocol not in self.stores:
            raise PathRefused(f"{r.protocol}:// is refused (not this run's storage): {self._allowed()}")
        return r

    def _allowed(self) -> str:
        stores = ", ".join(f"{p}://" for p in self.stores)
        store = f"the run's storage ({stores}) through the input's connection, " if stores else ""
        return (f"a row's images come from data: URLs, {store}or local paths under the input's folder and "
                "input.image_roots (nothing from the web or another store)")


def open_regular(path: str) -> Any:
    """``path`` opened for reading, binary, where it is a regular file; PathRefused for a folder, device, FIFO or
    socket (opened without blocking, checked on the open file: a FIFO put in its place cannot hang the reader).
    FileNotFoundError where it is gone."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PathRefused(f"{path} is {'a folder' if stat.S_ISDIR(mode) else 'not a regular file'} (a device, "
                              "FIFO or socket is never read)")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


# ------------------------------------------------------------------------------------------ reading whole files
def _size(n: int) -> str:
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n} bytes"


def local_file_problem(path: str, limit: int) -> str | None:
    """Why the local file ``path`` cannot be read whole (missing, not a regular file, over ``limit``); None
    when it can."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"no such file {path}"
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    if stat.S_ISDIR(st.st_mode):
        return f"{path} is a folder, not a file"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a device, FIFO or socket is never read)"
    if st.st_size > limit:
        return f"{path} is {_size(st.st_size)}, over the {_size(limit)} limit of such a file"
    return None


def read_local_bounded(path: str, limit: int) -> bytes:
    """The bytes of the local regular file ``path``, at most ``limit`` of them; PathRefused otherwise. Opened
    without blocking (a FIFO does not hang the reader) and checked on the open file, then read with a bound (a
    file that grows, or claims a size of 0 as /proc files do, cannot exceed it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise PathRefused(f"cannot read {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PathRefused(f"{path} is {'a folder' if stat.S_ISDIR(st.st_mode) else 'not a regular file'}"
                              f", not a file this reads (a device, FIFO or socket is never read)")
        if st.st_size > limit:
            raise PathRefused(f"{path} is {_size(st.st_size)}, over the {_size(limit)} limit of such a file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise PathRefused(f"{path} holds more than the {_size(limit)} limit of such a file")
    return data


def read_file_bounded(path: Any, limit: int) -> bytes:
    """The bytes of ``path`` (a ``UPath``: local or object storage), at most ``limit``; PathRefused beyond."""
    if getattr(path, "protocol", "") in ("", "file", "local"):
        return read_local_bounded(str(path.path if hasattr(path, "path") else path), limit)
    size = path.fs.size(path.path)
    if size is not None and size > limit:
        raise PathRefused(f"{path} is {_size(size)}, over the {_size(limit)} limit of such a file")
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise PathRefused(f"{path} holds more than the {_size(limit)} limit of such a file")
    return data


# ------------------------------------------------------------------------------------------ YAML
def load_yaml(text: str, *, max_values: int = MAX_YAML_VALUES, max_depth: int = MAX_YAML_DEPTH) -> Any:
    """``yaml.safe_load`` that refuses (ValueError) a document expanding beyond ``max_values`` values or nested
    deeper than ``max_depth``. The node graph is composed first (an alias is one shared node there: cheap) and
    measured, with each node's expanded size counted once, so an alias bomb is refused in time linear in the
    file, before the billions of values it stands for are built. Invalid YAML: ``yaml.YAMLError``.

    Parsed by libyaml (``yaml.CSafeLoader``, about seven times faster: a DAG file builds every pipeline within
    Airflow's import timeout) where PyYAML has it and its libyaml bounds nesting itself; else by the pure-Python
    loader, whose recursion bounds it."""
    import yaml

    loader = _safe_loader()(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ValueError(f"nested deeper than {max_depth} levels") from None
        except yaml.scanner.ScannerError as e:
            if "exceeded maximum nesting depth" in str(e):  # libyaml's own bound, far above max_depth
                raise ValueError(f"nested deeper than {max_depth} levels") from None
            raise
        if node is None:
            return None
        _check_expansion(node, max_values, max_depth)
        return loader.construct_document(node)
    finally:
        loader.dispose()


@functools.cache
def _safe_loader() -> type:
    """``yaml.CSafeLoader`` where libyaml refuses deep nesting by itself (composing recurses in C, where a
    thousand-level document must not reach the stack's end); else ``yaml.SafeLoader``."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", None)
    if loader is None:
        return yaml.SafeLoader
    probe = loader("[" * 5000 + "]" * 5000)
    try:
        probe.get_single_node()
    except yaml.YAMLError:
        return loader  # refused: this libyaml bounds nesting
    finally:
        probe.dispose()
    return yaml.SafeLoader


def _check_expansion(root: Any, max_values: int, max_depth: int) -> None:
    import yaml

    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    # iterative post-order walk: (node, depth, children visited)
    stack: list[tuple[Any, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if done:
            on_path.discard(id(node))
            children = _yaml_children(node)
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > max_values:
                raise ValueError(f"expands to more than {max_values:,} values (YAML aliases: line "
                                 f"{node.start_mark.line + 1}); write the values out or make the file smaller")
            continue
        if id(node) in sizes:
            continue
        if id(node) in on_path:
            raise ValueError(f"an alias refers to a value that holds it (line {node.start_mark.line + 1})")
        if depth > max_depth:
            raise ValueError(f"nested deeper than {max_depth} levels (line {node.start_mark.line + 1})")
        if isinstance(node, yaml.ScalarNode):
            sizes[id(node)] = 1
            continue
        on_path.add(id(node))
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in _yaml_children(node) if id(c) not in sizes)


def _yaml_children(node: Any) -> list:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


# ------------------------------------------------------------------------------------------ templates
def template_problem(template: str, allowed: tuple[str, ...] = PARTITION_PLACEHOLDERS) -> str | None:
    """Why ``template`` cannot be filled with ``str.format`` and only ``allowed`` placeholders; None if it can."""
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as e:  # a lone "{" or "}"
        return f"{e} (write a literal brace as {{{{ or }}}})"
    allowed_text = ", ".join("{" + a + "}" for a in allowed)
    for name, spec, conv in fields:
        if name not in allowed:
            shown = "{" + name + "}" if name else "{}"
            return f"unknown placeholder {shown}; the placeholders allowed: {allowed_text}"
        if spec or conv:
            return f"placeholder {{{name}}} takes no conversion or format spec; write {{{name}}}"
    return None


def partition_problem(partition: str, template: str | None = None) -> str | None:
    """Why a filled ``output.partition`` is not one folder name under the pipeline's folder; None if it is.
    ``template``: what the message names (the template the value was filled from)."""
    shown = repr(template if template is not None else partition)
    if not partition or partition.strip() != partition:
        return f"{shown} is empty or starts or ends with a space"
    if "/" in partition or "\\" in partition or "\x00" in partition:
        return f"{shown} is a path, not one folder name (no '/' or '\\'): it must stay in the pipeline's folder"
    if partition in (".", "..") or partition.startswith("."):
        return f"{shown} would be the pipeline's folder, its parent or a hidden folder"
    if partition in RESERVED_PARTITIONS:
        return f"{shown} is the folder of the pipeline's run folders"
    return None


def partition_template_problem(template: str, sample_ds: str = "2026-01-01") -> str | None:
    """Why ``output.partition`` is not a valid template (unknown placeholders, or not one folder name once
    filled); None when it is."""
    return template_problem(template) or partition_problem(template.format(ds=sample_ds), template)


# ------------------------------------------------------------------------------------------ output folders
def local_folder_problem(path: str) -> str | None:
    """Why the local ``path`` cannot be (or become) a folder: it, or a folder above it, is a file, or the nearest
    folder of it that exists is not writable (nothing could be made there)."""
    p = Path(path)
    for candidate in (p, *p.parents):
        if candidate.exists():
            if not candidate.is_dir():
                what = "is a file" if candidate == p else f"lies under {candidate}, which is a file"
                return f"{path} {what}, not a folder"
            return None if folder_writable(str(candidate)) else f"{path}: the folder {candidate} is not writable"
    return None


def folder_writable(folder: str) -> bool:
    """Whether a file can be made in ``folder``: a file is made and removed (``os.access`` answers yes to root on
    a read-only or pseudo file system, where the write would still fail)."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".batch-llm-probe-"):
            return True
    except OSError:
        return False


def output_file_problem(path: str, inputs: tuple[str, ...] = ()) -> str | None:
    """Why a command cannot write its output file at the local ``path``; None when it can. Checked before the
    command works, so that no run is lost to an output it could never write: a folder, a file in a folder that is
    missing (none is made: a typo'd folder is refused, not created) or not writable, a file that is not writable,
    or one of the command's ``inputs`` (writing it would destroy what is read)."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        return f"{path} is a folder; name a file in it"
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        what = "is a file, not a folder" if os.path.exists(parent) else "does not exist (create it first)"
        return f"{path}: the folder {parent} {what}"
    for given in inputs:
        source = os.path.abspath(os.path.expanduser(given))
        if os.path.realpath(source) == os.path.realpath(full):
            return f"{path} is the input {given}; writing it would destroy the input: name another file"
    if not folder_writable(parent):
        return f"{path}: the folder {parent} is not writable"
    if os.path.exists(full) and not os.access(full, os.W_OK):
        return f"{path}: the file is not writable"
    return None


#: The longest run id: Airflow's own column holds 250 characters; the run folder's name must fit a file name too.
MAX_RUN_ID_CHARS = 250


def run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a run (its folder is ``runs/<partition>/<run id>``); None when it can. One rule
    wherever a run id enters (``--run-id``, a DAG run's id from the trigger form or the REST API): not empty, no
    ``/`` or ``\\``, not ``.`` or ``..``, no control characters, at most ``MAX_RUN_ID_CHARS`` characters."""
    if not isinstance(run_id, str) or not run_id.strip():
        return "a run id is not empty"
    if "/" in run_id or "\\" in run_id:
        return f"run id {run_id!r} holds a path separator ('/' or '\\'): it names one folder"
    if run_id in (".", ".."):
        return f"run id {run_id!r} would name the partition's folder or its parent, not a run's own"
    if any(ord(c) < 32 or ord(c) == 127 for c in run_id):
        return f"run id {run_id!r} holds a control character"
    if len(run_id) > MAX_RUN_ID_CHARS:
        return f"run id of {len(run_id)} characters; at most {MAX_RUN_ID_CHARS}"
    return None


_STORAGE_SCHEMES = tuple(f"{p}://" for p in OBJECT_STORAGE_PROTOCOLS)


def classify_ref(ref: str, key: str = "model.ref") -> str:
    """storage, local or modelscope, as the path policy resolves the ref (a wrapped URL is none of them)."""
    resolved = resolve(ref)
    if resolved.kind == "storage" and not resolved.wrapped:
        return "storage"
    if resolved.is_local and resolved.local_path and (
            resolved.protocol or ref.startswith(("/", "./", "../", "~")) or os.path.isdir(resolved.local_path)):
        return "local"
    if "://" not in ref and ref.count("/") == 1 and all(ref.split("/")):
        return "modelscope"
    raise ValueError(f"{key} {ref!r} is neither a ModelScope id (owner/name), a local directory, "
                     f"nor an object-storage prefix ({', '.join(_STORAGE_SCHEMES)})")
