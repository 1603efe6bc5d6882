#!/usr/bin/env bash
# The GPU check (python -m bench gpu-check) on a GPU host without network: what it needs is built into wheelhouses
# where there is network, copied to the host with the checkout, and installed there offline.
# Where there is network (each payload under the git-ignored .gpu-stage/):
#   vLLM 0.26.0 and the wheels it needs beside the host image's torch (`pip download vllm==0.26.0 ...`), installed on
#     the host with `pip install --no-index --no-deps --target /root/site` (not needed where the image has vLLM);
#   .gpu-stage/extra  the project's light dependencies the image lacks: universal-pathlib, pathlib_abc, fsspec, gguf,
#                     pyahocorasick (`pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpu-stage/extra`);
#   .gpu-stage/q      the quantize environment: llm-compressor 0.14.0.1 and what the image lacks (compressed-tensors 0.19;
#                     vLLM keeps its 0.17, so it gets a folder of its own);
#   .gpu-stage/lmd    LMDeploy 0.18.0 (PyTorch engine) installed into a folder and packed as site312.tar.xz;
#   .gpu-stage/DIR    the demo's GGUF as part.* files: the file split (`split -b 23M`), or its xz stream split
#                     (`xz -6`: 90.5 of 98.4 MB), where the copy to the host limits a file's size.
# On the GPU host, from the checkout's root, in this order:
#   bash bench/gpu_check_offline.sh gguf DIR       the GGUF's parts from .gpu-stage/DIR (and .gpu-stage/extra) into /root
#   bash bench/gpu_check_offline.sh setup          .gpu-stage/extra beside vLLM, the quantize environment in /root/q
#   bash bench/gpu_check_offline.sh lmdeploy       LMDeploy into /root/lmd, with its interpreter wrapper (engine.python)
#   bash bench/gpu_check_offline.sh check ITEMS    the GGUF joined, the demo model built, the check run into $OUT/gpucheck
#     (the sglang items need SGLang installed into /root/sgl with pip --target: docs/engines-and-gpus.md, SGLang)
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
    if [ ! -f $GGUF ]; then  # the parts of the file, or of its xz stream
      if head -c 6 "$(ls /root/gg/part.* | head -1)" | grep -aq 7zXZ; then
        cat /root/gg/part.* | python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > $GGUF
      else cat /root/gg/part.* > $GGUF; fi
    fi
    sha256sum $GGUF | cut -c1-16
    BATCH_LLM_DEMO_GGUF=$GGUF python3 -m batch_llm.demo_model 2>&1 | tail -1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    [ -f /root/sgl/.staged ] && export BATCH_LLM_SGLANG_PATH=/root/sgl  # SGLang's own folder: the sglang items
    BATCH_LLM_LMDEPLOY_PATH=/root/lmd BATCH_LLM_QUANTIZE_PYTHON=/root/qpy timeout ${T:-560} python3 -m bench gpu-check --items "${2:-bf16}" \
      --rows ${ROWS:-512} --lmdeploy-python /root/lmdpy --out $OUT/gpucheck
    rc=$?; for f in $OUT/gpucheck/*.log; do echo "== $f"; grep -E "Error|error:|Traceback|FAIL|refus" "$f" | tail -5; done
    exit $rc ;;
esac
