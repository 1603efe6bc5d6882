"""Plan shards: read the run's input, validate every row, split the valid rows into shards, in bounded memory.

Invalid rows go to ``errors.jsonl`` with a reason (file, line, id when known) and the rest goes on; a file none
of whose rows can be read or be valid (corrupt Parquet, a table without a prompt column) fails the plan, naming
the file (``formats.InputFileError``). Shards are contiguous ranges of the input (so outputs merge back in input
order), sorted inside by output budget (or the length earlier runs generated for such prompts: ``cache/lengths.py``),
largest first, then (for engines that cache prefixes) by shared prompt prefix, then by prompt length
(``shard_order``): the longest generations start first instead of trailing a shard's end on a near-empty batch,
rows sharing a prefix meet it in the engine's prefix cache, and similar prompt lengths batch together (less padding
for static batching).

Memory does not grow with the input. How, in three streamed passes over local temporary files::

    input files ─> validate ─> spool (valid rows, input order) + row errors + one 8-byte id hash per row
    id hashes (an array, sorted) ─> candidate duplicates ─> one pass over the spool confirms them by id
    spool ─> records.jsonl + shard files (each sorted by shard_order: in-memory runs spilled and merged)

The spool is a local file of tab-separated fields whose JSON parts are written once in the first pass and
copied as bytes afterwards (JSON escapes tabs and newlines, so a field never holds one). Planning needs
about three times the input's size in local temporary space (``$TMPDIR``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import tempfile
import time
from array import array
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
from upath import UPath

from batch_llm.cache.lengths import HISTORY_LEVELS, LengthHistory
from batch_llm.cache.lengths import store_for as lengths_store
from batch_llm.config import PipelineConfig, ShardingConfig
from batch_llm.config.capabilities import ENGINES, takes_no_images
from batch_llm.config.input import MAX_LINE_BYTES
from batch_llm.io.external_sort import ExternalSort, merge_sorted
from batch_llm.io.formats import (
    SUFFIX_FORMAT,
    InputFileError,
    detect_format,
    input_files,
    read_file_rows,
    sniff_openai_batch,
)
from batch_llm.io.images import (
    ImageChecker,
    ImageProblem,
    ImageReads,
    ImageRef,
    content_text,
    image_part,
    load_ahead,
    stamps_digest,
    where_of,
)
from batch_llm.io.storage import (
    Location,
    as_path,
    atomic_writer,
    copy_object,
    json_bytes,
    peak_rss_mb,
)
from batch_llm.layout import RunLayout, shard_name
from batch_llm.manifests import (
    PlanManifest,
    ShardSpec,
)
from batch_llm.rows.params import engine_refusal
from batch_llm.rows.prefix import PREFIX_LEVELS, prefix_groups, prompt_bytes
from batch_llm.rows.prompt import IMAGE_BYTES, IMAGE_URL, PromptRow, RawRow, to_prompt_row

# 64-bit hash of an id, within this process: equal hashes only nominate duplicate candidates (ids decide).
id_hash = hash

# Rows sorted in memory at once inside a shard; larger shards are sorted in runs and merged.
SORT_RUN_ROWS = 100_000


def default_rows_per_shard(s: ShardingConfig, max_tokens: int) -> int:
    """Rows per shard that keep engine start under ``max_engine_start_share`` of the shard's time:

        start / (start + rows * max_tokens / tok_s) <= share  <=>  rows >= start * tok_s * (1 - share) / (share * max_tokens)

    e.g. 70 s start, 15k tok/s, 256 tokens, 10 % → 36,915 rows (docs/benchmarks.md, "Engine start")."""
    share = s.max_engine_start_share
    rows = s.expected_engine_start_seconds * s.expected_output_tokens_per_second * (1 - share) / (share * max_tokens)
    return max(256, math.ceil(rows))


def shard_sizes(n: int, s: ShardingConfig, max_tokens: int = 256) -> list[int]:
    if n == 0:
        return []
    if s.num_shards:
        k = min(s.num_shards, n)
    else:
        k = math.ceil(n / (s.rows_per_shard or default_rows_per_shard(s, max_tokens)))
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def prompt_chars(r: PromptRow) -> int:
    """A prompt's length in characters (token ids count as 4 characters)."""
    if r.prompt_token_ids:
        return len(r.prompt_token_ids) * 4
    return len(r.text) if r.text is not None else sum(len(content_text(m["content"])) for m in r.messages)


