#!/usr/bin/env bash
# Builds the demo model (once), then runs the demo pipeline through Airflow (`airflow dags test`, SQLite,
# local storage, the CPU vLLM engine) and prints where its outputs and EvalScope report are.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/airflow_env.sh
echo "demo: model at $(.venv/bin/python -m batch_llm.demo_model)"
.venv/bin/airflow db migrate >/dev/null
# the GPU pool the pipelines name, for a scheduler started on this Airflow home later (`airflow dags test` runs
# without one): as many slots as GPUs (1 on a CPU machine), GPU_POOL_SLOTS to choose
slots=${GPU_POOL_SLOTS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
.venv/bin/python -m batch_llm_airflow.pools --slots "${slots:-1}" --airflow .venv/bin/airflow dags/pipelines
ds=$(date -u +%F)
echo "demo: running DAG batch_llm_demo for $ds (log: var/demo.log)"
# Airflow's CLI warns at import that graphviz (for `airflow dags show`) is missing: nothing this run uses
PYTHONWARNINGS="ignore:Could not import graphviz:UserWarning" \
  .venv/bin/airflow dags test batch_llm_demo "$ds" > var/demo.log 2>&1 || { tail -40 var/demo.log; exit 1; }
.venv/bin/python - "$ds" <<'PY'
import json, sys
from batch_llm.config import load_config
from batch_llm.io.storage import Location, read_json
cfg = load_config("dags/pipelines/demo.yaml")
part = Location(cfg.output.path).child(cfg.name, cfg.output.partition.format(ds=sys.argv[1]))
cur = read_json(part.child("_CURRENT.json").path())
summary = read_json(Location(cur["version"]).child("summary.json").path())
ev = summary["manifests"]["evaluate"]
print(f"demo: published {cur['rows']} rows -> {cur['dataset']}")
print(f"demo: errors (rows with reasons) -> {summary['errors']}")
print(f"demo: run summary -> {cur['version']}/summary.json")
print(f"demo: EvalScope report -> {ev.get('report_json')}  scores: {ev.get('metrics')}")
if summary.get("report"):
    print(f"demo: run report -> {summary['report']}")
PY
