#!/usr/bin/env bash
# On the lent H200, after ../shared/gpu's stage_a.sh / run_b.sh have put vLLM 0.26 into /root/site:
#   bash bench/gpu_run.sh fixed|mix|checks|resume|leases
# and, after `lmdeploy-stage` (carry .gpu-stage/lmd: LMDeploy 0.18 into /root/lmd, a random-weight
# Qwen2-7B-shaped model with a real tokenizer into /root/q7):  bash bench/gpu_run.sh lmdeploy
# Carry .gpu-stage/extra (universal-pathlib wheels, with_vllm.sh). Results land in $OUT.
set -uo pipefail
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
M=/root/work/qwen7b_cfg
vllm_env() {
  python3 -m pip install -q --no-index --no-deps --target /root/site .gpu-stage/extra/*.whl 2>&1 | grep -v WARNING
  export PYTHONPATH=/root/site:$PWD/include
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case "${1:-fixed}" in
  fixed) vllm_env; timeout 570 python3 bench/bench_inference.py --model $M --dummy --dataset fixed --n 1000 \
           --modes raw,stage --repeats ${REPEATS:-3} --warmup ${WARMUP:-1} --out $OUT/gpu.jsonl ;;
  mix)   vllm_env; timeout 570 python3 bench/bench_inference.py --model $M --dummy --dataset mix --n 2000 \
           --modes raw,stage --repeats ${REPEATS:-3} --warmup ${WARMUP:-1} --out $OUT/gpu.jsonl ;;
  hf)    vllm_env; timeout 540 python3 bench/bench_inference.py --model $M --dummy --dataset fixed --n 1000 \
           --modes raw,hf --repeats 1 --hf-n 128 --hf-batch 32 --out $OUT/gpu.jsonl ;;
  checks) vllm_env; timeout 540 python3 bench/gpu_checks.py --model $M --dummy stop resume | tee $OUT/checks.txt ;;
  resume|leases) vllm_env; timeout 540 python3 bench/gpu_checks.py --model $M --dummy "$1" | tee $OUT/$1.txt ;;
  lmdeploy-stage)
    S=.gpu-stage/lmd; mkdir -p /root/lmd && tar -C /root/lmd -xJf $S/site312.tar.xz || exit 3
    mkdir -p shared/gpu && cp -r $S/qwen7b_cfg shared/gpu/  # make_model.py reads the shape from there
    PYTHONPATH=/root/lmd timeout 300 python3 $S/make_model.py /root/q7 big 2>&1 | tail -2 ;;
  lmdeploy)
    python3 -m pip install -q --no-index --no-deps --target /root/lmd .gpu-stage/extra/*.whl 2>&1 | grep -v WARNING
    export PYTHONPATH=/root/lmd:$PWD/include TOKENIZERS_PARALLELISM=false
    timeout 540 python3 bench/bench_inference.py --engine lmdeploy --model /root/q7 --vocab 32000 --dataset fixed \
      --n 1000 --modes raw,stage --out $OUT/gpu_lmdeploy.jsonl ;;
esac
