"""``batch-llm run-batch``: vLLM's ``vllm run-batch`` command line on the pipeline, no YAML needed.

::

    batch-llm run-batch -i requests.jsonl -o results.jsonl --model Qwen/Qwen2.5-7B-Instruct --max-model-len 8192

The flags are vLLM's (``vllm run-batch --help``: its batch frontend's and the main engine arguments), spelled with
``-`` or ``_`` as vLLM takes them; ``FLAGS`` says what each becomes (a key of the pipeline YAML, or a setting of
this command). A flag that is not in ``FLAGS`` is an error naming it. The command builds one ``PipelineConfig``
(one shard, no content filter, no scoring: ``vllm run-batch`` does neither), writes it as a pipeline YAML in the work
folder, runs it through ``batch-llm run``'s own function and writes ``-o`` as vLLM does: one OpenAI Batch output line
per input line, in input order, a refused request as its error line (status 400) among them.

A request that sets no sampling parameter gets vLLM's defaults, not the pipeline's: the model's
``generation_config.json`` values (``--generation-config auto``, vLLM's default) or vLLM's own (``vllm``:
temperature 1, the rest of the context as max_tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from batch_llm.config import ConfigError, InputConfig, PipelineConfig, parse_config, require_engine_installed
from batch_llm.config.capabilities import DEFAULT_KIND
from batch_llm.frontends.written_config import keep_work_folder, run_written_config
from batch_llm.host import path_policy
from batch_llm.rows.openai_batch import ErrorLine, OutputLine, answer_line, line_dict

PIPELINE_NAME = "run_batch"
#: The sampling defaults a model's generation_config.json may set (vLLM's get_diff_sampling_param) and the
#: sampling key each one is here; presence/frequency penalties are per request only here.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class RunBatchFlag:
    """One flag of ``vllm run-batch``: the YAML key it sets (None: a setting of this command), argparse's
    keyword arguments, and what it does here."""

    names: tuple[str, ...]
    key: str | None
    how: str = ""
    kwargs: dict = field(default_factory=dict)


def _f(names, key=None, how="", **kwargs) -> RunBatchFlag:
    return RunBatchFlag(tuple(names), key, how, kwargs)


_ON_OFF = argparse.BooleanOptionalAction
RUNNERS, CONVERTS = ("auto", "generate", "pooling"), ("auto", "none", "embed", "classify")  # vLLM's, less draft
FLAGS: tuple[RunBatchFlag, ...] = (
    _f(("-i", "--input-file"), "input.path", "the OpenAI Batch input (a local file or an object-storage URL)",
       required=True),
    _f(("-o", "--output-file"), None, "the output, a local file: one line per input line, in input order",
       required=True),
    _f(("--output-tmp-dir",), None, "no effect: the output is written to -o directly"),
    _f(("--model",), "model.ref", "a local model folder, a ModelScope id or an object-storage prefix", required=True),
    _f(("--revision",), "model.revision"),
    _f(("--tokenizer",), None, "the model's own tokenizer only (given: must be the --model folder)"),
    _f(("--served-model-name",), None, "the model name written in every response (default: --model)", nargs="+"),
    _f(("--trust-remote-code",), "model.trust_remote_code", action="store_true"),
    _f(("--chat-template",), "model.chat_template", "a template file, or the template itself"),
    _f(("--generation-config",), None, "auto (default): a request's unset sampling parameters come from the "
       "model's generation_config.json, as vLLM does; vllm: vLLM's own defaults", default="auto"),
    _f(("--runner",), None, "pooling: the model embeds (engine.task: embed; /v1/embeddings lines, as --convert "
       "embed); generate or auto (default): it generates (engine.task: generate)", choices=RUNNERS),
    _f(("--convert",), None, "embed: vLLM's pooling runner turns the model into an embedding model (engine.task: "
       "embed: /v1/embeddings lines); none or auto (default): as --runner says; classify is refused (class "
       "probabilities have no OpenAI endpoint: batch-llm run with engine.task: classify)", choices=CONVERTS),
    _f(("--max-model-len",), "engine.max_model_len", type=int),
    _f(("--dtype",), "engine.dtype"),
    _f(("-tp", "--tensor-parallel-size"), "engine.tensor_parallel_size", type=int),
    _f(("--gpu-memory-utilization",), "engine.gpu_memory_utilization", type=float),
    _f(("--max-num-seqs",), "engine.max_num_seqs", type=int),
    _f(("--max-num-batched-tokens",), "engine.extra.max_num_batched_tokens", type=int),
    _f(("--enforce-eager",), "engine.enforce_eager", action=_ON_OFF),
    _f(("--enable-prefix-caching",), "engine.enable_prefix_caching", action=_ON_OFF),
    _f(("-q", "--quantization"), "engine.quantization"),
    _f(("--kv-cache-dtype",), "engine.kv_cache_dtype"),
    _f(("--seed",), "sampling.seed", "the seed of a request that sets none", type=int),
    _f(("--reasoning-parser",), "engine.reasoning_parser", "vLLM's reasoning parser: each answer's thinking as its "
       "message's reasoning_content (default: none, as vLLM: the whole output is the content)"),
    _f(("--enable-metrics",), None, "no effect: the run's metrics are in its summary (and a Pushgateway's, "
       "BATCH_LLM_PUSHGATEWAY_URL)", action="store_true"),
    _f(("--disable-log-stats",), None, "no effect: progress lines are the pipeline's", action="store_true"),
)
OWN = {"--work-dir": "a folder for the run (kept: its report, its pipeline.yaml, the result cache; default: a "
                     "temporary folder, removed at the end)",
       "--plain": "plain progress lines even on a terminal", "--verbose": "the engine libraries' logs (-v)",
       "--print-config": "print the pipeline YAML the flags make, and stop"}


def add_run_batch_parser(sub, commands: dict, run: Callable[[argparse.Namespace], int]) -> None:
    """Registers ``batch-llm run-batch`` on cli.py's subparsers; ``commands["run-batch"]`` runs it through ``run``
    (cli.py's cmd_run, passed in so that this module does not import cli)."""
    sp = sub.add_parser("run-batch", help="vLLM's `vllm run-batch` flags (-i IN -o OUT --model M ...): an OpenAI "
                        "Batch file through the pipeline, no YAML (docs/user-guide.md)", allow_abbrev=False)
    for f in FLAGS:
        # vLLM's parser takes --max_model_len as --max-model-len: both spellings
        spellings = [*f.names, *("--" + n[2:].replace("-", "_") for n in f.names if n.startswith("--") and "-" in n[2:])]
        sp.add_argument(*spellings, dest=_dest(f), help=f.how or (f"sets {f.key}" if f.key else None), **f.kwargs)
    sp.add_argument("--work-dir", help=OWN["--work-dir"])
    sp.add_argument("--plain", action="store_true", help=OWN["--plain"])
    sp.add_argument("-v", "--verbose", action="store_true", help=OWN["--verbose"])
    sp.add_argument("--print-config", action="store_true", help=OWN["--print-config"])
    commands["run-batch"] = lambda args: cmd_run_batch(args, run)


def _dest(f: RunBatchFlag) -> str:
    return f.names[-1].lstrip("-").replace("-", "_")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted YAML keys the flags set (``FLAGS``), for the flags given."""
    over: dict[str, Any] = {}
    for f in FLAGS:
        value = getattr(args, _dest(f), None)
        if f.key is None or value is None or (value is False and f.kwargs.get("action") == "store_true"):
            continue
        if f.key == "model.chat_template" and os.path.isfile(os.path.expanduser(value)):
            value = Path(os.path.expanduser(value)).read_text(encoding="utf-8")
        elif f.key in ("model.ref", "input.path") and os.path.exists(os.path.expanduser(value)):
            value = os.path.abspath(os.path.expanduser(value))
        over[f.key] = value
    return over


def base_config(work_dir: Path, *, keep: bool) -> dict[str, Any]:
    """What every ``batch-llm run-batch`` starts from: OpenAI Batch input, one shard, no content filter and no
    scoring (vLLM does neither), refusals as error lines rather than a failed run, the result cache only in a
    kept work folder, no reasoning parser unless --reasoning-parser names one (as vLLM)."""
    return {"name": PIPELINE_NAME, "description": "batch-llm run-batch (vLLM's vllm run-batch flags)",
            "model": {"ref": "unset"}, "input": {"path": "unset", "format": "openai_batch", "sampling_columns": []},
            "sharding": {"num_shards": 1}, "filter": {"enabled": False}, "evaluate": {"enabled": False},
            "engine": {"max_error_rate": 1.0, "reasoning_parser": None}, "cache": {"enabled": keep},
            "output": {"path": str(work_dir / "output")}}


def sampling_defaults(generation: dict, max_model_len: int | None, *, source: str) -> tuple[dict[str, Any], list[str]]:
    """The sampling section of a request that sets nothing, as vLLM's: temperature 1 and the rest of the context
    (max_model_len) as max_tokens, under the model's generation_config.json values (``generation``; {} for
    --generation-config vllm). Returns (dotted overrides, warnings for values not applied)."""
    over: dict[str, Any] = {"sampling.temperature": 1.0}
    if max_model_len:
        over["sampling.max_tokens"] = max_model_len
    warnings = []
    for name, value in generation.items():
        if value is None:
            continue
        if name in GENERATION_CONFIG_KEYS:
            over[f"sampling.{GENERATION_CONFIG_KEYS[name]}"] = value
        elif name in ("presence_penalty", "frequency_penalty"):
            warnings.append(f"{source}: {name} {value} is not a default here; requests set it in their body")
    return over, warnings


def generation_config(model_dir: str) -> dict[str, Any]:
    """The sampling values of a model folder's generation_config.json that differ from transformers' defaults
    (what vLLM's ``--generation-config auto`` applies): {} without the file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    from transformers import GenerationConfig

    diff = GenerationConfig.from_pretrained(model_dir).to_diff_dict()
    return {k: diff[k] for k in (*GENERATION_CONFIG_KEYS, "presence_penalty", "frequency_penalty") if k in diff}


def build_config(args: argparse.Namespace, work_dir: Path, *, keep: bool) -> tuple[PipelineConfig, list[str]]:
    """The pipeline of the command line (its model fetched when it is not on this machine yet, to read its
    generation_config.json) and the warnings to print."""
    if args.tokenizer and os.path.abspath(os.path.expanduser(args.tokenizer)) != os.path.abspath(
            os.path.expanduser(args.model)) and args.tokenizer != args.model:
        raise ConfigError(f"--tokenizer {args.tokenizer}: the model's own tokenizer is used (--model {args.model})")
    task = engine_task(args.runner, args.convert)
    over = {**overrides(args), "engine.task": task}
    if task == "embed":  # a vector has no sampling: no defaults to give, and a seed does nothing
        over.pop("sampling.seed", None)
    cfg = parse_config(base_config(work_dir, keep=keep), "batch-llm run-batch")
    cfg = cfg.with_overrides(over, source="batch-llm run-batch (vLLM flags)")
    if task == "embed":
        return cfg, ["--seed: no effect on embeddings"] if args.seed is not None else []
    generation: dict[str, Any] = {}
    if args.generation_config == "auto":
        generation = generation_config(_model_folder(cfg))
    elif args.generation_config != "vllm":  # vLLM's third form: a folder holding a generation_config.json
        generation = generation_config(os.path.expanduser(args.generation_config))
    defaults, warnings = sampling_defaults(generation, cfg.engine.max_model_len,
                                           source=f"--generation-config {args.generation_config}")
    if args.seed is not None:
        defaults["sampling.seed"] = args.seed
    return cfg.with_overrides(defaults, source="batch-llm run-batch (sampling defaults)"), warnings


def engine_task(runner: str | None, convert: str | None) -> str:
    """engine.task of vLLM's ``--runner`` / ``--convert``: embed for the pooling runner (the model converted to an
    embedding model), else generate; ConfigError for what an OpenAI Batch file cannot ask of a model."""
    if convert == "classify":
        raise ConfigError("--convert classify: class probabilities have no OpenAI Batch endpoint; run a table of "
                          "prompts with batch-llm run and engine.task: classify")
    if convert == "embed" and runner == "generate":
        raise ConfigError("--convert embed runs on the pooling runner; --runner generate generates text")
    return "embed" if convert == "embed" or runner == "pooling" else "generate"


def _model_folder(cfg: PipelineConfig) -> str:
    from batch_llm.stages.fetch import resolve_ref

    return resolve_ref(cfg.model.ref, cfg.model.revision, cfg.model.resolved_cache_dir(), None)[1]


def cmd_run_batch(args: argparse.Namespace, run: Callable[[argparse.Namespace], int]) -> int:
    # -o is checked before any work (the model's fetch included): a run whose output cannot be written is lost
    if not args.print_config and (problem := path_policy.output_file_problem(args.output_file, (args.input_file,))):
        raise ConfigError(f"-o {problem}")
    if not args.print_config:  # before the model's fetch: the engine (vLLM's, as vllm run-batch) must be here
        require_engine_installed(DEFAULT_KIND, chosen_by="run-batch: engine.kind")
    keep = args.work_dir is not None
    work = Path(os.path.abspath(os.path.expanduser(args.work_dir))) if keep else \
        Path(tempfile.mkdtemp(prefix="batch-llm-run-batch-"))
    started = finished = False
    try:
        work.mkdir(parents=True, exist_ok=True)
        cfg, warnings = build_config(args, work, keep=keep)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        for f in FLAGS:
            if f.key is None and f.how.startswith("no effect") and getattr(args, _dest(f), None) not in (None, False):
                print(f"note: {f.names[-1]}: {f.how}", file=sys.stderr)
        config_path = work / "pipeline.yaml"
        config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True))
        if args.print_config:
            print(config_path.read_text(), end="")
            return 0
        started = True
        rc, ds = run_written_config(config_path, run, args, run_prefix="run_batch", plain=args.plain,
                                    verbose=args.verbose, temporary=not keep)
        if rc != 0:
            return rc
        name = args.served_model_name[0] if args.served_model_name else args.model
        n, failed = write_output(args.output_file, cfg, ds, served_model_name=name)
        print(f"output: {args.output_file} ({n} lines, {failed} refused or failed)")
        if not keep and (report := keep_report(cfg, ds, args.output_file)) is not None:
            print(f"  report: {report} (--work-dir keeps the whole run)")
        finished = True
        return 0
    finally:
        keep_work_folder(work, keep=keep, started=started, finished=finished)


