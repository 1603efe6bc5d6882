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
# Every test module runs (issue: CI left four out). The browser UI test runs in a pytest process of its own:
# after the in-process dag.test() runs of other tests, its trigger form rendered no params (state left in the test
# process leaks into the services it starts). It mostly waits on its Airflow services and the browser, so it runs
# beside the rest rather than before it. Everything else runs on xdist workers, a module each at a time
# (--dist loadfile: a module's fixtures start once); tests/conftest.py hands them out longest first, so the
# workers finish at about the same time. The suite keeps ~1.4 of 2 cores busy with two workers (its tests wait on
# engine starts, schedulers and services), so a third worker fills the idle share.
mkdir -p var/test
.venv/bin/python -m pytest -p no:cacheprovider tests/system/test_ui_browser.py > var/test/browser.log 2>&1 &
browser_pid=$!
.venv/bin/python -m pytest -p no:cacheprovider --durations=25 -n "${TEST_WORKERS:-3}" --dist loadfile \
  --no-loadscope-reorder --ignore=tests/system/test_ui_browser.py
rest=$?
wait $browser_pid
browser=$?
echo "--- tests/system/test_ui_browser.py (its own process, beside the rest) ---"
cat var/test/browser.log
[ $browser -eq 0 ] && [ $rest -eq 0 ]
