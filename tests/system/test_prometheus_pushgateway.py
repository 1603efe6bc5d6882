"""Metrics a Prometheus really scrapes: Debian's ``prometheus-pushgateway`` and ``prometheus``
on loopback (unpacked by ``scripts/services.sh prometheus``, no root install), Prometheus scraping the gateway
every second with the pushgateway job of docker/observability/prometheus.yml; a pipeline of two real shards
(the transformers engine on the demo model) through ``dag.test()``, whose inference tasks push on
``BATCH_LLM_PUSHGATEWAY_URL``; then every target of every panel of the Grafana dashboard, as Grafana would send it,
to Prometheus's HTTP API (/api/v1/query): each answers, with the labels its legend names and only labels of the
shards' grouping key (job, pipeline, run_id, shard). The panels are read from the dashboard file: a new panel is
checked without a change here."""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from batch_llm.analysis import metrics_push
from helpers import demo_config, run_demo_cli

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "docker" / "observability"
DASHBOARD = OBS / "grafana" / "dashboards" / "batch-llm.json"
ROWS = 6
SHARDS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[0]} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            _get(f"{url}/-/ready", timeout=1.0)
            return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"{url} not ready in {deadline_s:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def prometheus_bin() -> Path:
    p = subprocess.run(["bash", str(ROOT / "scripts" / "services.sh"), "prometheus"], capture_output=True, text=True,
                       timeout=600)
    if p.returncode != 0:
        pytest.fail(f"`scripts/services.sh prometheus` failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return Path(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stack(prometheus_bin, tmp_path_factory):
    """(Pushgateway URL, Prometheus URL), both on loopback, torn down after the module."""
    tmp = tmp_path_factory.mktemp("prometheus")
    gw_port, prom_port = _free_port(), _free_port()
    job = next(j for j in yaml.safe_load((OBS / "prometheus.yml").read_text())["scrape_configs"]
               if j["job_name"] == "pushgateway")
    job = {**job, "scrape_interval": "1s", "static_configs": [{"targets": [f"127.0.0.1:{gw_port}"]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"},
                                                        "scrape_configs": [job]}))
    assets = prometheus_bin.parent / "share" / "prometheus" / "pushgateway"
    commands = {
        "pushgateway": [str(prometheus_bin / "prometheus-pushgateway"), f"--web.listen-address=127.0.0.1:{gw_port}",
                        "--persistence.file=", f"--web.local-assets={assets}"],
        "prometheus": [str(prometheus_bin / "prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                       f"--web.listen-address=127.0.0.1:{prom_port}", f"--storage.tsdb.path={tmp / 'tsdb'}"],
    }
    procs = []
    try:
        for (name, cmd), port in zip(commands.items(), (gw_port, prom_port)):
            log = tmp / f"{name}.log"
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp,
                                              start_new_session=True))
            _wait_ready(f"http://127.0.0.1:{port}", procs[-1], log)
        yield f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{prom_port}"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def query(prom: str, expr: str) -> list[dict]:
    body = json.loads(_get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert body["status"] == "success", body
    return body["data"]["result"]


def panel_targets() -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every query target of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    panels = [q for p in dash["panels"] for q in (p.get("panels") or [p])]  # rows hold panels of their own
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in panels for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def pushed_run(stack, tmp_path_factory, airflow_db, demo_model_dir):
    """The pipeline through dag.test() with the gateway configured: (pipeline name, the DAG run's run_id)."""
    from batch_llm_airflow.dag_factory import pipeline_dag

    gateway, _ = stack
    tmp = tmp_path_factory.mktemp("run")
    src = tmp / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say the number {i}."}) + "\n"
                           for i in range(ROWS)))
    # The demo DAG (dag.test() runs a dag_id the DAGs folder has) built from the demo pipeline writing under tmp:
    # the cheap real engine, two shards of three rows, no EvalScope.
    cfg = demo_config(tmp, input__path=str(src), engine__kind="transformers", sharding__num_shards=SHARDS,
                      sampling__max_tokens=4, evaluate__enabled=False, airflow__retries=0)
    dag = pipeline_dag(cfg, source="tests/system/test_prometheus_pushgateway.py")
    os.environ[metrics_push.ENV_URL] = gateway
    try:
        dr = dag.test(logical_date=dt.datetime.now(dt.timezone.utc).replace(microsecond=0))
    finally:
        os.environ.pop(metrics_push.ENV_URL, None)
    assert str(dr.state).endswith("success"), dr.state
    return cfg.name, dr.run_id


