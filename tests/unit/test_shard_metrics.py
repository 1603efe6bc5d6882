"""Shard metrics as they leave a task: Airflow's own StatsD client (as a task process initializes it) sending
UDP to a socket here, in the InfluxDB tag format the compose file configures; and the observability files
(statsd_exporter mapping, Grafana dashboard) agreeing with what is sent.

Not run here: the StatsD exporter, Prometheus and Grafana themselves (no package registry this machine reaches
ships statsd_exporter; docker/compose.yaml runs the official images). The compose file is validated by
tests/system/test_docker_static.py."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from batch_llm_airflow.operators import SHARD_COUNTERS, SHARD_GAUGES

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "docker" / "observability"

EMIT = """
from airflow.sdk._shared.observability.metrics import stats
from airflow.sdk.observability.metrics import stats_utils
from batch_llm.manifests import ShardManifest
from batch_llm_airflow.operators import emit_shard_metrics

stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)  # as the task runner does
emit_shard_metrics("demo", ShardManifest(shard=3, outputs="o", errors="e", checksum="c", metrics={
                   "rows": 10, "errors": 1, "input_tokens": 100, "output_tokens": 50, "cached_rows": 2,
                   "output_tokens_per_second": 12.5, "engine_start_seconds": 40.1, "generate_seconds": 4.0,
                   "seconds": 50.0}), gpu_lease_wait_seconds=7.25)
"""


def _sent_lines() -> list[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    env = dict(os.environ, AIRFLOW__METRICS__STATSD_ON="True", AIRFLOW__METRICS__STATSD_HOST="127.0.0.1",
               AIRFLOW__METRICS__STATSD_PORT=str(sock.getsockname()[1]), AIRFLOW__METRICS__STATSD_PREFIX="airflow",
               AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED="True")
    proc = subprocess.run([sys.executable, "-c", EMIT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NoStatsLogger" not in proc.stderr, proc.stderr[-3000:]  # e.g. the statsd package missing
    sock.settimeout(2.0)
    lines = []
    try:
        while True:
            lines += sock.recv(65535).decode().splitlines()
    except socket.timeout:
        pass
    finally:
        sock.close()
    return [x for x in lines if "batch_llm" in x]


def test_a_shard_sends_its_counters_and_gauges_tagged_by_pipeline_and_shard():
    got = {}
    for line in _sent_lines():
        m = re.fullmatch(r"airflow\.batch_llm\.shard\.(\w+),pipeline=demo,shard=3:([\d.]+)\|(c|g)", line)
        assert m, line
        got[m[1]] = (float(m[2]), m[3])
    assert got == {"rows": (10, "c"), "errors": (1, "c"), "input_tokens": (100, "c"), "output_tokens": (50, "c"),
                   "cached_rows": (2, "c"), "output_tokens_per_second": (12.5, "g"),
                   "engine_start_seconds": (40.1, "g"), "generate_seconds": (4.0, "g"), "seconds": (50.0, "g"),
                   "gpu_lease_wait_seconds": (7.25, "g")}


def _mapped_names() -> set[str]:
    """The Prometheus names the exporter's mapping gives each metric the operator sends (first match wins)."""
    rules = yaml.safe_load((OBS / "statsd-mapping.yml").read_text())["mappings"]
    names = set()
    for kind, metrics in (("counter", SHARD_COUNTERS), ("gauge", SHARD_GAUGES)):
        for metric in metrics:
            statsd = f"airflow.batch_llm.shard.{metric}"
            rule = next(r for r in rules if r.get("match_metric_type", kind) == kind and
                        r.get("match_type", "glob") == "glob" and fnmatch.fnmatchcase(statsd, r["match"]))
            names.add(rule["name"].replace("${1}", metric))
    return names


def test_the_dashboard_queries_only_series_the_mapping_produces():
    names = _mapped_names()
    assert {"batch_llm_shard_rows_total", "batch_llm_shard_output_tokens_per_second",
            "batch_llm_shard_gpu_lease_wait_seconds"} <= names
    dash = json.loads((OBS / "grafana" / "dashboards" / "batch-llm.json").read_text())
    queried = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"batch_llm_\w+", t["expr"])}
    assert queried and queried <= names, queried - names
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for what in ("tokens/s", "rows done", "errors", "engine start", "gpu-lease wait"):
        assert what in titles, what
    ds = yaml.safe_load((OBS / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {d["uid"] for d in ds["datasources"]}
