#!/usr/bin/env bash
# Entrypoint of the GPU worker image (under tini), which replaces vLLM's ["vllm", "serve"]. It dispatches as the
# official Airflow image's /entrypoint does (the Airflow image keeps that one): `bash ...` and `python ...` run
# as they are (the KubernetesExecutor starts its task pods with `python -m
# airflow.sdk.execution_time.execute_workload ...`), `airflow X` and a bare `X` both run `airflow X`
# (`celery worker --queues gpu` is `airflow celery worker --queues gpu`). No arguments: `airflow version`.
# Database and broker waits are left to compose's health-gated depends_on (and Kubernetes' restarts).
set -euo pipefail
# Group-writable files and folders, as in Airflow's images: any UID of group 0 can share them.
umask 0002
# An arbitrary UID (compose's AIRFLOW_UID, OpenShift) has no passwd entry: give it the airflow home.
if ! whoami > /dev/null 2>&1; then
  export HOME="${AIRFLOW_USER_HOME_DIR:-/home/airflow}"
fi
if [ "$#" -eq 0 ]; then
  exec airflow version
fi
case "$1" in
  bash) shift; exec /bin/bash "$@" ;;
  python | python3) exec "$@" ;;
  airflow) shift; exec airflow "$@" ;;
  *) exec airflow "$@" ;;
esac
