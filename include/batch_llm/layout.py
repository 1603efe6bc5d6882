"""Where one run of one pipeline reads and writes (``RunLayout``), and reading what its stages committed
(``read_manifest_at``, ``shard_manifests``): the one place a run's layout is built."""
from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batch_llm.config import ConfigError, PipelineConfig
from batch_llm.host import path_policy
from batch_llm.io.storage import (
    Location,
    list_files,
)
from batch_llm.manifests import (
    EvaluateManifest,
    FetchManifest,
    FilterManifest,
    Manifest,
    PlanManifest,
    PublishManifest,
    QuantizeManifest,
    ShardManifest,
)

if TYPE_CHECKING:

    pass


@dataclass(frozen=True)
class RunLayout:
    """Where one run of one pipeline reads and writes."""

    output_root: Location      # output.path
    pipeline: str
    partition: str             # "dt=2026-11-30"
    run_id: str
    input: Location

    @classmethod
    def for_run(cls, cfg: PipelineConfig, *, run_id: str, ds: str | None = None,
                output_options: dict | None = None, input_options: dict | None = None,
                output_location: Location | None = None, input_location: Location | None = None) -> "RunLayout":
        """The layout of one run of ``cfg``: the one place a pipeline run's layout is built (operators, CLI,
        benchmarks, tests). ``ds`` fills ``{ds}`` of the partition and the input path (default: today).
        ``output_location`` / ``input_location``: the locations already resolved (the operators' storage hook,
        with the connection's credentials: ``cfg.output.path`` and ``cfg.input.path`` with ``{ds}`` filled);
        otherwise they are made from the config's paths and ``*_options``. ``run_id``: refused (ConfigError) where
        ``path_policy.run_id_problem`` says it cannot name a run folder, wherever it came from."""
        if problem := path_policy.run_id_problem(run_id):  # "..": the stages' folders would land in runs/ itself
            raise ConfigError(problem)
        ds = ds or dt.date.today().isoformat()
        partition = cfg.output.partition.format(ds=ds)
        if problem := path_policy.partition_problem(partition):  # a ds of "../x" would fill it out of the pipeline
            raise ConfigError(f"output.partition {cfg.output.partition!r} with ds {ds!r}: {problem}")
        return cls(output_root=output_location or Location(cfg.output.path, output_options or {}),
                   pipeline=cfg.name, partition=partition, run_id=run_id,
                   input=input_location or Location(cfg.input.path.format(ds=ds), input_options or {}))

    @property
    def pipeline_root(self) -> Location:
        return self.output_root.child(self.pipeline)

    @property
    def run_dir(self) -> Location:
        return self.pipeline_root.child("runs", self.partition, re.sub(r"[^A-Za-z0-9_.-]", "_", self.run_id))

    def stage(self, name: str) -> Location:
        return self.run_dir.child(name)

    def shard_dir(self, index: int, stage: str = "infer") -> Location:
        """The folder shard ``index`` commits in under a stage (``infer``; ``review`` for the review's pass)."""
        return self.stage(stage).child(shard_name(index))

    @property
    def review_model(self) -> Location:
        """Where the review's model manifest is committed (the fetch of ``filter.review.model``)."""
        return self.stage("review").child("model")

    def review_requests(self, index: int, key: str) -> Location:
        """The review's requests of shard ``index``, made with the review settings whose key is ``key``."""
        return self.stage("review").child("requests", f"{shard_name(index)}-{key}.jsonl")

    @property
    def published(self) -> Location:
        return self.pipeline_root.child(self.partition)

    def cache_root(self, cfg: PipelineConfig) -> Location:
        if cfg.cache.path:
            return Location(cfg.cache.path, self.output_root.options)
        return self.output_root.child("_cache", "results")

    def to_dict(self) -> dict:
        return {"output_root": self.output_root.to_dict(), "pipeline": self.pipeline, "partition": self.partition,
                "run_id": self.run_id, "input": self.input.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "RunLayout":
        return cls(output_root=Location.from_any(d["output_root"]), pipeline=d["pipeline"],
                   partition=d["partition"], run_id=d["run_id"], input=Location.from_any(d["input"]))


def shard_name(index: int) -> str:
    """A shard's name in a run's folders: its plan file (``plan/shard-00003.jsonl``), its folder under a stage,
    its log."""
    return f"shard-{index:05d}"


STAGE_MANIFESTS: dict[str, type[Manifest]] = {
    "fetch": FetchManifest, "quantize": QuantizeManifest, "plan": PlanManifest, "filter": FilterManifest,
    "evaluate": EvaluateManifest, "publish": PublishManifest}


def read_manifest_at(layout: RunLayout, stage: str):
    """The manifest a stage of this run committed: what a later stage reads of it (XCom carries references)."""
    return STAGE_MANIFESTS[stage].read(layout.stage(stage).path())


def shard_manifests(layout: RunLayout) -> list[ShardManifest]:
    """Every shard this run committed, by index (the publish task reads them from storage, not XCom)."""
    infer_dir = layout.stage("infer").path()
    found = (ShardManifest.read_if_done(d) for d in list_files(infer_dir))
    return sorted((m for m in found if m is not None), key=lambda m: m.shard)