# shard_order's weight of one output token: above any prompt's length in characters.
_BUDGET_STEP = 1 << 40


def groups_prefixes(cfg: PipelineConfig) -> bool:
    """Whether the plan groups rows by prompt prefix: only where it sorts them (``sharding.sort_by_length``), then
    ``sharding.group_prefixes``; null: where the engine keeps prefixes cached, its capability unless
    ``engine.enable_prefix_caching`` says otherwise."""
    if not cfg.sharding.sort_by_length:  # input order: no key is read, so none is hashed
        return False
    if cfg.sharding.group_prefixes is not None:
        return cfg.sharding.group_prefixes
    if cfg.engine.enable_prefix_caching is not None:
        return cfg.engine.enable_prefix_caching
    if isinstance(cfg.engine.extra.get("enable_prefix_caching"), bool):  # the engine's own argument, passed on
        return cfg.engine.extra["enable_prefix_caching"]
    return ENGINES[cfg.engine.kind].prefix_cache


def shard_order(r: PromptRow, default_max_tokens: int, group_prefixes: bool = False,
                history: LengthHistory | None = None) -> int:
    """The sort key inside a shard: the row's expected output length, largest first (its output budget, or with a
    ``history`` what earlier runs generated for its prefix group, at most the budget), then (``group_prefixes``)
    its prompt's prefix group, then its prompt length, as one integer (ascending = that order), so the sort and its
    spilled runs carry one number a row.

    Engines that batch continuously (vLLM, LMDeploy) admit requests in shard order. A long generation
    admitted late runs on after the rest have finished, in ever smaller decode batches; started first, it
    overlaps with the short ones (longest processing time first; on the H200 mix, docs/benchmarks.md). Where rows
    end early (EOS) the budget is a poor guess of which run longest: the history (``cache/lengths.py``) is better.
    Rows that share a prefix, submitted together, find it in the engine's prefix cache; spread over a shard whose
    rows' prefixes do not all fit in the KV cache, each would compute it again. A group is a CRC-32 of each of
    the first ``PREFIX_LEVELS`` bytes the prompt reaches (``rows/prefix.py``; a prompt shorter than a level has no
    group there and keeps the length order). Rows of one expected length (a pipeline-wide ``sampling.max_tokens``)
    and group keep the prompt-length order."""
    budget = r.params.max_tokens if r.params is not None and r.params.max_tokens else default_max_tokens
    data = b""
    if group_prefixes or history is not None:  # no deeper than a level that is read
        data = prompt_bytes(r.text, r.messages, r.prompt_token_ids,
                            PREFIX_LEVELS[-1] if group_prefixes else HISTORY_LEVELS[-1])
    if history is not None:
        g64, g512 = prefix_groups(data, HISTORY_LEVELS)
        budget = history.estimate((g64, g512), budget)
    key = -budget
    if group_prefixes:
        for group in prefix_groups(data):
            key = (key << 32) | group
    return key * _BUDGET_STEP + prompt_chars(r)


def with_idx(body: bytes, idx: int) -> bytes:
    """``{"idx": N, ...body's fields}``: the idx is known only after duplicates are found."""
    return b'{"idx": %d, %s\n' % (idx, body[1:])


