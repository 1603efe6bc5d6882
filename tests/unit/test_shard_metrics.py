"""Shard metrics as they leave a task: a push to the Prometheus Pushgateway (batch_llm.analysis.metrics_push), caught here by
an HTTP server on loopback that reads what a Pushgateway would (method, grouping key in the path, text format);
nothing without BATCH_LLM_PUSHGATEWAY_URL; a refused, rejected or hanging gateway is a warning, never a failure;
and the observability files (Prometheus scrape config, Grafana dashboard) agreeing with what is pushed.

The real Pushgateway and Prometheus, scraped and queried panel by panel after a real shard:
tests/system/test_prometheus_pushgateway.py."""
from __future__ import annotations

import base64
import json
import logging
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from batch_llm.analysis import metrics_push
from batch_llm.manifests import ShardManifest
from batch_llm_airflow.operators import emit_shard_metrics
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "docker" / "observability"
RUN_ID = "scheduled__2026-11-30T00:00:00+00:00"
MANIFEST = ShardManifest(shard=3, outputs="o", errors="e", checksum="c", metrics={
    "rows": 10, "errors": 1, "input_tokens": 100, "output_tokens": 50, "cached_rows": 2,
    "output_tokens_per_second": 12.5, "engine_start_seconds": 40.1, "generate_seconds": 4.0, "seconds": 50.0})


