#!/usr/bin/env bash
# The GPU check (python -m bench gpu-check) on the lent H200, which has no network: how it was staged and run.
# Here, once: bash ../shared/gpu/build_stage.sh . (vLLM 0.26.0 → .gpu-stage/a, b), bash ../shared/gpu/lmdeploy/
# build_payload.sh . (LMDeploy 0.18.0 → .gpu-stage/lmd), the demo's GGUF split into 23 MiB parts (.gpu-stage/g1..g3:
# a call carries 64 MiB; or its xz stream in parts named part.aa, part.ab, part.ac, unpacked by `check`), the quantize environment's wheels (llm-compressor 0.14.0.1 and what the image lacks →
# .gpu-stage/q) and universal-pathlib, pathlib_abc, fsspec, gguf, pyahocorasick wheels (.gpu-stage/extra). Device calls, back to back in one lease:
#   1  bash .gpu-stage/a/stage_a.sh; bash bench/gpu_check_h200.sh gguf g1              carry .gpu-stage/a .gpu-stage/g1 .gpu-stage/extra
#   2  bash .gpu-stage/b/run_b.sh bash bench/gpu_check_h200.sh setup                   carry .gpu-stage/b .gpu-stage/q
#   3  bash bench/gpu_check_h200.sh gguf g2; bash bench/gpu_check_h200.sh lmdeploy     carry .gpu-stage/g2 .gpu-stage/lmd
#   4  bash bench/gpu_check_h200.sh gguf g3; bash bench/gpu_check_h200.sh check ITEMS  carry .gpu-stage/g3
#   5  bash bench/gpu_check_h200.sh check ITEMS
set -uo pipefail
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
REPO=$PWD
export PYTHONPATH=/root/site:$REPO/include:$REPO BATCH_LLM_MODEL_CACHE=/root/cache MODELSCOPE_CACHE=/root/cache
GGUF=/root/gg/SmolLM2-135M-Instruct.Q4_1.gguf
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@" 2>&1 | grep -v WARNING; }
case "$1" in
  gguf) mkdir -p /root/gg && cp .gpu-stage/$2/part.* /root/gg/ && ls /root/gg
        [ -d .gpu-stage/extra ] && mkdir -p /root/extra && cp .gpu-stage/extra/* /root/extra/ ;;
  setup)  # the project's light dependencies beside vLLM; the quantize environment in a folder of its own
    pipi /root/site /root/extra/*.whl
    pipi /root/q .gpu-stage/q/*.whl   # compressed-tensors 0.19 for llm-compressor; vLLM keeps its 0.17
    printf '#!/bin/bash\nexport PYTHONPATH=/root/q:/root/site:%s/include\nexec python3 "$@"\n' "$REPO" > /root/qpy
    chmod +x /root/qpy; PYTHONPATH=/root/q:$PYTHONPATH python3 -c "import llmcompressor, compressed_tensors; print('llmcompressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__)" 2>&1 | tail -1
    python3 -c "import vllm, upath; print('vllm', vllm.__version__)" ;;
  lmdeploy)  # LMDeploy 0.18.0 (PyTorch engine) in /root/lmd, its own interpreter wrapper for engine.python
    mkdir -p /root/lmd && tar -C /root/lmd -xJf .gpu-stage/lmd/site312.tar.xz && pipi /root/lmd /root/extra/*.whl 2>/dev/null
    printf '#!/bin/bash\nexport PYTHONPATH=/root/lmd:/root/site:%s/include TOKENIZERS_PARALLELISM=false\nexec python3 "$@"\n' "$REPO" > /root/lmdpy
    chmod +x /root/lmdpy; /root/lmdpy -c "import lmdeploy; print('lmdeploy', lmdeploy.__version__)" ;;
  check)
    if [ ! -f $GGUF ]; then  # the parts of the file, or of its xz stream (`xz -6`: 90.5 of 98.4 MB, three calls' room)
      if head -c 6 "$(ls /root/gg/part.* | head -1)" | grep -aq 7zXZ; then
        cat /root/gg/part.* | python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > $GGUF
      else cat /root/gg/part.* > $GGUF; fi
    fi
    sha256sum $GGUF | cut -c1-16
    BATCH_LLM_DEMO_GGUF=$GGUF python3 -m batch_llm.demo_model 2>&1 | tail -1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    BATCH_LLM_LMDEPLOY_PATH=/root/lmd BATCH_LLM_QUANTIZE_PYTHON=/root/qpy timeout ${T:-560} python3 -m bench gpu-check --items "${2:-bf16}" \
      --rows ${ROWS:-512} --lmdeploy-python /root/lmdpy --out $OUT/gpucheck
    rc=$?; for f in $OUT/gpucheck/*.log; do echo "== $f"; grep -E "Error|error:|Traceback|FAIL|refus" "$f" | tail -5; done
    exit $rc ;;
esac
