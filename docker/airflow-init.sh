#!/usr/bin/env bash
# One-shot setup of a deployment: compose's airflow-init service runs `bash /opt/batch-llm/airflow-init.sh`
# through the Airflow image's official /entrypoint (on Kubernetes: a Job with the same environment). As in
# Airflow's own docker-compose.yaml, the entrypoint has already done the generic part before this runs: waited
# for the database, migrated it (_AIRFLOW_DB_MIGRATE) and created the admin user of the FAB auth manager
# (_AIRFLOW_WWW_USER_CREATE with _AIRFLOW_WWW_USER_USERNAME / _AIRFLOW_WWW_USER_PASSWORD). This script does the
# rest; idempotent, run it again after changing a value:
#   1. checks that the migration finished (the entrypoint does not stop when `airflow db migrate` fails)
#   2. the GPU pools: BATCH_LLM_GPU_POOL and every airflow.gpu_pool of the pipelines, GPU_POOL_SLOTS slots each
#      (= GPUs of all GPU workers; a shard takes engine.tensor_parallel_size slots): batch_llm_airflow.pools
#   3. the object-storage connection (LAKE_CONN_ID, type aws, endpoint in its extra), stored encrypted with
#      the Fernet key; and the bucket, when it does not exist yet
# Secrets come from the environment only and are never printed: the commands that take them have their
# output discarded, and `set -x` is never used here.
set -euo pipefail
: "${S3_ACCESS_KEY_ID:?set S3_ACCESS_KEY_ID}"
: "${S3_SECRET_ACCESS_KEY:?set S3_SECRET_ACCESS_KEY}"
: "${S3_ENDPOINT_URL:?set S3_ENDPOINT_URL}"
pool=${BATCH_LLM_GPU_POOL:-gpu}
conn=${LAKE_CONN_ID:-lake}

echo "airflow-init: checking that the metadata database is migrated"
airflow db check-migrations --migration-wait-timeout 60

echo "airflow-init: pool ${pool} and the pools the pipelines name, ${GPU_POOL_SLOTS:-1} slot(s) each"
python -m batch_llm_airflow.pools --slots "${GPU_POOL_SLOTS:-1}" --pool "$pool" "${BATCH_LLM_PIPELINES_DIR:-/opt/airflow/pipelines}"

echo "airflow-init: connection ${conn} (aws, endpoint ${S3_ENDPOINT_URL})"
extra=$(python -c 'import json, os; print(json.dumps({"endpoint_url": os.environ["S3_ENDPOINT_URL"],
  "region_name": os.environ.get("S3_REGION") or "us-east-1"}))')
airflow connections delete "$conn" >/dev/null 2>&1 || true
airflow connections add "$conn" --conn-type aws --conn-login "$S3_ACCESS_KEY_ID" \
  --conn-password "$S3_SECRET_ACCESS_KEY" --conn-extra "$extra" >/dev/null

if [ -n "${S3_BUCKET:-}" ]; then
  echo "airflow-init: bucket ${S3_BUCKET}"
  python - <<'PY'
import os

import s3fs

fs = s3fs.S3FileSystem(key=os.environ["S3_ACCESS_KEY_ID"], secret=os.environ["S3_SECRET_ACCESS_KEY"],
                       client_kwargs={"endpoint_url": os.environ["S3_ENDPOINT_URL"],
                                      "region_name": os.environ.get("S3_REGION") or "us-east-1"})
if not fs.exists(os.environ["S3_BUCKET"]):
    fs.mkdir(os.environ["S3_BUCKET"])
PY
fi
echo "airflow-init: done"
