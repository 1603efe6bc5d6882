#!/usr/bin/env bash
# The demo DAG (batch_llm_demo) through `airflow dags test` on a GPU host without network or Airflow: Airflow's
# wheelhouse is built where there is network and installed on the host offline, into a venv beside vLLM.
#
#   bash bench/gpu_dag_offline.sh build   where there is network (no GPU): Airflow and the demo's runtime wheels -> .gpu-stage/af
#   bash bench/gpu_dag_offline.sh check   there too (no GPU): installs that payload offline into a python3.12 venv as the
#                                         GPU host will and parses the DAG (torch-free), to show the wheel set resolves
#   bash bench/gpu_dag_offline.sh [run]   on the GPU host: install, migrate, parse, `airflow dags test`, check what was published
#
# The payload (.gpu-stage/af, git-ignored through .git/info/exclude's /.gpu-stage/): wheels.tar.xz holds the cp312
# manylinux / pure-Python wheels of apache-airflow 3.3.2 (core 3.3.2, task-sdk 1.3.2, providers-standard 1.21.0 and
# their dependencies) plus what the demo run imports beyond Airflow and the image (modelscope for fetch's cache-hit
# snapshot_download, matplotlib for publish's run report, prometheus-client, pyahocorasick, universal-pathlib,
# pathlib_abc, fsspec, gguf). `build` runs, with the pins of requirements.lock as constraints (the versions this
# project tests) except for the packages the host already has beside vLLM, pinned to the host's versions:
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
#     -c CONSTRAINTS -d DL $TOP          ($TOP and $VLLM_DEPS below)
# then leaves out what the host has ($VLLM_DEPS: vLLM's dependencies in /root/site; $IMAGE: the image's torch stack),
# repacks each remaining wheel uncompressed (ZIP_STORED; the RECORD hashes are of the files, so the wheels stay valid)
# and xz-compresses them as one tar: 51 MiB to copy instead of 82 MB of deflated wheels.
#
# On the GPU host, from the checkout's root (with .gpu-stage/af), in this order:
#   vLLM 0.26.0 installed into /root/site (bench/gpu_check_offline.sh's header: how);
#   bash bench/gpu_check_offline.sh gguf DIR     the demo's GGUF, five parts (part.aa..ae), into /root/gg (per folder)
#   bash bench/gpu_dag_offline.sh run
# (Where the demo model is already built in /root/cache, e.g. by a GPU check before, the GGUF is not needed.) `run`
# writes $OUT/gpu_dag.json (also printed as one `RESULT {...}` line) and the logs to $OUT/gpu_dag/.
# It switches the demo pipeline to the GPU path the documented way: a copy of dags/pipelines/demo.yaml with dotted-key
# overrides (PipelineConfig.with_overrides) in a folder of its own, named by $BATCH_LLM_PIPELINES_DIR (the folder
# dags/batch_llm_pipelines.py reads); the DAG id stays batch_llm_demo. The overrides: engine.kind vllm, engine.dtype
# bfloat16, engine.enforce_eager false (EAGER=1: true, the demo's CPU setting), evaluate.enabled false (EvalScope
# is not in the payload: its dependencies, pandas, plotly, nltk, sacrebleu and modelscope[datasets] among them, would
# double it), output.path a fresh folder.
# Knobs: T (most seconds for `airflow dags test`; default: 565 s less the time since `run` began), EAGER,
# KEEP_VENV=1 (a second run on the same host: reuse /root/afv instead of installing again).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
AF=$REPO/.gpu-stage/af
DAG_ID=batch_llm_demo
GGUF=/root/gg/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # the five parts, joined
# What is installed (the pins: requirements.lock's; apache-airflow-task-sdk / -providers-standard: .venv's)
TOP="apache-airflow==3.3.2 apache-airflow-core==3.3.2 apache-airflow-task-sdk==1.3.2 apache-airflow-providers-standard==1.21.0
modelscope==1.40.2 matplotlib==3.11.2 prometheus-client==0.26.0 pyahocorasick==2.3.1 universal-pathlib==0.3.10
pathlib-abc==0.5.2 fsspec==2026.2.0 gguf==0.19.0"
# In /root/site beside vLLM 0.26.0 (installed with it from its wheelhouse), at these versions
VLLM_DEPS="pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 openai-harmony==0.0.8 fastapi==0.136.3 starlette==1.10.0
msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 cachetools==8.0.2 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7
blake3==1.0.11 setproctitle==1.3.8 depyf==0.20.0 astor==0.8.1 dill==0.4.1 ijson==3.6.0 python-json-logger==4.2.0
llguidance==1.7.6 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 outlines_core==0.2.14 compressed-tensors==0.17.0
loguru==0.7.3 lark==1.2.2 interegular==0.3.3 lm-format-enforcer==0.11.3 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 prometheus-fastapi-instrumentator==8.1.0
watchfiles==1.3.0"
# In the GPU host's image beside torch 2.11 / transformers 5.17 (torch requires setuptools>=77.0.3 on Python 3.12, numpy:
# torch, transformers, vLLM). Only these two large ones are left out; the image's small pure-Python packages
# (jinja2, packaging, pyyaml, requests, psutil, ...) stay in the payload in case the image's versions are too old for
# Airflow (pip keeps an installed version that satisfies, else installs the payload's into the venv).
IMAGE="numpy setuptools"
PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64
 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"

