"""The ``engine.sglang`` section: SGLang's own settings, checked with the config; ``engines/sglang_config.py`` maps
them (and the engine section's common keys) onto SGLang's ``ServerArgs``."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SglangSettings(BaseModel):
    """SGLang's own settings (``engine.kind: sglang``); null is SGLang's own choice, which stays the default until
    measured on an H200 (not yet). The memory share, the batch limit, the context, the radix cache and CUDA
    graphs on or off are the engine section's common keys (engines/sglang_config.py maps them)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    cuda_graph_max_bs: int | None = Field(None, gt=0, description="The largest decode batch captured in a CUDA graph "
                                          "(SGLang's --cuda-graph-max-bs). null: SGLang's own, from the GPU's memory "
                                          "(256 on an H100 or H200 below tensor parallel 4, 512 at 4 and above)")
    max_total_tokens: int | None = Field(None, gt=0, description="The KV pool's size in tokens, at most (SGLang's "
                                         "--max-total-tokens). null: what engine.gpu_memory_utilization leaves "
                                         "after the weights")
    chunked_prefill_size: int | None = Field(None, ge=-1, description="Prompt tokens prefilled per step, at most "
                                             "(SGLang's --chunked-prefill-size; -1: no chunking). null: SGLang's own "
                                             "(8192 on an H100 or H200)")
    deterministic_inference: bool | None = Field(
        None, description="SGLang's enable_deterministic_inference (batch-invariant kernels), which per-request seeds "
        "need: without it SGLang ignores a seed. null: on when the pipeline samples with a seed (sampling.temperature "
        "> 0 and sampling.seed set); a row that samples with a seed on an engine without it is an error row")
