"""The ``model`` section (which model runs, where it comes from, a LoRA adapter on it) and the ``quantize`` section
(its optional quantized export)."""
from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from batch_llm.config.section import Section


class LoraConfig(Section):
    """A LoRA adapter on the model, fetched like it: ``ref`` is a ModelScope id, a local folder or an
    object-storage prefix holding ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``).

    ``merge: true`` merges it into a new model folder (cached by model and adapter content), which every later
    stage and engine uses as the model (quantize included); ``merge: false`` serves it unmerged (vLLM only:
    ``enable_lora`` and a ``LoRARequest`` on every request)."""

    ref: str
    revision: str = "master"
    merge: bool = Field(True, description="true: merge into the model at fetch; false: the engine serves the "
                        "adapter (vllm only)")
    conn_id: str | None = Field(None, description="Airflow connection for an object-storage ref")


class ModelConfig(Section):
    """Which model to run, and where it comes from.

    ``ref`` is a ModelScope id (``Qwen/Qwen2.5-7B-Instruct``), a local directory, or an object-storage
    prefix (``s3://bucket/models/qwen``). ModelScope downloads land in ``cache_dir``; a cache hit makes no
    network call.
    """

    ref: str
    revision: str = "master"
    cache_dir: str | None = Field(None, description="ModelScope cache; default $BATCH_LLM_MODEL_CACHE")
    trust_remote_code: bool = Field(False, description="Run model code shipped with the checkpoint")
    chat_template: str | None = Field(None, description="Jinja chat template overriding the tokenizer's")
    require_chat_template: bool = Field(True, description="The fetch stage refuses a model without a chat template "
                                        "(chat rows need one) unless chat_template is set; false where every input "
                                        "row is pre-tokenized (prompt_token_ids): fetch then only warns")
    conn_id: str | None = Field(None, description="Airflow connection for an object-storage ref")
    lora: LoraConfig | None = Field(None, description="A LoRA adapter on the model; null: none")

    def resolved_cache_dir(self) -> str:
        if self.cache_dir:
            return os.path.expanduser(self.cache_dir)
        from batch_llm.demo_model import default_cache_dir

        return str(default_cache_dir())


class QuantizeConfig(Section):
    """Optional export with llm-compressor into a compressed-tensors checkpoint, cached by model, revision,
    scheme and settings.

    ``W4A16``: int4 weights in groups, 16-bit activations (AWQ or round-to-nearest; ``method``, ``group_size``
    and the calibration settings apply). ``FP8_DYNAMIC``: FP8 (e4m3) weights with one scale per output
    channel and activations quantized per token at run time; it needs no calibration data, so ``method``,
    ``group_size`` and the calibration settings do not apply and setting them is an error. FP8 pays on GPUs
    with FP8 tensor cores (Hopper, Ada: 1.22x on the H200, docs/benchmarks.md); vLLM's CPU build runs it
    through a slow fallback.
    """

    enabled: bool = False
    scheme: Literal["W4A16", "FP8_DYNAMIC"] = "W4A16"
    method: Literal["awq", "rtn"] = Field("awq", description="W4A16 only. awq: activation-aware; "
                                          "rtn: round-to-nearest")
    group_size: int | None = Field(None, gt=0, description="Weights per quantization group; null: the largest "
                                   "of 128, 64, 32 dividing the model's hidden size (from its config.json)")
    calibration_samples: int = Field(64, gt=0)
    calibration_seq_len: int = Field(256, gt=0)
    awq_grid: int = Field(20, gt=0, description="AWQ scale search grid; smaller is faster")
    cache_dir: str | None = Field(None, description="default: <model cache>/quantized")
    python: str | None = Field(None, description="Interpreter of the quantize environment "
                               "(default $BATCH_LLM_QUANTIZE_PYTHON or .venv-quantize/bin/python)")

    @model_validator(mode="after")
    def _w4a16_settings_only_with_w4a16(self) -> "QuantizeConfig":
        if self.scheme != "W4A16":
            # a setting that would silently do nothing is refused, like an unknown key
            given = sorted(self.model_fields_set & {"method", "group_size", "calibration_samples",
                                                    "calibration_seq_len", "awq_grid"})
            if given:
                raise ValueError(f"quantize.{', quantize.'.join(given)}: W4A16 settings; scheme {self.scheme} "
                                 "is data-free per-channel FP8 and takes none of them (remove them)")
        return self