die() { echo "GPU_DAG_FAIL [$1] $2" >&2; [ -n "${3:-}" ] && [ -f "$3" ] && tail -n "${4:-40}" "$3" >&2; exit "${5:-1}"; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }

# ------------------------------------------------------------------------------------------------------ build (here)
build() {
  local tmp; tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_dag_build.XXXXXX")
  python3 - "$REPO/requirements.lock" "$VLLM_DEPS" > "$tmp/constraints.txt" <<'PY' || die build "constraints"
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
vllm_deps = dict(p.split("==") for p in sys.argv[2].split())
names = {norm(n) for n in vllm_deps}
for line in open(sys.argv[1]):
    m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
    if m and norm(m[1]) not in names:
        print(f"{m[1]}=={m[2]}")
for n, v in vllm_deps.items():
    print(f"{n}=={v}")
PY
  echo "build: pip download into $tmp/dl"
  # shellcheck disable=SC2086
  python3 -m pip download -q $PLATFORM -c "$tmp/constraints.txt" -d "$tmp/dl" $TOP 2>&1 | grep -v "^WARNING: Location" \
    ; [ "${PIPESTATUS[0]}" = 0 ] || die build "pip download failed"
  mkdir -p "$AF" && rm -f "$AF"/wheels.tar.xz "$AF"/*.txt
  python3 - "$tmp" "$VLLM_DEPS $IMAGE" "$AF" <<'PY' || die build "repack"
import os, re, sys, zipfile
tmp, drop, af = sys.argv[1], sys.argv[2].split(), sys.argv[3]
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
drop = {norm(p.split("==")[0]) for p in drop}
os.makedirs(f"{tmp}/stored"); kept, dropped = [], []
for name in sorted(os.listdir(f"{tmp}/dl")):
    (dropped if norm(name.split("-")[0]) in drop else kept).append(name)
for name in kept:  # uncompressed inside, so that xz compresses the files themselves (and across wheels)
    with zipfile.ZipFile(f"{tmp}/dl/{name}") as zi, zipfile.ZipFile(f"{tmp}/stored/{name}", "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            zo.writestr(info, zi.read(info), compress_type=zipfile.ZIP_STORED)
size = lambda n: os.path.getsize(f"{tmp}/dl/{n}")
open(f"{af}/WHEELS.txt", "w").write("".join(f"{n}\t{size(n)}\n" for n in kept))
open(f"{af}/DROPPED.txt", "w").write("# left out: on the GPU host already (beside vLLM in /root/site, or the image)\n"
                                     + "".join(f"{n}\t{size(n)}\n" for n in dropped))
print(f"build: {len(kept)} wheels kept ({sum(map(size, kept)) / 2**20:.1f} MiB as downloaded), "
      f"{len(dropped)} left out ({sum(map(size, dropped)) / 2**20:.1f} MiB): {' '.join(n.split('-')[0] for n in dropped)}")
PY
  echo "build: xz -9e (a few minutes on one core)"
  tar -C "$tmp/stored" -cf - . | nice xz -9e -T1 > "$AF/wheels.tar.xz.partial" && mv "$AF/wheels.tar.xz.partial" "$AF/wheels.tar.xz" \
    || die build "tar | xz"
  cp "$tmp/constraints.txt" "$AF/CONSTRAINTS.txt"
  rm -rf "$tmp"
  grep -qx '/.gpu-stage/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.gpu-stage/' >> "$REPO/.git/info/exclude"
  ( cd "$REPO" && git check-ignore -q .gpu-stage/af ) || die build ".gpu-stage/af is not git-ignored"
  du -b "$AF"/* | sort -n
  echo "build: .gpu-stage/af = $(du -sb "$AF" | cut -f1) bytes ($(du -sm "$AF" | cut -f1) MiB); copy it to the GPU host with the checkout"
}

# ------------------------------------------------------------------------------------- shared by `check` and `run`
unpack() {  # $1 -> $2 (Python's tarfile: the image may lack xz)
  rm -rf "$2" && mkdir -p "$2"
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$1" "$2" \
    || die extract "could not unpack $1 (run: bash bench/gpu_dag_offline.sh build where there is network, and copy .gpu-stage/af)"
  echo "unpacked $(ls "$2"/*.whl | wc -l) wheels"
}

install_stack() {  # $1 python of the venv, $2 wheel folder, $3 log
  # shellcheck disable=SC2086
  "$1" -m pip install --no-index --find-links "$2" --no-compile --disable-pip-version-check $TOP > "$3" 2>&1 \
    || die install "pip could not install Airflow offline from the payload (a requirement the GPU host lacks and the payload left out? see DROPPED.txt)" "$3" 60
  grep -E "^Successfully installed" "$3" | tr ' ' '\n' | tail -n +3 | wc -l | xargs echo "installed into the venv:"
  "$1" -c "import airflow, airflow.sdk, airflow.providers.standard, modelscope, matplotlib, ahocorasick, upath, gguf, pydantic; \
print('airflow', airflow.__version__, '| pydantic', pydantic.__version__, pydantic.__file__)" \
    || die install "the installed stack does not import"
}

install_project() {  # $1 python of the venv, $2 log. Editable (the provider and plugin entry points), no deps
  if "$1" -m pip install --no-index --no-deps --no-build-isolation --disable-pip-version-check -e "$REPO" > "$2" 2>&1; then
    PROJECT_INSTALL=editable
  else
    tail -5 "$2"
    echo "WARNING: the editable install failed (setuptools>=68 not in the image?); falling back to a .pth to include/ (the UI plugin then comes from plugins/)"
    echo "$REPO/include" > "$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/batch_llm_include.pth"
    PROJECT_INSTALL=pth
  fi
  "$1" -c "import batch_llm_airflow.dag_factory, batch_llm.api, batch_llm.analysis.report" || die project "batch_llm does not import in the venv"
}

write_pipeline() {  # $1 python, $2 work folder: $2/pipelines/demo.yaml, the demo switched to the GPU path
  mkdir -p "$2/pipelines"
  "$1" - "$REPO/dags/pipelines/demo.yaml" "$2" "${EAGER:-0}" <<'PY' || die pipeline "could not write the GPU pipeline YAML"
import json, sys, yaml
from batch_llm.config import load_config
src, work, eager = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
over = {"engine.kind": "vllm", "engine.dtype": "bfloat16", "engine.enforce_eager": eager,
        "evaluate.enabled": False, "output.path": f"{work}/output"}
cfg = load_config(src).with_overrides(over, source="gpu_dag_offline")
with open(f"{work}/pipelines/demo.yaml", "w") as f:
    f.write("# dags/pipelines/demo.yaml with these overrides (bench/gpu_dag_offline.sh): " + json.dumps(over) + "\n")
    yaml.safe_dump(cfg.model_dump(mode="json"), f, sort_keys=False)
assert load_config(f"{work}/pipelines/demo.yaml").name == "batch_llm_demo"
print("pipeline:", json.dumps(over))
PY
}

airflow_env() {  # $1 work folder, $2 venv
  export AIRFLOW_HOME=$1/airflow BATCH_LLM_PIPELINES_DIR=$1/pipelines PATH=$2/bin:$PATH
  # shellcheck source=../scripts/airflow_env.sh
  source "$REPO/scripts/airflow_env.sh"  # SQLite, LocalExecutor, this checkout's dags/ and plugins/, offline hubs
}

parse_check() {  # $1 work folder
  airflow dags list --local -o json > "$1/dags_list.json" 2> "$1/parse.log" || die parse "airflow dags list failed" "$1/parse.log"
  airflow dags list-import-errors --local -o json > "$1/import_errors.json" 2>> "$1/parse.log" || die parse "airflow dags list-import-errors failed" "$1/parse.log"
  python3 - "$1" "$DAG_ID" <<'PY' || die parse "the demo DAG did not parse" "$1/parse.log"
import json, sys
work, dag_id = sys.argv[1], sys.argv[2]
def load(p):  # the JSON is the last line; log lines (structlog's "[warning  ]") may come before it
    for line in reversed(open(p).read().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    raise SystemExit(f"no JSON in {p}")
ids = [d.get("dag_id") for d in load(f"{work}/dags_list.json")]
errors = load(f"{work}/import_errors.json")
print("dags:", ids)
for e in errors:
    print("import error:", e.get("filepath"), "|", str(e.get("error", ""))[:300])
ours = [e for e in errors if "batch_llm_pipelines" in str(e.get("filepath"))]
bad = [i for i in ids if i and i.endswith("__invalid_config")]
sys.exit(1 if dag_id not in ids or ours or bad else 0)
PY
}

# ------------------------------------------------------------------------------------------------------ check (here)
check() {
  local py=${PY312:-python3.12} tmp; tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_dag_check.XXXXXX")
  "$py" -c "" 2>/dev/null || py=$(ls ~/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)  # a pyenv shim may refuse
  [ -n "$py" ] && "$py" -c "import sys; assert sys.version_info[:2] == (3, 12)" || die check "no Python 3.12 here (set PY312)"
  [ -f "$AF/wheels.tar.xz" ] || die check "no $AF/wheels.tar.xz: run build first"
  unpack "$AF/wheels.tar.xz" "$tmp/whl"
  "$py" -m venv "$tmp/venv" || die check "$py -m venv failed"
  local vpy=$tmp/venv/bin/python
  # The GPU host as the payload assumes it: the image's packages that build left out (numpy, setuptools), then
  # vLLM's dependencies (/root/site) as a folder on a .pth, from vLLM's wheelhouse (.gpu-stage/a/whl, else PyPI)
  echo "check: the image's left-out packages from PyPI: $IMAGE"
  # shellcheck disable=SC2086
  "$vpy" -m pip install -q --disable-pip-version-check numpy "setuptools>=77.0.3" || die check "numpy/setuptools"
  if ls "$REPO"/.gpu-stage/a/whl/*.whl >/dev/null 2>&1; then
    "$vpy" -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" "$REPO"/.gpu-stage/a/whl/*.whl || die check "vLLM's dependencies"
  else
    # shellcheck disable=SC2086
    "$vpy" -m pip install -q --no-deps --no-compile --target "$tmp/site" $VLLM_DEPS || die check "vLLM's dependencies from PyPI"
  fi
  echo "$tmp/site" > "$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/root_site.pth"
  local t; t=$(now)
  install_stack "$vpy" "$tmp/whl" "$tmp/pip_install.log"
  echo "check: offline install $(since "$t") s"
  "$vpy" -m pip list --disable-pip-version-check 2>/dev/null | grep -iE "^(pydantic|fastapi|starlette|msgspec|numpy|setuptools) " 
  "$vpy" -m pip check --disable-pip-version-check 2>&1 | grep -v -iE "vllm|xgrammar|compressed-tensors|lm-format|depyf|openai" | head -20
  install_project "$vpy" "$tmp/project_install.log"
  echo "check: project install: $PROJECT_INSTALL"
  "$vpy" -c "import sys; import torch" 2>/dev/null && die check "torch is importable here; the check is meant torch-free"
  write_pipeline "$vpy" "$tmp"
  airflow_env "$tmp" "$tmp/venv"
  export BATCH_LLM_MODEL_CACHE=${BATCH_LLM_MODEL_CACHE:-$REPO/.cache/modelscope} MODELSCOPE_CACHE=${MODELSCOPE_CACHE:-$REPO/.cache/modelscope}
  t=$(now); airflow db migrate > "$tmp/migrate.log" 2>&1 || die migrate "airflow db migrate failed" "$tmp/migrate.log"
  echo "check: db migrate $(since "$t") s"
  t=$(now); parse_check "$tmp"; echo "check: parse $(since "$t") s"
  "$vpy" -c "import sys; from batch_llm_airflow.dag_factory import build_pipeline_dags; from pathlib import Path
d = build_pipeline_dags(Path(sys.argv[1])); dag = d['$DAG_ID']
print('tasks:', sorted(dag.task_dict)); assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'parse imported the ML stack'" "$tmp/pipelines" \
    || die parse "building the DAG in-process failed"
  "$vpy" -c "import matplotlib; matplotlib.use('Agg'); from matplotlib.figure import Figure; f = Figure(); f.add_subplot().plot([1, 2]); \
f.savefig('$tmp/plot.png'); print('matplotlib', matplotlib.__version__, 'Agg PNG ok')" || die check "matplotlib cannot draw (publish's report)"
  if [ -f "$BATCH_LLM_MODEL_CACHE/models/HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/master/config.json" ]; then
    # The run itself with the engine-bound tasks (and those after them) marked success without running: fetch
    # (modelscope's cache-hit path, offline), the AWQ step (off) and plan run for real, torch-free
    t=$(now)
    airflow dags test "$DAG_ID" "$(date -u +%F)" --mark-success-pattern 'pipeline\.(batch_inference|content_filter|evaluate|publish)' \
      > "$tmp/dags_test_marked.log" 2>&1 || die run "airflow dags test (engine tasks marked success) failed" "$tmp/dags_test_marked.log"
    grep -oE "model .* resolved to .*cache hit: [A-Za-z]+|plan: [0-9]+ rows read, [^(]*|DagRun Finished: [^,]*" "$tmp/dags_test_marked.log"
    echo "check: dags test, engine tasks marked success, $(since "$t") s"
  else
    echo "check: no demo model in $BATCH_LLM_MODEL_CACHE (python -m batch_llm.demo_model): dags test not tried"
  fi
  echo "CHECK_OK (work folder $tmp)"
}

# -------------------------------------------------------------------------------------------------- run (GPU host)
run() {
  local t0 t; t0=$(now)
  : "${OUT:=/tmp/gpu_dag_out}"; mkdir -p "$OUT/gpu_dag"
  local W=/root/gpu_dag V=/root/afv LOGS=$OUT/gpu_dag
  test -f /root/site/vllm/_C_stable_libtorch.abi3.so \
    || die stage "VLLM_MISSING: vLLM is not installed in /root/site: install it from its wheelhouse first" "" 0 3
  unset PYTHONPATH  # /root/site comes through the venv's .pth, after the venv's own site-packages (what pip resolved)
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 BATCH_LLM_MODEL_CACHE=/root/cache MODELSCOPE_CACHE=/root/cache
  declare -A S
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  # 1 the venv: the image's packages visible (--system-site-packages), pip from the image (--without-pip:
  #   no ensurepip needed), /root/site (vLLM) through a .pth, which pip's resolver sees as installed distributions
  t=$(now)
  if [ "${KEEP_VENV:-0}" = 1 ] && [ -x $V/bin/airflow ]; then
    echo "venv: reusing $V"
  else
    [ -f "$AF/wheels.tar.xz" ] || die stage "no .gpu-stage/af/wheels.tar.xz: copy .gpu-stage/af here (built where there is network by: bash bench/gpu_dag_offline.sh build)"
    rm -rf $V $W && python3 -m venv --system-site-packages --without-pip $V || die venv "python3 -m venv failed"
    $V/bin/python -m pip --version || die venv "no pip importable in the venv (the image's pip is not on its system site-packages)"
    # /root/site, then every site folder of the image's own python3 (torch may sit in one that a venv's
    # --system-site-packages does not add, e.g. the user site or a distribution's dist-packages)
    { echo /root/site; env -u PYTHONPATH python3 -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))"; } \
      > "$($V/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/root_site.pth"
    cat "$($V/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/root_site.pth"
    $V/bin/python -c "import importlib.metadata as md, torch, transformers; print('vllm', md.version('vllm'), '| torch', torch.__version__, '| transformers', transformers.__version__)" \
      || die venv "the image's torch/transformers or /root/site's vLLM are not visible in the venv"
    unpack "$AF/wheels.tar.xz" /root/afwhl
    S[extract_venv]=$(since "$t"); t=$(now)
    install_stack $V/bin/python /root/afwhl "$LOGS/pip_install.log"
    S[install]=$(since "$t"); t=$(now)
    install_project $V/bin/python "$LOGS/project_install.log"
    S[project]=$(since "$t")
  fi
  # 2 the demo model in the ModelScope cache layout (a cache hit for fetch's snapshot_download)
  t=$(now)
  if [ ! -f /root/cache/models/HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/master/config.json ]; then
    if [ ! -f $GGUF ]; then
      [ "$(ls /root/gg/part.a? 2>/dev/null | wc -l)" = 5 ] \
        || die model "the demo GGUF is not in /root/gg: it has $(ls /root/gg 2>/dev/null | tr '\n' ' ')(need part.aa..ae: bash bench/gpu_check_offline.sh gguf DIR)"
      cat /root/gg/part.a? > $GGUF
    fi
    echo "$GGUF_SHA256  $GGUF" | sha256sum -c --quiet || die model "the GGUF's sha256 differs (a part missing or truncated)"
    BATCH_LLM_DEMO_GGUF=$GGUF $V/bin/python -m batch_llm.demo_model > "$LOGS/demo_model.log" 2>&1 \
      || die model "python -m batch_llm.demo_model failed" "$LOGS/demo_model.log"
    tail -1 "$LOGS/demo_model.log"
  fi
  S[model]=$(since "$t")
  # 3 Airflow home (SQLite), the GPU pipeline, migrate, parse
  rm -rf $W && mkdir -p $W
  write_pipeline $V/bin/python $W
  cp $W/pipelines/demo.yaml "$LOGS/pipeline_demo_gpu.yaml"
  airflow_env $W $V
  t=$(now); airflow db migrate > "$LOGS/migrate.log" 2>&1 || die migrate "airflow db migrate failed" "$LOGS/migrate.log"
  S[migrate]=$(since "$t"); t=$(now)
  parse_check $W; S[parse]=$(since "$t")
  # 4 the run
  # under T seconds (default: 565 s less the time since `run` began: a run held to 600 s keeps 35 s for the result)
  local ds rc lim; ds=$(date -u +%F); t=$(now)
  lim=$(python3 -c "import sys; print(int(min(float(sys.argv[1]), 565 - (float(sys.argv[2]) - float(sys.argv[3])))))" "${T:-565}" "$t" "$t0")
  echo "dags test: $DAG_ID $ds, limit ${lim} s (log: $LOGS/dags_test.log)"
  timeout -k 10 "$lim" airflow dags test "$DAG_ID" "$ds" > "$LOGS/dags_test.log" 2>&1; rc=$?
  S[dags_test]=$(since "$t")
  [ $rc = 0 ] || { echo "GPU_DAG_FAIL [run] airflow dags test exited $rc$([ $rc = 124 ] && echo " (timed out after $lim s)")" >&2
                   grep -E "Traceback|Error|error:|FAILED|failed" "$LOGS/dags_test.log" | tail -25 >&2; tail -30 "$LOGS/dags_test.log" >&2; }
  # 5 what the run published, and the RESULT line (written on a failed run too: the task states say where)
  local steps="" k; for k in "${!S[@]}"; do steps+="\"$k\": ${S[$k]}, "; done
  $V/bin/python - "$W" "$DAG_ID" "$ds" "$rc" "{${steps%, }}" "$(since "$t0")" "$OUT/gpu_dag.json" "${PROJECT_INSTALL:-reused venv}" <<'PY'
import collections, glob, json, os, shutil, sqlite3, subprocess, sys
work, dag_id, ds, rc, steps, wall, out, project = sys.argv[1:9]
res = {"ok": False, "dag_id": dag_id, "logical_date": ds, "dags_test_rc": int(rc), "wall_s": float(wall),
       "steps_s": json.loads(steps), "project_install": project}
try:
    res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip()
except OSError as e:
    res["gpu"] = repr(e)
from importlib.metadata import PackageNotFoundError, version
for p in ("apache-airflow-core", "vllm", "torch", "transformers"):
    try:
        res[p] = version(p)
    except PackageNotFoundError:
        res[p] = None
db = sqlite3.connect(f"{work}/airflow/airflow.db")
run = db.execute("select run_id, state, start_date, end_date from dag_run where dag_id=? order by id desc limit 1",
                 (dag_id,)).fetchone()
if run:
    res["run_id"], res["dag_run_state"] = run[0], run[1]
    tis = db.execute("select task_id, map_index, state, try_number, duration from task_instance "
                     "where dag_id=? and run_id=? order by start_date", (dag_id, run[0])).fetchall()
    res["tasks"] = {(t if m < 0 else f"{t}[{m}]"): {"state": s, "try": n, "s": round(d or 0, 1)}
                    for t, m, s, n, d in tis}
    res["task_state_counts"] = dict(collections.Counter(s or "none" for _, _, s, _, _ in tis))
try:
    from batch_llm.config import load_config
    from batch_llm.io.storage import Location, read_json
    cfg = load_config(f"{work}/pipelines/demo.yaml")
    lines = lambda p: sum(1 for x in open(p, encoding="utf-8") if x.strip())
    res["input_lines"] = lines(cfg.input.path)
    part = Location(cfg.output.path).child(cfg.name, cfg.output.partition.format(ds=ds))
    cur = read_json(part.child("_CURRENT.json").path())
    summary = read_json(Location(cur["version"]).child("summary.json").path())
    res["published_rows"] = lines(str(Location(cur["dataset"]).path()))
    res["error_lines"] = lines(str(Location(summary["errors"]).path()))
    res["pointer_rows"], res["rows"] = cur["rows"], summary.get("rows")
    r = summary.get("rows") or {}
    balanced = (r.get("read") == r.get("published", -1) + r.get("plan_errors", 0) + r.get("infer_errors", 0) + r.get("dropped", 0)
                and r.get("error_lines") == r.get("plan_errors", 0) + r.get("infer_errors", 0) + r.get("dropped", 0))
    res["accounted"] = (res["input_lines"] == res["published_rows"] + res["error_lines"] == r.get("read")
                        and res["published_rows"] == cur["rows"] == summary["rows_published"] and balanced)
    res["usage"] = summary.get("usage")
    from batch_llm.manifests import ShardManifest
    shards = []
    for s in (summary.get("manifests") or {}).get("infer") or []:
        if not isinstance(s.get("engine"), dict):  # a hand-off (ShardResult): the shard's manifest has the engine
            try:
                s = ShardManifest.read(Location(s["outputs"]).path().parent).model_dump(mode="json")
            except Exception as e:  # noqa: BLE001
                s = {**s, "engine": {"kind": s.get("engine"), "manifest_error": repr(e)}}
        e = s.get("engine") or {}
        shards.append({"shard": s.get("shard"), **{k: (s.get("metrics") or {}).get(k) for k in
                       ("rows", "ok", "errors", "output_tokens", "engine_start_seconds", "generate_seconds", "seconds")},
                       "engine": {"kind": e.get("kind"), "version": e.get("version"), **{k: (e.get("settings") or {}).get(k)
                                  for k in ("dtype", "device", "gpu_name", "enforce_eager", "compilation_mode",
                                            "cudagraph_mode", "cudagraph_sizes", "multiprocessing")}}})
    res["shards"] = shards
    res["evaluate_skipped"] = ((summary.get("manifests") or {}).get("evaluate") or {}).get("skipped")
    dst = os.path.join(os.path.dirname(out), "gpu_dag")
    for src in (Location(cur["version"]).child("summary.json").path(), Location(summary["errors"]).path(),
                Location(cur["dataset"]).path()):
        shutil.copy(str(src), os.path.join(dst, "published_" + os.path.basename(str(src))))
except Exception as e:  # noqa: BLE001 - a failed run publishes nothing: said in the result
    res["published_error"] = f"{type(e).__name__}: {e}"
res["ok"] = (int(rc) == 0 and res.get("dag_run_state") == "success" and res.get("accounted") is True
             and set(res.get("task_state_counts", {})) <= {"success", "skipped"})
json.dump(res, open(out, "w"), indent=1)
print("RESULT " + json.dumps(res))
sys.exit(0 if res["ok"] else 1)
PY
  local ok=$?
  [ $rc = 0 ] || die run "airflow dags test exited $rc: the RESULT line's tasks say which failed; $LOGS/dags_test.log" "" 0 1
  [ $ok = 0 ] || die check "the run succeeded but its output does not account for every input line (published + errors), or a task did not succeed: see RESULT" "" 0 1
  echo "GPU_DAG_OK in $(since "$t0") s"
}

case "${1:-run}" in
  build) build ;;
  check) check ;;
  run) run ;;
  *) echo "usage: bash bench/gpu_dag_offline.sh build|check|run" >&2; exit 2 ;;
esac
