#!/usr/bin/env bash
# One-shot setup of a deployment, run by compose's airflow-init service before the other Airflow services
# start (on Kubernetes: a Job with the same environment). Idempotent: run it again after changing a value.
#   1. airflow db migrate (Airflow's tables and the FAB auth manager's)
#   2. the GPU pool: GPU_POOL_SLOTS = GPUs of all GPU workers (a shard takes engine.tensor_parallel_size slots)
#   3. the admin user of the FAB auth manager
#   4. the object-storage connection (LAKE_CONN_ID, type aws, endpoint in its extra), stored encrypted with
#      the Fernet key; and the bucket, when it does not exist yet
# Secrets come from the environment only and are never printed: the commands that take them have their
# output discarded, and `set -x` is never used here.
set -euo pipefail
: "${AIRFLOW_ADMIN_PASSWORD:?set AIRFLOW_ADMIN_PASSWORD}"
: "${S3_ACCESS_KEY_ID:?set S3_ACCESS_KEY_ID}"
: "${S3_SECRET_ACCESS_KEY:?set S3_SECRET_ACCESS_KEY}"
: "${S3_ENDPOINT_URL:?set S3_ENDPOINT_URL}"
pool=${BATCH_LLM_GPU_POOL:-gpu}
conn=${LAKE_CONN_ID:-lake}

echo "airflow-init: migrating the metadata database"
airflow db migrate

echo "airflow-init: pool ${pool} with ${GPU_POOL_SLOTS:-1} slot(s)"
airflow pools set "$pool" "${GPU_POOL_SLOTS:-1}" "GPU slots: GPUs of the gpu-queue workers (a shard takes tensor_parallel_size)" >/dev/null

echo "airflow-init: admin user ${AIRFLOW_ADMIN_USER:-admin}"
airflow users create --role Admin --username "${AIRFLOW_ADMIN_USER:-admin}" \
  --email "${AIRFLOW_ADMIN_EMAIL:-admin@example.com}" --firstname Admin --lastname User \
  --password "$AIRFLOW_ADMIN_PASSWORD" >/dev/null

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
