"""The pipeline model, ``PipelineConfig`` (every section, and the checks that span sections), and its loading into
one validated config from a YAML file (``load_config``), a mapping (``parse_config``) or dotted-key overrides
(``apply_overrides``). A pipeline's YAML file, Airflow Params and CLI flags all fill it.

Every stage takes the section it needs (``ModelConfig`` for fetch, ``EngineConfig`` + ``SamplingConfig`` for
inference, ...), so a value set in the YAML file reaches the engine unchanged. Validation errors name the
file and the dotted key::

    pipelines/daily.yaml: engine.gpu_memory_utilization: Input should be less than or equal to 1
    pipelines/daily.yaml: sampling.max_token: unknown key 'max_token' in section 'sampling'; did you mean 'max_tokens'?
"""
from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from batch_llm.config.airflow import AirflowConfig
from batch_llm.config.cache import CacheConfig
from batch_llm.config.capabilities import EXTRA_SAMPLING_KEYS, EngineCapabilities, engines_serving, takes_no_images, who_can
from batch_llm.config.engine import EngineConfig
from batch_llm.config.evaluate import EvaluateConfig
from batch_llm.config.filter import FilterConfig, word_list_problems
from batch_llm.config.input import SHARD_SIZES, InputConfig, ShardingConfig
from batch_llm.config.model import ModelConfig, QuantizeConfig
from batch_llm.config.openai_batch import TASK_ENDPOINTS, OpenAIBatchConfig, with_task_endpoints
from batch_llm.config.output import OutputConfig
from batch_llm.config.sampling import SamplingConfig
from batch_llm.config.section import ConfigError, Section
from batch_llm.host import path_policy


