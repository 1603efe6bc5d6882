"""The pipeline's configuration: the one model a YAML file, Airflow Params and CLI flags fill, and the tables it
checks against. Nothing here imports an engine, a stage or a file format.

- ``pipeline``: ``PipelineConfig`` (every section, and the checks that span sections), loading (``load_config``,
  ``parse_config``), overrides (``apply_overrides``) and the errors that name the file and the dotted key
- ``section``: the base of every section (an unknown key is an error) and ``ConfigError``
- one module per section, each with the constants it checks against: ``model`` (model, its LoRA adapter, quantize),
  ``input`` (input, sharding), ``engine`` (engine, memory back-off, speculative decoding, the embed and classify
  tasks), ``sampling`` (sampling and the bounds a row's own values are held to), ``filter`` (word lists, review),
  ``evaluate``, ``output`` (output, table, catalog), ``cache``, ``airflow``
- ``capabilities``: the engine capability table (who serves guided JSON, n > 1, logprobs, LoRA, ...)
- ``sglang``: the ``engine.sglang`` section, SGLang's own settings
- ``precision``: ``engine.precision`` and ``engine.precision_gate``, and the engine keys a candidate precision may set
- ``metric_names``: EvalScope's metric names and how a config may spell them
- ``engine_args``: the keyword arguments an engine's constructor takes (``engine.extra``'s check), read from its
  installed source without importing it

The names below are the public ones (``from batch_llm.config import load_config``), as the DAGs, the provider and
the docs import them.
"""
from batch_llm.config.airflow import AirflowConfig
from batch_llm.config.cache import CacheConfig
from batch_llm.config.engine import (
    ClassifyConfig,
    EmbedConfig,
    EngineConfig,
    EngineNotInstalled,
    MemoryBackoffConfig,
    SpeculativeConfig,
    require_engine_installed,
)
from batch_llm.config.evaluate import EvaluateConfig
from batch_llm.config.filter import FilterConfig, ReviewConfig, WordListConfig
from batch_llm.config.input import InputConfig, ShardingConfig
from batch_llm.config.model import LoraConfig, ModelConfig, QuantizeConfig
from batch_llm.config.output import OutputConfig, TableCatalogConfig, TableConfig
from batch_llm.config.pipeline import ConfigDump, PipelineConfig, apply_overrides, load_config, parse_config
from batch_llm.config.sampling import SamplingConfig
from batch_llm.config.section import ConfigError

__all__ = [
    "AirflowConfig", "CacheConfig", "ClassifyConfig", "ConfigDump", "ConfigError", "EmbedConfig", "EngineConfig",
    "EngineNotInstalled", "EvaluateConfig", "FilterConfig", "InputConfig", "LoraConfig", "MemoryBackoffConfig",
    "ModelConfig", "OutputConfig", "PipelineConfig", "QuantizeConfig", "ReviewConfig", "SamplingConfig",
    "ShardingConfig", "SpeculativeConfig", "TableCatalogConfig", "TableConfig", "WordListConfig", "apply_overrides",
    "load_config", "parse_config", "require_engine_installed",
]
