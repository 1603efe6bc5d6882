#!/usr/bin/env bash
# Builds the two pinned virtual environments, idempotently; nothing else. Each gets its lock file plus this
# package (editable, --no-deps) and a stamp (a hash of the lock file and pyproject.toml): a run with nothing
# changed prints its decisions and "environments ready" and returns at once.
#   .venv           requirements.lock           Airflow, vLLM (CPU), the tests
#   .venv-quantize  requirements-quantize.lock  llm-compressor, for the AWQ export
# Not done here: the demo model is built offline by scripts/demo.sh and scripts/test.sh
# (python -m batch_llm.demo_model); the Debian packages of the service tests (redis-server, postgresql,
# chromium) are apt-installed as root by scripts/services.sh when those tests run, and Debian's prometheus and
# prometheus-pushgateway downloaded and unpacked into .cache/prometheus (no install, no root) by
# `scripts/services.sh prometheus` when tests/system/test_prometheus_pushgateway.py runs.
#
# Decided first, each said in one line:
#   python  $PYTHON when set; else the interpreter .venv was made with; else the first of python3.11,
#           python3.12, python3 that runs as CPython 3.11 or 3.12 (the versions the locks hold wheels for).
#   torch   the locks pin torch==<version>+cpu, which PyPI does not have: from $TORCH_FIND_LINKS (default
#           /opt/wheels) when that folder holds the wheel for the interpreter's cpXY tag, else from PyTorch's
#           CPU index $TORCH_INDEX_URL (default https://download.pytorch.org/whl/cpu) as an extra index
#           beside PyPI.
# uv: $UV, else `uv` on PATH, else installed with pip into .cache/uv-bootstrap (needs the interpreter's pip).
# SETUP_DRY_RUN=1: make the decisions, then print the commands a fresh build would run (and whether each
# environment is current) instead of running them; changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=${SETUP_DRY_RUN:-0}
[ "$DRY" = 0 ] && DRY=
SUPPORTED="3.11 3.12"

die() { echo "setup: error: $*" >&2; exit 1; }
run() {  # run CMD...: run it, or in a dry run print it
  if [ -n "$DRY" ]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

# probe EXE: "X.Y IMPLEMENTATION BASE_EXECUTABLE" when EXE runs, nothing otherwise
probe() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2], sys.implementation.name,
                            getattr(sys, "_base_executable", "") or sys.executable)' 2>/dev/null
}
supported() { [ "$2" = cpython ] && [[ " $SUPPORTED " == *" $1 "* ]]; }

# ---- python
PY= PY_VER= tried=()
try_python() {  # try_python CANDIDATE LABEL: sets PY/PY_VER when the candidate is acceptable
  local exe=$1 label=$2 ver impl base
  if ! command -v "$exe" >/dev/null 2>&1; then tried+=("$label not found"); return 1; fi
  read -r ver impl base <<<"$(probe "$exe")" || true
  if [ -z "${ver:-}" ]; then tried+=("$label ($(command -v "$exe")) does not run"); return 1; fi
  if ! supported "$ver" "$impl"; then tried+=("$label is ${impl/cpython/CPython} $ver ($base)"); return 1; fi
  PY=$base PY_VER=$ver
}
if [ -n "${PYTHON:-}" ]; then
  try_python "$PYTHON" "PYTHON=$PYTHON" || die "${tried[0]}; it must name CPython ${SUPPORTED// / or }"
  PY_FROM="PYTHON"
elif [ -x .venv/bin/python ] && try_python "$ROOT/.venv/bin/python" ".venv/bin/python"; then
  PY_FROM="the interpreter .venv was made with"
else
  for c in python3.11 python3.12 python3; do try_python "$c" "$c" && break; done
  if [ -z "$PY" ]; then
    list=$(printf '%s; ' "${tried[@]}")
    die "no CPython ${SUPPORTED// / or } found (tried ${list%; }): install Python 3.11 or 3.12 (Debian 12's python3 is 3.11), or set PYTHON=/path/to/python3.12"
  fi
  PY_FROM="found on PATH"
fi
echo "setup: python $PY_VER $PY ($PY_FROM)"
TAG=cp${PY_VER/./}