class InputScan:
    """Pass 1: every input row validated once; valid rows spooled, row errors written, id hashes kept."""

    def __init__(self, cfg: PipelineConfig, fmt: str, tmp: Path, images: ImageChecker | None = None,
                 history: LengthHistory | None = None):
        self.cfg, self.fmt = cfg, fmt
        self.history = history  # what earlier runs generated (``cache/lengths.py``): the order's first key
        self.images = images or image_checker(cfg, None)
        self.spool_path, self.errors_path = tmp / "spool.tsv", tmp / "errors-rows.tsv"
        self.id_hashes = array("q")   # hash(id) of spooled row i: duplicates are found from these alone
        self.rows_read = 0
        self.capped = 0               # rows whose max_tokens was lowered to sampling.max_tokens_cap
        self.has_references = False
        self.group_prefixes = groups_prefixes(cfg)
        self.reads = ImageReads(tmp / "images-read.jsonl")  # every image file or object the rows read: the plan's key

    def run(self, files: list, first_no: int = 0, day_first: object = None,
            row_groups: tuple[int, int] | None = None) -> None:
        """Scans ``files``, numbered from ``first_no`` in the day's listing (a part of a mapped plan starts
        past 0), whose first file is ``day_first`` (``files[0]`` when None): the one its format was told from.
        ``row_groups``: one Parquet file's row groups [a, b) only (a part of a plan in parts)."""
        read_fmt = "openai_batch" if self.fmt == "openai_batch" else self.cfg.input.format
        day_first = files[0] if day_first is None else day_first
        with open(self.spool_path, "wb") as spool, open(self.errors_path, "wb") as errors, self.reads:
            for file_no, f in enumerate(files, start=first_no):
                self.images.base = str(f.parent)  # a row's relative image paths: from its file's folder
                rows = read_file_rows(f, read_fmt, self.cfg.input, row_groups)
                if file_no and self.cfg.input.format == "auto" and self.fmt in ("jsonl", "openai_batch"):
                    rows = _of_kind(rows, f, day_first, self.fmt)
                # Each file's rows drain before the next file's start: the checker's base is this file's folder
                checked_rows = load_ahead(map(self._parsed, rows), self._image_parts, self._check_part,
                                          self.cfg.input.image_workers)
                for (raw, parsed, parts), images in checked_rows:
                    self.rows_read += 1
                    where = b"%d\t%d\t" % (file_no, raw.line)
                    if raw.error:  # its id where what was read of it names one (else its line names it)
                        errors.write(where + json_bytes({"source": f.name, "line": raw.line, "id": self._raw_id(raw),
                                                     "reason": raw.error}) + b"\n")
                        continue
                    try:
                        if not isinstance(parsed, PromptRow):  # the ValueError that refused it (a read row has one)
                            raise parsed or ValueError("unreadable row")
                        row = self._checked(parsed, parts, images)
                    except ValueError as e:
                        errors.write(where + json_bytes({"source": f.name, "line": raw.line, "id": self._raw_id(raw),
                                                     "reason": str(e)}) + b"\n")
                        continue
                    self.id_hashes.append(id_hash(row.id))
                    self.has_references = self.has_references or bool(row.reference)
                    shard_body = json_bytes(_shard_fields(row))
                    record_body = json_bytes({"id": row.id, "reference": row.reference, "record": raw.record})
                    order = shard_order(row, self.cfg.sampling.max_tokens, self.group_prefixes, self.history)
                    spool.write(b"\t".join((where[:-1], b"%d" % order,
                                            json_bytes(row.id), shard_body, record_body)) + b"\n")

    def _parsed(self, raw: RawRow) -> tuple[RawRow, PromptRow | ValueError | None, list[dict]]:
        """A raw row with its prompt row and that row's image parts, or the ValueError that refused it (None for a
        row that did not read)."""
        if raw.error:
            return raw, None, []
        try:
            row = to_prompt_row(raw, 0, self.cfg.input, self.fmt, self.cfg.engine.task)
        except ValueError as e:
            return raw, e, []
        return raw, row, _image_parts_of(row)

    def _image_parts(self, item: tuple[RawRow, PromptRow | ValueError | None, list[dict]]) -> list[tuple[int, dict]]:
        """The image parts of a row the checks will reach (numbered from 1), for ``load_ahead`` to check on the
        ``input.image_workers`` threads while earlier rows are written, where one of them is in object storage (a
        round trip each; a local or inline image is checked faster than a thread takes it: on the row's turn);
        none for a row refused before its images."""
        parts = item[2]
        if not parts or not any(self._remote(p) for p in parts) or self._images_refusal(len(parts)):
            return []
        return list(enumerate(parts, start=1))

    def _images_refusal(self, n: int) -> str | None:
        """Why a row with ``n`` images is refused before any is checked (an engine that takes none, more than
        ``engine.limit_mm_per_prompt``), or None."""
        e = self.cfg.engine
        if why := takes_no_images(e.kind):
            return f"the row has {n} image(s): {why}"
        limit = (e.limit_mm_per_prompt or {}).get("image")
        if limit is not None and n > limit:
            return f"the row has {n} images; engine.limit_mm_per_prompt allows {limit} per prompt"
        return None

    def _remote(self, part: dict) -> bool:
        """An image_url part that names an object (a URL with a scheme other than data: and file:, or a relative
        path under an input in object storage)."""
        url = (part.get(IMAGE_URL) or {}).get("url") if part["type"] == IMAGE_URL else None
        if not isinstance(url, str) or url.startswith(("data:", "file:")):
            return False
        return "://" in url or "://" in (self.images.base or "")

    def _check_part(self, numbered: tuple[int, dict]) -> ImageRef:
        """One image part checked (``io.images.ImageChecker``: exists, size, format, hash); ImageProblem naming the
        row's n-th image. Runs on the planner's image threads."""
        n, p = numbered
        if p["type"] == IMAGE_BYTES:
            return self.images.check_bytes(p["bytes"], p["name"], where_of(n, p["name"] or "bytes"))
        url = p[IMAGE_URL]["url"]
        return self.images.check(url, where_of(n, url))

    def _checked(self, row: PromptRow, parts: list[dict], images: list | ImageProblem | None = None) -> PromptRow:
        """The row's own parameters under the pipeline's cap, and refused where the engine cannot honor them;
        its images checked (``_with_images``)."""
        if row.params is not None:
            row.params, capped = row.params.capped(self.cfg.sampling.max_tokens_cap)
            self.capped += capped
            why = engine_refusal(row.params, self.cfg.engine.kind)
            if why:
                raise ValueError(why)
        return self._with_images(row, parts, images)

    def _with_images(self, row: PromptRow, parts: list[dict], images: list | ImageProblem | None = None) -> PromptRow:
        """A row's image parts checked and replaced by their content hash, the references kept in ``row.images``;
        a row with an image the engine cannot take, more images than ``engine.limit_mm_per_prompt`` allows, or one
        that fails its check, is refused with the reason. ``parts``: its image parts (``_image_parts_of``);
        ``images``: their checks made ahead (``_check_part``, in order, stopped at the first problem); None: made
        here."""
        if not parts:
            return row
        if why := self._images_refusal(len(parts)):
            raise ValueError(why)
        if isinstance(images, ImageProblem):
            self.reads.note(images.read)
            raise ValueError(str(images))
        made = iter(images) if images is not None else None
        refs, n = [], 0

        def checked(p: dict) -> dict:
            nonlocal n
            if p["type"] not in (IMAGE_URL, IMAGE_BYTES):
                return p
            n += 1
            try:
                ref = next(made) if made is not None else self._check_part((n, p))
            except ImageProblem as problem:
                self.reads.note(problem.read)
                raise ValueError(str(problem)) from None
            if ref.stamp:
                self.reads.note((ref.url, ref.stamp))
            refs.append(ref.to_json())
            return image_part(ref)

        row.messages = [{**m, "content": [checked(p) for p in m["content"]]} if isinstance(m["content"], list) else m
                        for m in row.messages]
        row.images = refs
        return row

    def _raw_id(self, raw) -> str | int | None:
        rid = (raw.record or raw.salvaged or {}).get("custom_id" if self.fmt == "openai_batch"
                                                      else self.cfg.input.id_column)
        return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