class PipelineConfig(Section):
    name: str
    description: str = ""
    model: ModelConfig
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    input: InputConfig
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    filter: FilterConfig = Field(default_factory=FilterConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    output: OutputConfig
    cache: CacheConfig = Field(default_factory=CacheConfig)
    airflow: AirflowConfig = Field(default_factory=AirflowConfig)
    openai_batch: OpenAIBatchConfig | None = Field(None, description="The OpenAI Batch API's model names and "
                                                   "endpoints this pipeline serves (docs/openai-batch-api.md); "
                                                   "null: none")

    @field_validator("name")
    @classmethod
    def _dag_id_safe(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise ValueError("use letters, digits, '_', '.' or '-' (it becomes the DAG id)")
        if not v.strip("."):  # '.' or '..' as a folder under output.path would be that folder or its parent
            raise ValueError(f"{v!r} is a path, not a name: use at least one letter, digit, '_' or '-'")
        return v

    @model_validator(mode="before")
    @classmethod
    def _batch_endpoints_default_to_the_task(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("openai_batch"), dict):
            engine = data.get("engine")
            task = engine.get("task") if isinstance(engine, dict) else getattr(engine, "task", None)
            data = {**data, "openai_batch": with_task_endpoints(data["openai_batch"], task or "generate")}
        return data

    @model_validator(mode="after")
    def _batch_endpoints_of_the_task(self) -> "PipelineConfig":
        if self.openai_batch is not None and (problem := self.openai_batch.endpoint_problem(self.engine.task)):
            raise ValueError(problem)
        urls = self.input.openai_urls or ()
        wrong = [u for u in urls if u not in TASK_ENDPOINTS[self.engine.task]]
        if wrong:
            raise ValueError(f"input.openai_urls: {', '.join(wrong)} not answered by engine.task {self.engine.task} "
                             f"(it answers {', '.join(TASK_ENDPOINTS[self.engine.task]) or 'no OpenAI endpoint'})")
        return self

    @model_validator(mode="after")
    def _mapped_plan_writes_shard_records(self) -> "PipelineConfig":
        if self.sharding.plan_part_bytes is None:
            return self
        if not self.output.parts:  # its records are each shard's own: no task writes the day's records file
            raise ValueError("sharding.plan_part_bytes: a plan in parts writes each shard's records beside the "
                             "shard, which only output.parts publishes from: set output.parts: true")
        if self.sharding.num_shards:
            raise ValueError("sharding.plan_part_bytes: shards are cut within each part; give rows_per_shard "
                             "instead of num_shards")
        return self

    @model_validator(mode="after")
    def _guided_decoding_needs_vllm(self) -> "PipelineConfig":
        s = self.sampling
        if s.output_schema is not None and s.guided_decoding and not self.engine.caps.guided_decoding:
            raise ValueError(f"sampling.output_schema: engine {self.engine.kind} cannot decode under a schema "
                             f"({who_can('guided_decoding')}); set sampling.guided_decoding: false to only check "
                             "the outputs")
        return self

    @model_validator(mode="after")
    def _samples_need_vllm(self) -> "PipelineConfig":
        s = self.sampling
        asked = [k for k, on in (("n", s.n > 1), ("logprobs", s.logprobs is not None)) if on]
        if asked and not self.engine.caps.samples_and_logprobs:
            raise ValueError(f"sampling.{' and sampling.'.join(asked)}: engine {self.engine.kind} returns one "
                             f"sample without log-probabilities ({who_can('samples_and_logprobs')}); remove "
                             f"{' and '.join('sampling.' + k for k in asked)} or set engine.kind: "
                             f"{engines_serving('samples_and_logprobs')}")
        return self

    @model_validator(mode="after")
    def _sampling_keys_the_engine_applies(self) -> "PipelineConfig":
        s, caps = self.sampling, self.engine.caps
        defaults = type(s).model_fields
        given = [k for k in sorted(EXTRA_SAMPLING_KEYS) if getattr(s, k) != defaults[k].get_default(
            call_default_factory=True)]
        lacking = [k for k in given if k not in caps.sampling_keys]
        problems = []
        for key in lacking:
            def applies(c: EngineCapabilities, key: str = key) -> bool:
                return key in c.sampling_keys

            problems.append(f"sampling.{key}: engine {self.engine.kind} does not apply it ({who_can(applies)}); "
                            f"remove sampling.{key} or set engine.kind: {engines_serving(applies)}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _image_columns_need_images(self) -> "PipelineConfig":
        """Every row of a table with image columns would be refused: said once, here (a JSONL row's own image
        parts on such an engine are its error, naming the engines that take images)."""
        e = self.engine
        if self.input.image_columns and (why := takes_no_images(e.kind)):
            raise ValueError(f"input.image_columns: {why}")
        if self.input.image_columns and e.task != "generate":
            raise ValueError(f"input.image_columns: engine.task {e.task} is not tested with images; use "
                             "engine.task: generate")
        return self

    @model_validator(mode="after")
    def _review_needs_text(self) -> "PipelineConfig":
        if self.filter.review is not None and self.filter.review.enabled and self.engine.task != "generate":
            raise ValueError(f"filter.review: engine.task {self.engine.task} writes no text to review; remove "
                             "filter.review or set filter.review.enabled: false")
        return self

    @model_validator(mode="after")
    def _reasoning_needs_a_parser(self) -> "PipelineConfig":
        """A reasoning parser and a thinking budget are vLLM's (the capability table's ``reasoning``): named on
        another engine they are refused, never dropped; a budget needs the parser that finds the thinking."""
        e, s = self.engine, self.sampling
        problems = []
        if e.reasoning_parser not in ("auto", None) and not e.caps.reasoning:
            problems.append(f"engine.reasoning_parser: engine {e.kind} has no reasoning parser ({who_can('reasoning')}"
                            f"); remove it (the output is then the model's whole text) or set engine.kind: "
                            f"{engines_serving('reasoning')}")
        if s.max_thinking_tokens is not None:
            if not e.caps.reasoning:
                problems.append(f"sampling.max_thinking_tokens: engine {e.kind} has no thinking budget "
                                f"({who_can('reasoning')}); remove it or set engine.kind: {engines_serving('reasoning')}")
            elif e.reasoning_parser is None:
                problems.append("sampling.max_thinking_tokens: a thinking budget needs the reasoning parser that "
                                "finds the thinking; engine.reasoning_parser is null (set it, or auto)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _template_kwargs_are_template_variables(self) -> "PipelineConfig":
        """``sampling.chat_template_kwargs`` keys the chat template reads, where the template is known when the
        config loads (``model.chat_template``, or a local model folder's); a model fetched later is checked by
        the fetch stage (``stages.infer.identity.reasoning_problems``), before any engine starts."""
        if not self.sampling.chat_template_kwargs:
            return self
        from batch_llm.host.probes import model_chat_template
        from batch_llm.reasoning import template_kwargs_problem

        template, where = self.model.chat_template, "model.chat_template"
        ref = path_policy.resolve(self.model.ref)
        if not template and ref.is_local and ref.local_path and os.path.isdir(ref.local_path):
            template, where = model_chat_template(ref.local_path), f"the model's, at {ref.local_path}"
        if problem := template_kwargs_problem(self.sampling.chat_template_kwargs, template, where):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _pooling_tasks_take_no_generation_settings(self) -> "PipelineConfig":
        task = self.engine.task
        if task == "generate":
            return self
        s = self.sampling
        # settings that would silently do nothing are refused, like an unknown key
        defaults = type(s).model_fields
        given = [k for k, on in (("output_schema", s.output_schema is not None), ("n", s.n > 1),
                                 ("logprobs", s.logprobs is not None), ("output_retries", s.output_retries > 0),
                                 ("max_thinking_tokens", s.max_thinking_tokens is not None)) if on] \
            + [k for k in sorted(EXTRA_SAMPLING_KEYS) if getattr(s, k) != defaults[k].get_default(
                call_default_factory=True)]
        # template variables (thinking too) still shape the prompt a pooling task reads
        cols = [c for c in self.input.sampling_columns
                if c not in ("max_tokens", "chat_template_kwargs", "thinking", "reasoning_effort")]
        problems = [f"sampling.{k}" for k in given] + [f"input.sampling_columns: {c}" for c in cols]
        if problems:
            raise ValueError(f"{', '.join(problems)}: generation settings; engine.task: {task} generates no "
                             "text (remove them)")
        if self.model.lora is not None and not self.model.lora.merge:
            raise ValueError(f"model.lora.merge: false: a served adapter is not tested with engine.task: {task}; "
                             "set model.lora.merge: true (the adapter is merged into the model at fetch)")
        return self

    @model_validator(mode="after")
    def _served_adapter_needs_vllm(self) -> "PipelineConfig":
        lora = self.model.lora
        if lora is not None and not lora.merge and not self.engine.caps.lora_served:
            raise ValueError(f"model.lora.merge: false serves the adapter unmerged, which engine {self.engine.kind} "
                             f"cannot ({who_can('lora_served')}); set model.lora.merge: true to merge it into the "
                             "model at fetch")
        return self

    def with_overrides(self, overrides: Mapping[str, Any], source: str = "params") -> "PipelineConfig":
        """A copy with dotted-key overrides applied (``{"sampling.temperature": 0.7}``), validated again; this
        config itself where they change nothing (a trigger form left as the pipeline has it), not validated twice."""
        data = apply_overrides(self.model_dump(), overrides)
        return self if data == self.model_dump() else parse_config(data, source)


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a config as a mapping) with dotted-key overrides set in it, the two shard sizes as
    ``ShardingConfig.size_changes`` takes them; validated by whoever parses the result, once."""
    overrides = dict(overrides)
    sizes = {k: overrides[f"sharding.{k}"] for k in SHARD_SIZES if f"sharding.{k}" in overrides}
    current = data.get("sharding") or {}
    overrides.update({f"sharding.{k}": v for k, v in ShardingConfig.size_changes(current, sizes).items()})
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


class ConfigDump(dict[str, Any]):
    """A validated config's JSON dump (what an operator's argument carries into the serialized DAG) that keeps
    the config it was made from, so that an operator made in the same process (the DAG file's parse in a task's
    process) takes that config instead of validating the dump again. A copy that lost it (JSON, a plain dict) is
    parsed as any dump. Not to be changed: change the config (``with_overrides``) and dump that."""

    def __init__(self, config: PipelineConfig):
        super().__init__(config.model_dump(mode="json"))
        self.config = config


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = _unknown_key(e["loc"]) if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{source}: {key}: {msg}")
    return "\n".join(lines)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config model a field holds (itself, a list's items, an optional's value)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if found := _model_in(arg):
            return found
    return None


def _section_model(parents: tuple) -> type[BaseModel] | None:
    cls: type[BaseModel] | None = PipelineConfig
    for part in parents:
        if isinstance(part, int):  # a list's item: the list's field already gave its model
            continue
        field = cls.model_fields.get(part) if cls else None
        cls = _model_in(field.annotation) if field else None
    return cls


def _unknown_key(loc: tuple) -> str:
    """A typo'd key: where it is, the closest valid key of that section, or where a key of that name lives."""
    *parents, name = loc
    section = ".".join(str(p) for p in parents)
    where = f"in section {section!r}" if section else "at the top level"
    cls = _section_model(tuple(parents))
    if cls is None:
        return f"unknown key {name!r} {where}"
    valid = list(cls.model_fields)
    close = difflib.get_close_matches(str(name), valid, n=1)
    if close:
        return f"unknown key {name!r} {where}; did you mean {close[0]!r}?"
    elsewhere = [s for s, f in PipelineConfig.model_fields.items()
                 if (m := _model_in(f.annotation)) and name in m.model_fields and m is not cls]
    if elsewhere:
        return f"unknown key {name!r} {where}; it is a key of section {elsewhere[0]!r} ({elsewhere[0]}.{name})"
    return f"unknown key {name!r} {where}; the keys there: {', '.join(valid)}"


def parse_config(data: Any, source: str = "<config>") -> PipelineConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def load_config(path: str | os.PathLike) -> PipelineConfig:
    """Reads and validates one pipeline YAML file. Relative paths inside it resolve against its folder.

    Local word-list files are checked here, so a missing one stops the run before any inference (lists in
    object storage are checked when the filter stage starts)."""
    path = Path(path)
    try:  # bounded: a huge file, a device or an alias bomb costs one line, not the memory of whoever loads it
        data = path_policy.load_yaml(path_policy.read_local_bounded(str(path), path_policy.MAX_PIPELINE_FILE_BYTES)
                                     .decode("utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:  # path_policy.PathRefused, or the YAML expands too far
        raise ConfigError(f"{path}: {e}") from None
    if isinstance(data, dict):
        data = _resolve_relative_paths(data, path.parent)
    cfg = parse_config(data, str(path))
    problems = word_list_problems(cfg.filter) if cfg.filter.enabled else []
    if problems:
        raise ConfigError("\n".join(f"{path}: {p}" for p in problems))
    return cfg


_PATH_KEYS = (("input", "path"), ("output", "path"), ("model", "ref"), ("model", "cache_dir"),
              ("cache", "path"), ("quantize", "cache_dir"), ("sampling", "output_schema"))


def _resolve_relative_paths(data: dict, base: Path) -> dict:
    def fix(value: Any) -> Any:
        if isinstance(value, str) and value.startswith(("./", "../")):
            return str((base / value).resolve())
        return value

    for section, key in _PATH_KEYS:
        if isinstance(data.get(section), dict) and key in data[section]:
            data[section][key] = fix(data[section][key])
    for wl in (data.get("filter") or {}).get("lists") or []:
        if isinstance(wl, dict) and "path" in wl:
            wl["path"] = fix(wl["path"])
    roots = (data.get("input") or {}).get("image_roots") if isinstance(data.get("input"), dict) else None
    if isinstance(roots, list):
        data["input"]["image_roots"] = [fix(r) for r in roots]
    review = (data.get("filter") or {}).get("review")
    if isinstance(review, dict) and isinstance(review.get("model"), dict):
        for key in ("ref", "cache_dir"):
            if key in review["model"]:
                review["model"][key] = fix(review["model"][key])
    return data