# ---- torch
TORCH_V=$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' requirements.lock | head -n 1)
[ -n "$TORCH_V" ] || die "requirements.lock pins no torch=="
FL_DIR=${TORCH_FIND_LINKS:-/opt/wheels}
INDEX=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
shopt -s nullglob
wheels=("$FL_DIR"/torch-"$TORCH_V"-"$TAG"-"$TAG"-*linux*_x86_64.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
  TORCH_SRC=(--find-links "$FL_DIR")
  echo "setup: torch $TORCH_V from $FL_DIR (local wheel folder)"
else
  TORCH_SRC=(--extra-index-url "$INDEX")
  if [ -d "$FL_DIR" ]; then why="$FL_DIR has no $TAG wheel"; else why="no local wheel folder"; fi
  echo "setup: torch $TORCH_V from $INDEX ($why)"
fi

# ---- the machine (warnings only)
[ "$(uname -sm)" = "Linux x86_64" ] || echo "setup: warning: checked on Linux x86_64 only, this is $(uname -sm)" >&2
libs=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)   # none: cannot tell, say nothing
if [ -n "$libs" ] && [[ $libs != *libnuma.so.1* ]]; then
  echo "setup: warning: libnuma.so.1 missing; vLLM's CPU engine needs it (Debian: apt-get install libnuma1)" >&2
fi

# ---- uv
if [ -n "${UV:-}" ]; then :
elif command -v uv >/dev/null 2>&1; then UV=uv
elif [ -x .cache/uv-bootstrap/bin/uv ]; then UV=$ROOT/.cache/uv-bootstrap/bin/uv
else
  [ -n "$DRY" ] || "$PY" -m pip --version >/dev/null 2>&1 ||
    die "uv not found and $PY has no pip: install uv (https://docs.astral.sh/uv/) or pip (Debian: python3-pip)"
  echo "setup: uv not on PATH: installing it into .cache/uv-bootstrap"
  run "$PY" -m pip install -q --disable-pip-version-check --target "$ROOT/.cache/uv-bootstrap" uv
  UV=$ROOT/.cache/uv-bootstrap/bin/uv
fi
# uv never downloads an interpreter here: it gets the one chosen above.
export UV_INDEX_STRATEGY=unsafe-best-match UV_LINK_MODE=${UV_LINK_MODE:-copy} UV_PYTHON_DOWNLOADS=never
[ -z "$DRY" ] || echo "+ export UV_INDEX_STRATEGY=$UV_INDEX_STRATEGY UV_LINK_MODE=$UV_LINK_MODE UV_PYTHON_DOWNLOADS=never"

make_env() {  # make_env DIR LOCKFILE
  local dir=$1 lock=$2 stamp=$1/.lock.sha have= ver impl base
  # the stamp covers how the venv is built too (bytecode since 2026-12-06): an older venv is synced again
  local want; want=$({ sha256sum "$lock" pyproject.toml; echo compile-bytecode; } | sha256sum | cut -c1-16)
  [ -f "$stamp" ] && have=$(cat "$stamp")
  if [ -x "$dir/bin/python" ]; then
    read -r ver impl base <<<"$(probe "$dir/bin/python")" || true
    if [ -n "${ver:-}" ] && [ "$ver" != "$PY_VER" ]; then
      [ "$have" = "$want" ] || die "$dir was made with Python $ver, the interpreter chosen is $PY_VER: remove $dir to rebuild it, or set PYTHON to a Python $ver"
      echo "setup: note: $dir is current and keeps its Python $ver (remove $dir to rebuild it with $PY_VER)"
      return
    fi
  fi
  if [ -n "$DRY" ]; then
    if [ "$have" = "$want" ]; then echo "setup: dry run: $dir is current ($want), a real run leaves it; a fresh build runs:"
    else echo "setup: dry run: $dir needs building from $lock; the commands:"; fi
  else
    [ "$have" = "$want" ] && return
    echo "setup: building $dir from $lock"
  fi
  if [ -n "$DRY" ] || [ ! -x "$dir/bin/python" ]; then
    local clear=()   # a venv whose interpreter is gone: uv refuses to write over it without --clear
    [ -e "$dir" ] && [ ! -x "$dir/bin/python" ] && clear=(--clear)
    run "$UV" venv -q "${clear[@]}" --python "$PY" "$dir"
  fi
  # --compile-bytecode: every package's .pyc written once here. Without it each process compiles what it imports,
  # and where PYTHONDONTWRITEBYTECODE is set (some CI sandboxes) it does so in every process, never caching:
  # importing vLLM took 23 s of CPU there against 11-12 s with the bytecode, in every process of make test importing it
  run "$UV" pip sync -q --compile-bytecode --python "$dir/bin/python" "${TORCH_SRC[@]}" "$lock"
  run "$UV" pip install -q --python "$dir/bin/python" --no-deps -e .
  if [ -n "$DRY" ]; then echo "+ echo $want > $stamp"; else echo "$want" > "$stamp"; fi
}
make_env .venv requirements.lock
make_env .venv-quantize requirements-quantize.lock
if [ -n "$DRY" ]; then echo "setup: dry run: nothing changed"; else echo "setup: environments ready"; fi
