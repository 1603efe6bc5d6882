"""A finished shard's metrics, pushed to a Prometheus Pushgateway (``prometheus_client``), which Prometheus scrapes.

A shard is a batch job: it is not there to be scraped, so it pushes its outcome once, when its manifest is
committed, and the Pushgateway keeps it for Prometheus (scraped with ``honor_labels: true``). Nothing is pushed
unless ``BATCH_LLM_PUSHGATEWAY_URL`` names a gateway (``http://pushgateway:9091``); a push that fails is a warning
in the log, never a failed shard (one attempt, ``TIMEOUT_SECONDS`` at most).

One group per shard of a run, grouping key ``{job="batch_llm", pipeline, run_id, shard}``: parallel shards and
concurrent runs (a backfill) never replace each other's metrics, and a retried shard's push replaces its failed
attempt's (a PUT replaces the whole group). The grouping key is every series' label set; the gateway adds
``instance=""`` (no instance: a shard is not tied to a machine) and its own ``push_time_seconds`` per group.

The Pushgateway keeps a group until it is deleted (it has no TTL, by design): one group of ~12 series per shard
per run. docs/operating.md ("Metrics") says how to delete old runs' groups; Prometheus keeps their history.
"""
from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, push_to_gateway
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

ENV_URL = "BATCH_LLM_PUSHGATEWAY_URL"
JOB = "batch_llm"
PREFIX = "batch_llm_shard_"
TIMEOUT_SECONDS = 5.0

#: The shard's counts, pushed as counters ``batch_llm_shard_<name>_total`` (the shard's whole count: its rows over
#: every attempt, as the manifest records them).
COUNTERS = {
    "rows": "rows of the shard (usable and error rows)",
    "errors": "error rows of the shard (errors.jsonl, invalid outputs included)",
    "input_tokens": "prompt tokens of the shard's rows",
    "output_tokens": "completion tokens of the shard's usable rows",
    "cached_rows": "rows served from the result cache, not generated",
}
#: The shard's timings, pushed as gauges ``batch_llm_shard_<name>`` (the attempt that committed the shard).
GAUGES = {
    "output_tokens_per_second": "generated tokens per second of generation",
    "engine_start_seconds": "seconds the engine took to start (0: not started, every row cached)",
    "generate_seconds": "seconds spent generating",
    "seconds": "seconds the shard's worker ran",
    "gpu_lease_wait_seconds": "seconds the shard waited for its GPU lease",
}
#: The batch-job convention (Prometheus, "Instrumentation: batch jobs"): when the job last succeeded.
LAST_SUCCESS = "last_success_timestamp_seconds"


def series_names() -> set[str]:
    """Every metric name a push carries (the gateway adds ``push_time_seconds`` and ``push_failure_time_seconds``)."""
    return ({f"{PREFIX}{n}_total" for n in COUNTERS} | {f"{PREFIX}{n}" for n in GAUGES} |
            {f"{PREFIX}{LAST_SUCCESS}"})


def grouping_key(pipeline: str, run_id: str, shard: int) -> dict[str, str]:
    """The group of one shard of one run (``job`` is given apart, as ``push_to_gateway`` takes it)."""
    return {"pipeline": pipeline, "run_id": run_id, "shard": str(shard)}


class _ShardCollector(Collector):
    """The shard's values as metric families with no labels of their own: the grouping key labels them all."""

    def __init__(self, values: Mapping[str, float], finished: float):
        self.values, self.finished = values, finished

    def collect(self) -> Iterator[Metric]:
        for name, help_text in COUNTERS.items():  # CounterMetricFamily appends _total
            yield CounterMetricFamily(f"{PREFIX}{name}", f"batch-llm shard: {help_text}", value=self.values[name])
        for name, help_text in GAUGES.items():
            yield GaugeMetricFamily(f"{PREFIX}{name}", f"batch-llm shard: {help_text}", value=self.values[name])
        yield GaugeMetricFamily(f"{PREFIX}{LAST_SUCCESS}", "batch-llm shard: when it last finished (Unix time)",
                                value=self.finished)


def registry_for(values: Mapping[str, float], *, finished: float | None = None) -> CollectorRegistry:
    """A registry of its own (not the process's default one, which carries process metrics) with the shard's
    values; ``values`` has every name of COUNTERS and GAUGES."""
    missing = (set(COUNTERS) | set(GAUGES)) - set(values)
    if missing:
        raise KeyError(f"shard metrics missing: {sorted(missing)}")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ShardCollector(values, time.time() if finished is None else finished))
    return registry


def configured_url() -> str:
    """The Pushgateway shard metrics go to: ``$BATCH_LLM_PUSHGATEWAY_URL``, or "" (none: nothing is pushed)."""
    return os.environ.get(ENV_URL, "").strip()


def _shown(url: str) -> str:
    """The URL as logged: without a ``user:password@`` part."""
    return re.sub(r"//[^/@]*@", "//", url)


def push_shard_metrics(pipeline: str, run_id: str, shard: int, values: Mapping[str, float], *,
                       url: str | None = None, timeout: float = TIMEOUT_SECONDS) -> bool:
    """Pushes one finished shard's metrics to the Pushgateway at ``url`` (default: ``$BATCH_LLM_PUSHGATEWAY_URL``).

    Returns whether it pushed: False when no gateway is configured, or when the push failed (logged as a
    warning, with the gateway and the group; the shard's outcome does not depend on its metrics)."""
    url = configured_url() if url is None else url.strip()
    if not url:
        return False
    registry = registry_for(values)
    key = grouping_key(pipeline, run_id, shard)
    try:
        push_to_gateway(url, job=JOB, registry=registry, grouping_key=key, timeout=timeout)
    except Exception as e:  # refused, unreachable, timed out, rejected (HTTP 400): never the shard's failure
        log.warning("shard metrics not pushed to the Pushgateway %s (job=%s, group %s): %s: %s", _shown(url), JOB,
                    key, type(e).__name__, e)
        return False
    log.info("shard metrics pushed to the Pushgateway %s (job=%s, group %s)", _shown(url), JOB, key)
    return True


def push_manifest(pipeline: str, run_id: str, manifest, *, gpu_lease_wait_seconds: float = 0.0,
                  url: str | None = None) -> bool:
    """``push_shard_metrics`` of a committed shard's manifest (``manifests.ShardManifest``): its metrics and how
    long it waited for its GPUs. What the Airflow task and ``batch-llm run`` both push."""
    m = {**manifest.metrics.model_dump(), "gpu_lease_wait_seconds": round(gpu_lease_wait_seconds, 3)}
    return push_shard_metrics(pipeline, run_id, manifest.shard, {k: m[k] for k in (*COUNTERS, *GAUGES)}, url=url)