def _image_parts_of(row: PromptRow) -> list[dict]:
    return [p for m in row.messages if isinstance(m["content"], list) for p in m["content"]
            if p["type"] in (IMAGE_URL, IMAGE_BYTES)]


def _of_kind(rows: Iterator[RawRow], f, first, fmt: str) -> Iterator[RawRow]:
    """A JSONL file's rows, its first row checked to be of the run's kind, as ``resolve_format`` told the first
    file's (OpenAI Batch lines or prompt rows): told here, from the row the scan reads anyway, not by reading
    every file's start twice."""
    for n, raw in enumerate(rows):
        if n == 0:
            rec = raw.record
            kind = "openai_batch" if isinstance(rec, dict) and "custom_id" in rec and "body" in rec else "jsonl"
            if kind != fmt:
                raise _mixed_formats(f.parent, {fmt: [first.name], kind: [f.name]})
        yield raw


def _mixed_formats(folder, names: dict[str, list[str]]) -> InputFileError:
    listing = "; ".join(f"{kind}: {', '.join(n[:3])}" + (f" and {len(n) - 3} more" if len(n) > 3 else "")
                        for kind, n in sorted(names.items()))
    return InputFileError(f"{folder}: the input holds files of {len(names)} formats ({listing}); a run reads one "
                          f"format and publishes in it: give each format an input folder of its own")