@pytest.mark.timeout(600)
def test_every_dashboard_panel_answers_with_the_pushed_shards(stack, pushed_run):
    _, prom = stack
    pipeline, run_id = pushed_run
    key = {"job": metrics_push.JOB, "pipeline": pipeline, "run_id": run_id}
    shards = {str(i) for i in range(SHARDS)}
    # every shard's group scraped at least once
    deadline = time.monotonic() + 30
    while len(query(prom, f'push_time_seconds{{job="batch_llm",run_id="{run_id}"}}')) < SHARDS:
        assert time.monotonic() < deadline, "the pushed groups never reached Prometheus"
        time.sleep(0.5)

    targets = panel_targets()
    assert len(targets) >= 6, targets
    for title, expr, legend in targets:
        result = query(prom, expr)
        assert result, f"panel {title!r}: no series for {expr}"
        named = set(re.findall(r"{{\s*(\w+)\s*}}", legend))
        for series in result:
            labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
            assert named <= set(labels), (title, named, labels)
            assert set(labels) <= {*key, "shard"}, f"panel {title!r}: labels beyond the grouping key: {labels}"
            assert all(labels[k] == v for k, v in key.items() if k in labels), (title, labels, key)
            assert labels.get("shard", "0") in shards, (title, labels)
            value = float(series["value"][1])
            assert math.isfinite(value) and value >= 0, (title, series)
        if "shard" in named:
            assert {s["metric"]["shard"] for s in result} == shards, (title, result)

    # the values are the shards' own: every row once over the two shards, tokens generated, an engine started
    sel = f'{{job="batch_llm",run_id="{run_id}"}}'
    assert float(query(prom, f"sum(batch_llm_shard_rows_total{sel})")[0]["value"][1]) == ROWS
    assert float(query(prom, f"min(batch_llm_shard_output_tokens_total{sel})")[0]["value"][1]) > 0
    assert float(query(prom, f"min(batch_llm_shard_engine_start_seconds{sel})")[0]["value"][1]) > 0
    raw = query(prom, f"batch_llm_shard_rows_total{sel}")
    assert sorted(s["metric"]["shard"] for s in raw) == sorted(shards)  # one group per shard, none overwritten
    assert all(set(s["metric"]) == {"__name__", *key, "shard"} for s in raw), raw  # no instance, no exported_job


@pytest.mark.timeout(600)
def test_batch_llm_run_pushes_a_group_per_shard_as_the_task_does(stack, tmp_path, demo_model_dir):
    """The command line (``batch-llm run``) with the gateway configured pushes what the Airflow task pushes: one
    group per shard under the run's id, the shards' rows adding up to the input's."""
    gateway, _ = stack
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "prompt": f"Say the number {i}."}) + "\n"
                           for i in range(ROWS)))
    os.environ[metrics_push.ENV_URL] = gateway  # the CLI process inherits it
    try:
        run_demo_cli(src, tmp_path / "out", ds="2026-12-04", run_id="cli-push",
                     sets=["engine.kind=transformers", f"sharding.num_shards={SHARDS}", "sampling.max_tokens=4",
                           "evaluate.enabled=false", "cache.enabled=false"])
    finally:
        os.environ.pop(metrics_push.ENV_URL, None)
    groups = [g for g in json.loads(_get(f"{gateway}/api/v1/metrics"))["data"]
              if g["labels"].get("run_id") == "cli-push"]
    assert sorted(g["labels"]["shard"] for g in groups) == [str(i) for i in range(SHARDS)], groups
    assert all(g["labels"]["job"] == metrics_push.JOB and g["labels"]["pipeline"] == "batch_llm_demo" for g in groups)
    rows = sum(float(m["value"]) for g in groups for m in g["batch_llm_shard_rows_total"]["metrics"])
    assert rows == ROWS
