"""The pipeline's configuration: the one model a YAML file, Airflow Params and CLI flags fill, and the tables it
checks against. Nothing here imports an engine, a stage or a file format.

- ``model``: ``PipelineConfig`` and its sections, loading (``load_config``, ``parse_config``) and overrides
- ``capabilities``: the engine capability table (who serves guided JSON, n > 1, logprobs, LoRA, ...)
- ``sglang``: the ``engine.sglang`` section, SGLang's own settings
- ``metric_names``: EvalScope's metric names and how a config may spell them
- ``engine_args``: the keyword arguments an engine's constructor takes (``engine.extra``'s check), read from its
  installed source without importing it

The names below are the public ones (``from batch_llm.config import load_config``), as the DAGs, the provider and
the docs import them.
"""
from batch_llm.config.model import (
    AirflowConfig,
    CacheConfig,
    ClassifyConfig,
    ConfigDump,
    ConfigError,
    EmbedConfig,
    EngineConfig,
    EngineNotInstalled,
    EvaluateConfig,
    FilterConfig,
    InputConfig,
    LoraConfig,
    MemoryBackoffConfig,
    ModelConfig,
    OutputConfig,
    PipelineConfig,
    QuantizeConfig,
    ReviewConfig,
    SamplingConfig,
    ShardingConfig,
    SpeculativeConfig,
    TableCatalogConfig,
    TableConfig,
    WordListConfig,
    apply_overrides,
    load_config,
    parse_config,
    require_engine_installed,
)

__all__ = [
    "AirflowConfig", "CacheConfig", "ClassifyConfig", "ConfigDump", "ConfigError", "EmbedConfig", "EngineConfig",
    "EngineNotInstalled", "EvaluateConfig", "FilterConfig", "InputConfig", "LoraConfig", "MemoryBackoffConfig",
    "ModelConfig", "OutputConfig", "PipelineConfig", "QuantizeConfig", "ReviewConfig", "SamplingConfig",
    "ShardingConfig", "SpeculativeConfig", "TableCatalogConfig", "TableConfig", "WordListConfig", "apply_overrides",
    "load_config", "parse_config", "require_engine_installed",
]