def _shard_fields(r: PromptRow) -> dict:
    row: dict = {"id": r.id, "messages": r.messages}
    if r.prompt_token_ids:
        row["prompt_token_ids"] = r.prompt_token_ids
    if r.text is not None:
        row["text"] = r.text
    if r.params is not None:
        row["params"] = r.params.to_json()
    if r.images:
        row["images"] = r.images
    return row


def image_checker(cfg: PipelineConfig, input_loc: Location | None) -> ImageChecker:
    """The planner's image check for this run: ``input.max_image_bytes`` and ``input.max_image_pixels``; local
    images under the input's own folder (the input path, or the folder of an input file) and
    ``input.image_roots``; object-storage images only in the input's own store (or S3 through its connection),
    read with the input's storage options (``path_policy.RowResources``)."""
    from batch_llm.host import path_policy

    roots = [path_policy.local_path(r) or r for r in cfg.input.image_roots]
    options: dict = {}
    if input_loc is not None:
        options = dict(input_loc.options)
        local = path_policy.local_path(input_loc.url)
        if local is not None:
            roots.insert(0, local if Path(local).is_dir() else str(Path(local).parent))
    stores = path_policy.input_stores(input_loc.url if input_loc is not None else cfg.input.path, cfg.input.conn_id)
    return ImageChecker(max_bytes=cfg.input.max_image_bytes, max_pixels=cfg.input.max_image_pixels, roots=roots,
                        stores=stores, options=options)


def spool_lines(path: Path | UPath) -> Iterator[list[bytes]]:
    """Spool rows as their fields: file_no, line, shard_order, id (JSON), shard body, record body. ``path``: a
    local file, or (a plan in parts) one in the plan's storage, streamed."""
    with path.open("rb") as fh:
        for line in fh:
            yield line.rstrip(b"\n").split(b"\t")


def _find_duplicates(scan: InputScan, files: list, tmp: Path) -> np.ndarray:
    """Spool positions of rows whose id an earlier row has, sorted; their errors go to ``errors-dups.tsv``.

    Equal hashes only make candidates: one pass over the spool compares the candidates' ids, so a hash
    collision never drops a row. Memory: the hash array (8 bytes a row) and the ids of candidate rows."""
    out = tmp / "errors-dups.tsv"
    h = np.frombuffer(scan.id_hashes, dtype=np.int64)
    order = np.argsort(h, kind="stable")
    sh = h[order]
    same = sh[1:] == sh[:-1]
    if not same.any():
        out.write_bytes(b"")
        return np.empty(0, dtype=np.int64)
    member = np.zeros(len(h), dtype=bool)
    member[1:] |= same
    member[:-1] |= same
    candidates = np.sort(order[member])
    first_seen: dict[bytes, tuple[int, int]] = {}
    dups = array("q")
    ptr = 0
    with open(out, "wb") as errors:
        for seq, fields in enumerate(spool_lines(scan.spool_path)):
            if ptr == len(candidates):
                break
            if seq != candidates[ptr]:
                continue
            ptr += 1
            file_no, line, rid = int(fields[0]), int(fields[1]), fields[3]
            first = first_seen.setdefault(rid, (file_no, line))
            if first != (file_no, line):
                dups.append(seq)
                rid_s = json.loads(rid)
                first_at = f"{files[first[0]].name}:{first[1]}"  # the row that keeps the id, to join the two
                errors.write(b"%d\t%d\t" % (file_no, line) + json_bytes({
                    "source": files[file_no].name, "line": line, "id": rid_s, "duplicate_of": first_at,
                    "reason": f"duplicate id {rid_s!r} (first at {first_at})"}) + b"\n")
    return np.frombuffer(dups, dtype=np.int64)