class _Gateway(BaseHTTPRequestHandler):
    """Records each request; answers with the server's ``status`` after ``delay`` seconds."""

    def _record(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        self.server.requests.append((self.command, self.path, body))  # type: ignore[attr-defined]
        time.sleep(self.server.delay)  # type: ignore[attr-defined]
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.end_headers()

    do_PUT = do_POST = _record

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def gateway(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    server.requests, server.status, server.delay = [], 200, 0.0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(metrics_push.ENV_URL, f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def grouping_key(path: str) -> dict[str, str]:
    """The Pushgateway's reading of ``/metrics/job/<job>{/<label>/<value>}`` (``<label>@base64``: URL-safe base64)."""
    parts = path.split("/")
    assert parts[:2] == ["", "metrics"], path
    key = {}
    for name, value in zip(parts[2::2], parts[3::2]):
        if name.endswith("@base64"):
            name, value = name[:-7], base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode()
        else:
            value = urllib.parse.unquote_plus(value)
        key[name] = value
    return key


def test_a_shard_pushes_its_counters_and_gauges_as_one_group_per_pipeline_run_and_shard(gateway):
    before = time.time()
    assert emit_shard_metrics("demo", MANIFEST, gpu_lease_wait_seconds=7.25, run_id=RUN_ID) is True
    ((method, path, body),) = gateway.requests
    assert method == "PUT"  # replaces the group: a retried shard's push replaces its earlier attempt's
    assert grouping_key(path) == {"job": "batch_llm", "pipeline": "demo", "run_id": RUN_ID, "shard": "3"}
    got = {}
    for family in text_string_to_metric_families(body):
        (sample,) = family.samples
        assert sample.labels == {}, sample  # the grouping key labels every series
        got[sample.name] = (family.type, sample.value)
    stamp = got.pop("batch_llm_shard_last_success_timestamp_seconds")
    assert stamp[0] == "gauge" and before <= stamp[1] <= time.time()
    assert got == {
        "batch_llm_shard_rows_total": ("counter", 10), "batch_llm_shard_errors_total": ("counter", 1),
        "batch_llm_shard_input_tokens_total": ("counter", 100), "batch_llm_shard_output_tokens_total": ("counter", 50),
        "batch_llm_shard_cached_rows_total": ("counter", 2),
        "batch_llm_shard_output_tokens_per_second": ("gauge", 12.5),
        "batch_llm_shard_engine_start_seconds": ("gauge", 40.1), "batch_llm_shard_generate_seconds": ("gauge", 4.0),
        "batch_llm_shard_seconds": ("gauge", 50.0), "batch_llm_shard_gpu_lease_wait_seconds": ("gauge", 7.25)}
    assert set(got) | {"batch_llm_shard_last_success_timestamp_seconds"} == metrics_push.series_names()


def test_a_run_id_with_a_slash_or_nothing_in_it_stays_one_group(gateway):
    for run_id in ("backfill/2026-11-30", ""):
        assert metrics_push.push_shard_metrics("demo", run_id, 0, {**MANIFEST.metrics.model_dump(),
                                                                   "gpu_lease_wait_seconds": 0.0})
        assert grouping_key(gateway.requests[-1][1])["run_id"] == run_id


def test_nothing_is_pushed_without_a_gateway(monkeypatch, gateway):
    monkeypatch.delenv(metrics_push.ENV_URL)
    assert emit_shard_metrics("demo", MANIFEST) is False  # not even the run id is asked for (no task context here)
    monkeypatch.setenv(metrics_push.ENV_URL, "  ")
    assert emit_shard_metrics("demo", MANIFEST) is False
    assert gateway.requests == []


def test_a_failed_push_is_a_warning_never_the_shards_failure(gateway, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="batch_llm.analysis.metrics_push")
    gateway.status = 400  # what a Pushgateway answers to an inconsistent push
    assert emit_shard_metrics("demo", MANIFEST, run_id=RUN_ID) is False
    assert "not pushed to the Pushgateway" in caplog.text and "HTTP Error 400" in caplog.text
    assert "'run_id': 'scheduled__2026-11-30T00:00:00+00:00'" in caplog.text  # says which group was lost
    caplog.clear()
    monkeypatch.setenv(metrics_push.ENV_URL, "http://127.0.0.1:9")  # nothing listens (discard port)
    assert emit_shard_metrics("demo", MANIFEST, run_id=RUN_ID) is False
    assert "Connection refused" in caplog.text
    caplog.clear()
    monkeypatch.setenv(metrics_push.ENV_URL, "http://user:s3cret@127.0.0.1:9")  # a password is never logged
    assert emit_shard_metrics("demo", MANIFEST, run_id=RUN_ID) is False
    assert "not pushed to the Pushgateway http://127.0.0.1:9 " in caplog.text and "s3cret" not in caplog.text
    caplog.clear()
    gateway.status, gateway.delay = 200, 3.0  # a gateway that does not answer in time: bounded
    values = {**MANIFEST.metrics.model_dump(), "gpu_lease_wait_seconds": 0.0}
    start = time.monotonic()
    url = f"http://127.0.0.1:{gateway.server_address[1]}"
    assert metrics_push.push_shard_metrics("demo", RUN_ID, 3, values, url=url, timeout=0.5) is False
    assert time.monotonic() - start < 2.5 and "timed out" in caplog.text
    assert metrics_push.TIMEOUT_SECONDS <= 10


def test_prometheus_scrapes_the_pushgateway_with_its_labels():
    cfg = yaml.safe_load((OBS / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    push = jobs["pushgateway"]
    assert push["honor_labels"] is True  # else the pushed job becomes exported_job and the gateway's instance sticks
    assert push["static_configs"][0]["targets"] == ["pushgateway:9091"]
    assert "statsd-exporter" in jobs  # Airflow's own metrics still come as StatsD
    rules = yaml.safe_load((OBS / "statsd-mapping.yml").read_text())["mappings"]
    assert not [r for r in rules if "batch_llm" in str(r)]  # one way in for the shard metrics: no duplicates


def test_the_dashboard_queries_only_series_a_push_produces():
    dash = json.loads((OBS / "grafana" / "dashboards" / "batch-llm.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queried = {n for e in exprs for n in re.findall(r"\b(?:batch_llm_shard_\w+|push_time_seconds)\b", e)}
    assert queried and queried <= metrics_push.series_names() | {"push_time_seconds"}, queried
    assert all('{job="batch_llm"}' in e for e in exprs), exprs
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for what in ("tokens/s", "rows done", "errors", "engine start", "gpu-lease wait", "per run", "last successful"):
        assert what in titles, what
    ds = yaml.safe_load((OBS / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {d["uid"] for d in ds["datasources"]}
