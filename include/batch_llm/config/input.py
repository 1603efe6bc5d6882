"""The ``input`` section (where the prompts are, how a row becomes a chat) and the ``sharding`` section (how the
valid rows are split into shards)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from batch_llm.config.section import Section
from batch_llm.host import path_policy

Format = Literal["auto", "jsonl", "parquet", "csv", "openai_batch"]
# The table columns that may carry a row's own sampling (row_params reads them)
SamplingColumn = Literal["max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
                         "n", "logprobs", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
                         "include_stop_str_in_output", "chat_template_kwargs", "thinking", "reasoning_effort",
                         "max_thinking_tokens"]


# input.max_line_bytes' default: a line past it is the line's error, read in bounded memory (io/formats.py)
MAX_LINE_BYTES = 64 * 2**20


def _only_max_tokens() -> list[SamplingColumn]:
    return ["max_tokens"]


class InputConfig(Section):
    """Where the prompts are and how a row becomes a chat.

    A row has an id and either chat ``messages``, a ``prompt`` string, or columns rendered by ``template``
    (``"Translate to French: {text}"``). ``path`` may contain ``{ds}`` (the run's date, YYYY-MM-DD) for
    daily partitions: ``s3://lake/prompts/dt={ds}/``.
    """

    path: str
    format: Format = "auto"
    conn_id: str | None = None
    id_column: str = "id"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    template: str | None = None
    system_prompt: str | None = None
    reference_column: str = Field("reference", description="Reference answers for scoring, when present")
    sampling_columns: list[SamplingColumn] = Field(
        default_factory=_only_max_tokens,
        description="Columns whose value, where a row has one, overrides the sampling section for that row "
                    "(OpenAI Batch input reads these from each request body)")
    image_columns: list[str] = Field(
        default_factory=list, description="Columns holding a row's images (JSONL, CSV, Parquet): a path or URL "
        "(data:, s3:// through conn_id, a local path under the input's folder or image_roots), a list of them (a "
        "JSON list in CSV), or the image's bytes (a Parquet binary column, or a {bytes, path} struct as Hugging Face "
        "datasets write). They go before the text of the row's user message. Chat rows may name images in their "
        "own content parts (image_url) instead. Needs an engine that takes images (vllm)")
    max_image_bytes: int = Field(20 * 2**20, gt=0, description="The largest image a row may name, in bytes "
                                 "(default 20 MiB, OpenAI's limit); a larger one is the row's error")
    max_image_pixels: int = Field(40_000_000, gt=0, description="The most pixels (width × height, read from the "
                                  "image's header before anything is decoded) an image may have: a larger one is the "
                                  "row's error, so a small file of huge dimensions (a decompression bomb) never takes "
                                  "their memory. Default 40 MP (160 MB decoded); vision-language models resize to far "
                                  "fewer (Qwen2-VL: 12.8 MP)")
    image_workers: int = Field(4, ge=1, le=64, description="Threads that read, check and decode a shard's images "
                               "ahead of the engine, in the rows' order, at most 2 × this many requests ahead, each "
                               "holding its images decoded (and at most max_decoded_bytes_ahead of them), and that "
                               "check the planner's images in object storage ahead of its rows (reads overlap); 1: "
                               "each image on its row's turn")
    max_decoded_bytes_ahead: int = Field(1 << 30, gt=0, description="The most memory the images loaded ahead of the "
                                         "engine may take decoded (4 bytes a pixel, from their headers): a request "
                                         "that would go past it starts loading once those before it have gone to "
                                         "the engine (one alone always loads). Default 1 GiB")
    image_roots: list[str] = Field(default_factory=list, description="Local folders a row's image paths may point "
                                   "into besides the input's own folder (./relative to this YAML); a path outside "
                                   "them is the row's error")
    max_line_bytes: int = Field(MAX_LINE_BYTES, gt=0, description="The longest input line read, in bytes (JSONL and "
                                "OpenAI Batch lines; CSV lines, in characters): a longer line is that line's error, "
                                "skipped without being held in memory. Default 64 MiB: a million-token prompt is "
                                "~4 MB of text, an inline image at input.max_image_bytes ~27 MiB of base64. Parquet is "
                                "read a record batch at a time, its values as the file stores them (not bounded "
                                "here)")

    openai_urls: list[Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]] | None = Field(
        None, description="OpenAI Batch input: the request urls a line may name; a line naming another is that "
        "line's error. null: every url engine.task answers (generate: /v1/chat/completions and /v1/completions; "
        "embed: /v1/embeddings). A batch of the OpenAI Batch API sets its one endpoint here")

    @field_validator("image_columns")
    @classmethod
    def _distinct_image_columns(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or any(not c for c in v):
            raise ValueError(f"name each image column once, none empty: {v}")
        return v

    @field_validator("path")
    @classmethod
    def _fillable_path(cls, v: str) -> str:
        # RunLayout fills it with str.format: an unknown placeholder is refused here, not a traceback at run time
        if problem := path_policy.template_problem(v):
            raise ValueError(problem)
        return v


class ShardingConfig(Section):
    """How the valid rows are split into shards (one inference task each)."""

    rows_per_shard: int | None = Field(None, gt=0)
    num_shards: int | None = Field(None, gt=0)
    sort_by_length: bool = Field(True, description="Inside a shard, rows with the largest output budget first, "
                                   "then by prompt length (plan.shard_order); false: input order")
    group_prefixes: bool | None = Field(None, description="With sort_by_length, rows of one output budget that "
                                        "share their prompt's first 64, 512, 4096 or 32768 bytes (text, image "
                                        "hashes, token ids; a prompt shorter than a level has no group there) are "
                                        "submitted together, so the engine computes a "
                                        "shared prefix (a document asked several questions, a few-shot block) "
                                        "while it is still in its KV cache instead of again after eviction; "
                                        "inside a group, prompt length order. null: on where the engine caches "
                                        "prefixes (vLLM, SGLang; LMDeploy with engine.enable_prefix_caching), "
                                        "off for the transformers engine, whose static batches pad to the "
                                        "longest prompt and so want length order alone")
    length_history: bool | None = Field(None, description="With sort_by_length, order by the output lengths "
                                        "earlier runs of this pipeline and model generated for prompts of the "
                                        "row's prefix group (its first 64 and 512 bytes: a template, a system "
                                        "prompt; the mean of at least 4 rows, at most the row's budget) instead "
                                        "of its budget alone, so the generations that really run longest start "
                                        "first where rows end early (EOS); each shard records them beside the "
                                        "result cache (<cache root>/lengths/, cache/lengths.py) and a plan reads "
                                        "the newest. Only the order changes. null: on where a record exists; "
                                        "false: the budget alone, nothing recorded")
    shards_per_task: int = Field(1, ge=1, description="Consecutive shards one inference task runs in turn on "
                                 "one engine (one worker, one GPU lease): the engine starts once per task, not once "
                                 "per shard. Each shard keeps its own folder, chunk commits, manifest and "
                                 "exactly-once resume; the mapped task count is ceil(shards / shards_per_task). "
                                 "Not part of the plan: changing it does not re-plan or redo committed shards")
    plan_part_bytes: int | None = Field(None, gt=0, description="Plan the day in mapped tasks: the input files "
                                        "grouped into parts of about this many bytes (a bigger file is a part of "
                                        "its own; a bigger Parquet file is split by its row groups), each part "
                                        "validated and sharded by a task of its own, a small join finding "
                                        "duplicate ids across parts; no task reads more than its "
                                        "part. Shards are cut per part (rows_per_shard). Needs output.parts; "
                                        "not with num_shards. None: one plan task reads the day")
    # With neither set, shards are sized so that engine start stays under max_engine_start_share of a shard's
    # time, from these two expectations (defaults: measured on one H200, Qwen2.5-7B shape; docs/benchmarks.md).
    max_engine_start_share: float = Field(0.1, gt=0, lt=1)
    expected_engine_start_seconds: float = Field(70.0, gt=0)
    expected_output_tokens_per_second: float = Field(15000.0, gt=0)

    @model_validator(mode="after")
    def _one_of(self) -> "ShardingConfig":
        if self.rows_per_shard and self.num_shards:
            raise ValueError("set rows_per_shard or num_shards, not both")
        if self.group_prefixes and not self.sort_by_length:  # input order groups nothing: said, not dropped
            raise ValueError("group_prefixes: true orders rows inside a shard, and sort_by_length: false keeps "
                             "them in input order; set sort_by_length: true, or leave group_prefixes unset")
        if self.length_history and not self.sort_by_length:
            raise ValueError("length_history: true orders rows inside a shard by what earlier runs generated, and "
                             "sort_by_length: false keeps them in input order; set sort_by_length: true, or leave "
                             "length_history unset")
        return self

    @property
    def uses_length_history(self) -> bool:
        """Whether plans order by the output-length history and shards record it: where rows are sorted, unless
        length_history is false."""
        return self.sort_by_length and self.length_history is not False

    @staticmethod
    def size_changes(current: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
        """``changes`` to the two sizes (rows_per_shard, num_shards: overrides by field name) against ``current``
        (a sharding section's values): they exclude each other, so a size changed from the current one wins and
        unsets the other, unless that one is changed too (then both stay, and ``_one_of`` refuses them). The
        trigger form, which shows both with the pipeline's values, and a command line that sets one both come
        through here (``apply_overrides``)."""
        changed = [k for k in SHARD_SIZES if changes.get(k) is not None and changes[k] != current.get(k)]
        if len(changed) != 1:
            return dict(changes)
        return {**changes, **{k: None for k in SHARD_SIZES if k != changed[0]}}


SHARD_SIZES = ("rows_per_shard", "num_shards")  # the two ways to size shards; ShardingConfig.size_changes