class SortedShardWriter:
    """Writes one shard's rows sorted by (``shard_order``, input position), or in input order when ``sort`` is off,
    in bounded memory: the external sort spills runs of ``SORT_RUN_ROWS`` rows to local files under ``tmp``."""

    def __init__(self, loc: Location, tmp: Path, *, sort: bool):
        self.loc, self.sort = loc, sort
        self.rows: ExternalSort[tuple[int, int, bytes]] = ExternalSort(tmp, run_items=SORT_RUN_ROWS)

    def add(self, order: int, idx: int, line: bytes) -> None:
        # Unsorted, the order is the input position alone: the rows come in that order, so sorting keeps it.
        self.rows.add((order if self.sort else 0, idx, line))

    def close(self) -> None:
        with atomic_writer(self.loc.path()) as w:
            for _, _, line in self.rows.sorted_items():
                w.write(line)


def merged_errors(paths: list[Path | UPath], tmp: Path) -> Iterator[bytes]:
    """Row errors and duplicate errors in input order (file, line), as JSON lines (local files, or in storage)."""
    def items(p: Path | UPath) -> Iterator[tuple[int, int, bytes]]:
        with p.open("rb") as fh:
            for ln in fh:
                file_no, line, body = ln.split(b"\t", 2)
                yield int(file_no), int(line), body

    for _, _, body in merge_sorted([partial(items, p) for p in paths], tmp):
        yield body


def resolve_format(files: list, configured: str, max_line_bytes: int = MAX_LINE_BYTES) -> str:
    """The run's one input format, which it publishes in: ``input.format``, or the first file's (its name, and
    for JSONL its first line: OpenAI Batch lines have ``custom_id`` and ``body``). A folder whose file names
    tell several formats is refused here, before any row is read, naming files of each; JSONL prompt rows
    beside OpenAI Batch files are refused by the scan, at each file's first row (``_of_kind``)."""
    names: dict[str, list[str]] = {}
    for f in files:
        if (kind := SUFFIX_FORMAT.get(f.suffix.lower())) is not None:
            names.setdefault(kind, []).append(f.name)
    if len(names) > 1:
        raise _mixed_formats(files[0].parent, names)
    fmt = detect_format(files[0], configured)
    if fmt == "jsonl" and configured == "auto":
        fmt = sniff_openai_batch(files[0], max_line_bytes) or fmt
    return fmt


def check_openai_batch_task(cfg: PipelineConfig, fmt: str, first_file) -> None:
    """OpenAI Batch input asks for completions (engine.task generate) or embeddings (embed); ValueError for a
    classifier, whose class probabilities no OpenAI endpoint returns."""
    if fmt == "openai_batch" and cfg.engine.task == "classify":
        raise ValueError(f"{first_file}: OpenAI Batch input asks for completions or embeddings; engine.task: "
                         "classify writes class probabilities (give a JSONL, Parquet or CSV table of prompts)")