def write_output(path: str, cfg: PipelineConfig, ds: str, *, served_model_name: str) -> tuple[int, int]:
    """``-o``: the run's published lines and error lines, one per input line in input order (as ``vllm
    run-batch`` writes them); (lines, error lines)."""
    from batch_llm.io.storage import Location, as_path, atomic_writer, iter_jsonl, read_json
    from batch_llm.stages.publish import published_lines

    part = Location(cfg.output.path).child(cfg.name, cfg.output.partition.format(ds=ds))
    current = read_json(part.child("_CURRENT.json").path())
    summary = read_json(Location(current["version"]).child("summary.json").path())
    done: dict[Any, list[OutputLine | ErrorLine]] = {}
    for data in published_lines(summary["dataset"]):
        line = answer_line(data)
        if isinstance(line, OutputLine):
            line.response.body["model"] = served_model_name
        done.setdefault(_key(line.custom_id), []).append(line)
    refused: dict[Any, list[OutputLine | ErrorLine]] = {}
    for data in iter_jsonl(Location(summary["errors"]).path()):
        line = answer_line(data)
        refused.setdefault(_key(line.custom_id), []).append(line)
    from batch_llm.io.formats import input_files

    n = n_errors = 0
    with atomic_writer(as_path(os.path.abspath(os.path.expanduser(path)))) as w:
        for x in in_input_order(input_files(Location(cfg.input.path).path()), done, refused, cfg.input):
            w.write((json.dumps(line_dict(x), ensure_ascii=False) + "\n").encode("utf-8"))
            n += 1
            n_errors += isinstance(x, ErrorLine)
    return n, n_errors


