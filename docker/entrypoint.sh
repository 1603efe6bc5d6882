#!/usr/bin/env bash
# Entrypoint of both images (under tini): `docker run IMAGE scheduler` runs `airflow scheduler`; a command
# that is a program of its own runs as it is: the KubernetesExecutor starts its task pods with
# `python -m airflow.sdk.execution_time.execute_workload ...`, and health checks run `celery` or `bash`.
set -euo pipefail
if [ "$#" -eq 0 ]; then
  exec airflow version
fi
case "$1" in
  airflow | python | python3 | bash | sh | celery | /*) exec "$@" ;;
  *) exec airflow "$@" ;;
esac