def write_plan(cfg: PipelineConfig, *, input_loc: Location, plan_dir: Location,
               input_key: str | None = None, history: LengthHistory | None = None) -> PlanManifest:
    """Validates the input and writes shards, records and errors; returns the plan manifest (the shards
    listed for mapping). ``history``: earlier runs' output lengths (``length_history``), the order's first key
    where given."""
    t0 = time.perf_counter()
    files = input_files(input_loc.path())
    fmt = resolve_format(files, cfg.input.format, cfg.input.max_line_bytes)
    check_openai_batch_task(cfg, fmt, files[0])
    with tempfile.TemporaryDirectory(prefix="batch_llm_plan_") as tmp_dir:
        tmp = Path(tmp_dir)
        scan = InputScan(cfg, fmt, tmp, image_checker(cfg, input_loc), history)
        scan.run(files)
        images_read = None
        if scan.reads.count:  # the images are inputs too: the plan's key holds what was read of them
            read_loc = plan_dir.child("images-read.jsonl")
            copy_object(as_path(str(scan.reads.path)), read_loc.path())
            images_read = read_loc.url
            input_key = with_images_key(input_key, scan.reads.digest()) if input_key else None
        dups = _find_duplicates(scan, files, tmp)
        n_valid = len(scan.id_hashes) - len(dups)
        sizes = shard_sizes(n_valid, cfg.sharding, cfg.sampling.max_tokens)
        shards = _write_shards(scan, dups, sizes, plan_dir, tmp, sort=cfg.sharding.sort_by_length,
                               shard_records=cfg.output.parts and cfg.output.table is None)
        errors_loc = plan_dir.child("errors.jsonl")
        n_errors = 0
        with atomic_writer(errors_loc.path()) as w:
            for line in merged_errors([scan.errors_path, tmp / "errors-dups.tsv"], tmp):
                w.write(line)
                n_errors += 1
    manifest = PlanManifest(
        input=input_loc.url, input_files=len(files), format=fmt, rows_read=scan.rows_read, valid=n_valid,
        invalid=n_errors, duplicates=len(dups), capped=scan.capped, errors=errors_loc.url,
        records=plan_dir.child("records.jsonl").url,
        shards=shards, has_references=scan.has_references, seconds=round(time.perf_counter() - t0, 2),
        peak_rss_mb=peak_rss_mb(), input_key=input_key, images_read=images_read,
        order=shard_order_name(cfg, history is not None),
        length_history=history.summary() if history is not None else None)
    manifest.write(plan_dir.path())
    return manifest


def _write_shards(scan: InputScan, dups: np.ndarray, sizes: list[int], plan_dir: Location, tmp: Path, *,
                  sort: bool, shard_records: bool = False) -> list[ShardSpec]:
    """Pass 3: the spool, less duplicates, into records.jsonl and the shard files (contiguous ranges); with
    ``shard_records`` (output.parts) each shard's records also in a file of its own, which its filter task joins
    to its outputs without reading the day's."""
    shards: list[ShardSpec] = []
    bounds = iter(sizes)
    writer: SortedShardWriter | None = None
    own = contextlib.ExitStack()  # the current shard's records file
    own_records = None
    left = 0
    idx = 0
    dup_ptr = 0
    with atomic_writer(plan_dir.child("records.jsonl").path()) as records, own:
        for seq, fields in enumerate(spool_lines(scan.spool_path)):
            if dup_ptr < len(dups) and dups[dup_ptr] == seq:
                dup_ptr += 1
                continue
            if left == 0 or writer is None:  # the shard is full, or this is the first row
                if writer is not None:
                    writer.close()
                own.close()
                left = next(bounds)
                loc = plan_dir.child(f"{shard_name(len(shards))}.jsonl")
                rec_loc = plan_dir.child(f"{shard_name(len(shards))}-records.jsonl") if shard_records else None
                shards.append(ShardSpec(index=len(shards), rows=left, url=loc.url,
                                        records=rec_loc.url if rec_loc is not None else None))
                writer = SortedShardWriter(loc, tmp, sort=sort)
                if rec_loc is not None:
                    own_records = own.enter_context(atomic_writer(rec_loc.path()))
            writer.add(int(fields[2]), idx, with_idx(fields[4], idx))
            line = with_idx(fields[5], idx)
            records.write(line)
            if own_records is not None:
                own_records.write(line)
            idx += 1
            left -= 1
        if writer is not None:
            writer.close()
    return shards