_Line = TypeVar("_Line")  # an answer line: typed (OutputLine, ErrorLine) or as read


def keep_report(cfg: PipelineConfig, ds: str, output_file: str) -> Path | None:
    """The run's report (one self-contained HTML file) copied out of the temporary work folder, beside ``-o``
    (``results.jsonl`` -> ``results.report.html``), so that it outlives the command; None where the run wrote
    none."""
    from batch_llm.analysis.report import REPORT_NAME
    from batch_llm.io.storage import Location, exists, read_json

    part = Location(cfg.output.path).child(cfg.name, cfg.output.partition.format(ds=ds))
    report = Location(read_json(part.child("_CURRENT.json").path())["version"]).child(REPORT_NAME).path()
    if not exists(report):
        return None
    out = Path(os.path.abspath(os.path.expanduser(output_file)))
    kept = out.with_name(f"{out.stem if out.suffix else out.name}.report.html")
    kept.write_bytes(report.read_bytes())
    return kept


def _key(custom_id: Any) -> str | None:
    """A custom_id as the lines of every stage carry it (an integer id and its text are one request)."""
    return str(custom_id) if isinstance(custom_id, (str, int)) and not isinstance(custom_id, bool) else None


def in_input_order(files: list, done: dict[Any, list[_Line]], refused: dict[Any, list[_Line]],
                   input_cfg: InputConfig | None = None) -> Iterator[_Line]:
    """Each input line's answer in turn: its published line, else its error line; whatever is left over (none,
    where every line was read once) after them. The lines are read by the planner's own reader (``input_cfg``: its
    line limit), so each line's custom_id is the one its answer carries: a line that is not valid UTF-8 JSON text (a
    lone surrogate, raw bytes that are not UTF-8) by the custom_id still readable in it, else by none (a line past
    ``input.max_line_bytes`` too: its error line names its line number; those are answered in input order)."""
    from batch_llm.config.input import MAX_LINE_BYTES
    from batch_llm.io.formats import Lines, read_file_rows

    for f in files:
        for row in read_file_rows(f, "openai_batch", input_cfg or Lines(MAX_LINE_BYTES)):
            cid = _key((row.record or row.salvaged or {}).get("custom_id"))
            for source in (done, refused):
                if source.get(cid):
                    yield source[cid].pop(0)
                    break
    for source in (done, refused):
        for rest in source.values():
            yield from rest
