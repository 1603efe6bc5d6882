#!/usr/bin/env bash
# Runs the whole test suite (unit, end-to-end on the real vLLM engine, Airflow runs) in the project's venv.
# The browser test runs in a pytest process of its own: after the in-process dag.test() runs of other tests,
# its trigger form rendered no params (state left in the test process leaks into the services it starts).
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check . || exit 1                                  # lint first: seconds, and the same as make check
.venv/bin/python -m batch_llm.demo_model >/dev/null || exit 1   # cached after the first build
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -p no:cacheprovider --durations=20 "$@"
fi
# Every test module runs (issue: CI left four out). The browser UI test runs first, in a pytest process of its own:
# after the in-process dag.test() runs of other tests, its trigger form rendered no params (state left in the test
# process leaks into the services it starts). Everything else runs on two xdist workers, a module each at a time
# (--dist loadfile: a module's fixtures start once); tests/conftest.py hands them out longest first, so both
# workers finish at about the same time. The suite keeps one core busy on average (engine starts, Airflow
# processes), so two workers run it in about two thirds of the time.
.venv/bin/python -m pytest -p no:cacheprovider tests/system/test_ui_browser.py
browser=$?
.venv/bin/python -m pytest -p no:cacheprovider --durations=25 -n "${TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder --ignore=tests/system/test_ui_browser.py
rest=$?
[ $browser -eq 0 ] && [ $rest -eq 0 ]