def plan_shards(cfg: PipelineConfig, layout: RunLayout) -> PlanManifest:
    """The run's plan: the committed one while the input files and the settings it was made from are unchanged
    (a retry, a Clear), else a new one (a Clear after late files landed or a file was fixed); its shards carry
    its key, so chunks committed for an earlier plan are not resumed."""
    key = plan_input_key(cfg, layout.input)
    done = PlanManifest.read_if_done(layout.stage("plan").path())
    if done is not None and done.input_key == _key_now(done, key, layout.input.options, cfg.input.image_workers):
        return done
    if done is not None:
        logging.getLogger("batch_llm.stages.plan").info("the input or the plan's settings changed since the run's last "
                                                 "plan: planning again")
    return write_plan(cfg, input_loc=layout.input, plan_dir=layout.stage("plan"), input_key=key,
                      history=length_history(cfg, layout))


def with_images_key(key: str, images_digest: str) -> str:
    """A plan's key once its rows' images are known: the input's key and what was read of the images."""
    from batch_llm.io.identity import stable_hash

    return stable_hash({"input": key, "images": images_digest})


def _key_now(done: PlanManifest, key: str, options: dict, workers: int) -> str | None:
    """The key the committed plan ``done`` would have now: ``key`` (the input files and settings), with its images
    (``images_read``) stamped again where it read any: one image replaced, added where it was missing, or gone
    makes another key, so a Clear plans again."""
    if done.images_read is None:
        return key
    try:
        digest = stamps_digest(Location(done.images_read, options).path(), options, workers)
    except (OSError, ValueError):  # its list unreadable: plan again
        return None
    return with_images_key(key, digest)


def plan_input_key(cfg: PipelineConfig, input_loc: Location) -> str:
    """What a plan is made from: the input files' fingerprints and every setting the planner reads."""
    from batch_llm.io.identity import files_key, stable_hash

    return stable_hash({"files": files_key(input_files(input_loc.path())), **plan_settings(cfg)})


def shard_order_name(cfg: PipelineConfig, history: bool = False) -> str:
    """The order of the rows inside a shard, as the plan manifest names it (``history``: a length history was
    read: the rows' expected lengths come first, not their budgets)."""
    if not cfg.sharding.sort_by_length:
        return "input"
    first = "history" if history else "budget"
    return f"{first}, prefix, length" if groups_prefixes(cfg) else f"{first}, length"


def length_history(cfg: PipelineConfig, layout: RunLayout) -> LengthHistory | None:
    """The pipeline's output-length history where the plan orders by it (``uses_length_history``) and one was
    recorded."""
    if not cfg.sharding.uses_length_history:
        return None
    store = lengths_store(layout.cache_root(cfg), cfg)
    try:
        return LengthHistory.load(store)
    except OSError as e:  # a hint: the store unreachable plans by the budgets, said
        logging.getLogger("batch_llm.stages.plan").warning("length history at %s unreadable (%s): ordering by "
                                                           "output budget", store.url, e)
        return None


def plan_settings(cfg: PipelineConfig) -> dict:
    """Every setting the planner reads, as a plan's key holds them (with the files it read)."""
    settings = cfg.model_dump(mode="json", include={"input", "sharding", "sampling"})
    settings["sharding"].pop("shards_per_task", None)  # how shards are run, not what they hold
    settings["input"].pop("max_decoded_bytes_ahead", None)  # how a shard loads its images, likewise
    settings["sharding"].pop("group_prefixes", None)  # its effect, below (it follows the engine where unset)
    # Only the order of a shard's rows, from a history that changes with every run: a committed plan is kept
    # (resumed, not redone) whatever was generated since; turned on or off by hand, it plans again
    settings["sharding"].pop("length_history", None)
    key: dict[str, object] = {"settings": settings, "task": cfg.engine.task}
    if groups_prefixes(cfg):  # rows ordered by prefix (keys before it stay the same)
        key["group_prefixes"] = True
    if cfg.sharding.length_history is not None:
        key["length_history"] = cfg.sharding.length_history
    if cfg.engine.limit_mm_per_prompt is not None:  # which rows' images are too many (keys before it stay the same)
        key["image_limit"] = cfg.engine.limit_mm_per_prompt
    if cfg.output.parts and cfg.output.table is None:  # the plan writes each shard's records too
        key["shard_records"] = True
    return key
