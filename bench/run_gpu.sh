#!/usr/bin/env bash
# The GPU benchmarks on a GPU host without network: bash bench/run_gpu.sh MODE (or python -m bench gpu MODE), from the
# checkout's root. Needs vLLM 0.26.0 installed into /root/site from its wheelhouse (bench/gpu_check_offline.sh's
# header: what is built where there is network, and how it is installed), .gpu-stage/extra (the project's light
# wheels, installed beside vLLM first) and the 7B shape's config.json in /root/work/qwen7b_cfg (random weights:
# load_format dummy). Results land in $OUT.
#   bash bench/run_gpu.sh fixed|mix|unique|replicas|chat|shards|hf|checks|resume|leases|guided|spec|fp8|compile_cache|gc_import|profile
#     |sglang-mix|sglang-chat|sglang-settings|thinking|review-placement|vl|vl-preprocess
#   fixed (N, IN_LEN, OUT_LEN) / unique: ENGINE_SETTINGS (JSON) every mode's engine keys, e.g. '{"quantization": "fp8"}';
#     STAGE_ENGINE the stage-x mode's, e.g. '{"precision": "auto"}' (the precision gate on the day's rows);
#     fixed: PRECISION_STORE a folder where the gate's decision is kept across runs (the first run calibrates)
#   fixed / mix: raw LLM.generate against the stage (MODES, REPEATS, WARMUP, T); the GPU's clocks, power and
#     temperature are sampled meanwhile (python3 -m bench telemetry; TELEMETRY=0: not) and summarized per run phase
#     at the end; MODES=raw,stage,stage-inproc adds the stage with vLLM's engine core in its worker process;
#     mix: MODES=raw,stage-x STAGE_EXTRA='{"compilation_config": ...}' the stage with extra engine arguments;
#     MODES=stage-vllm-graphs,stage the stage's offline CUDA graphs against vLLM's own; MODES=stage-compile,stage the
#     stage with torch.compile against without (the default under the offline graphs). The alternating order always
#     opens with the first mode, and the opening run can be the slowest: repeat a pair with its MODES reversed.
#   chat: N review-extraction chats through LLM.chat (raw, raw-tuned) and the stage's messages rows (TOK below;
#     CHAT_ARGS="--output-schema FILE" decodes under a JSON schema)
#   unique: the mix without repeated prompts (N rows, 12,000 by default): only the stage's order and overlap can count;
#     one invocation (REPEATS=1, two runs) takes ~5-6 minutes on an H100, so the 3 alternating runs a mode take three
#     invocations with MODES reversed in turn (raw-tuned,stage / stage,raw-tuned / raw-tuned,stage)
#   replicas: the unique day (N, 12,000) on a small shape (MODEL, the Qwen2.5-1.5B shape by default): raw-tuned against the
#     stage with engine.replicas R (2; stage-x) and the stage with one engine, after one short unrecorded warm-up run
#     (MODES reversed in turn for the 3 runs a mode; MODES=raw-tuned,raw-tuned-x2: the script as two processes)
#   shards: SHARDS shards of 2,000 mix rows on one engine, sharding.shards_per_task = SHARDS: the engine start's share
#   checks | resume | leases: python3 -m bench gpu-checks (stop, crash and resume, GPU leases of two shard tasks)
#   lmdeploy | lmdeploy-mix, after lmdeploy-stage (.gpu-stage/lmd: LMDeploy 0.18 unpacked into /root/lmd, a
#     random-weight Qwen2-7B-shaped model with a real tokenizer built into /root/q7)
#   python3 -m bench gpu-features (one process per engine, each under its own timeout):
#   guided  TOK=.gpu-stage/tok (default): a small real tokenizer, the demo model's tokenizer files, made with
#           mkdir -p .gpu-stage/tok && cp "$(.venv/bin/python -m batch_llm.demo_model)"/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu-stage/tok/
#           GUIDED_ARGS=--compact-json: no free whitespace in the grammar; TAG names the log
#           TOK=.gpu-stage/qwentok: a Qwen2.5 tokenizer (151,665 tokens, the 7B shape's real vocabulary),
#           made with  .venv/bin/python -m bench qwen-tokenizer --out .gpu-stage/qwentok && xz -9 .gpu-stage/qwentok/tokenizer.json
#           (1.9 MB to copy; unpacked on the host); also for chat
#           GUIDED_ARGS="--compact-json --without-length-bounds": sampling.guided_length_bounds: check
#   spec    .gpu-stage/numba (numba + llvmlite cp312 wheels, 64 MB: vLLM's CPU n-gram proposer needs them):
#           .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#             --platform manylinux_2_28_x86_64 numba llvmlite -d .gpu-stage/numba
#   fp8     bf16 vs quantization=fp8 vs kv_cache_dtype=fp8, vLLM's compile cache off (VLLM_DISABLE_COMPILE_CACHE=1;
#           torch inductor's and Triton's own caches are not cleared, so later starts may still reuse kernels)
#   profile .gpu-stage/pyspy (`pip download --no-deps py-spy -d .gpu-stage/pyspy`): py-spy over one run a mode
#   SGLang (engine.kind: sglang), installed into /root/sgl (PYTHONPATH=/root/sgl:include; its pins conflict with
#   vLLM's, so its own folder): TOK (a Qwen2.5 tokenizer, above: SGLang returns text, so the random-weight model
#   gets a tokenizer, and so do the vLLM modes it is compared with)
#   sglang-mix | sglang-chat  a plain sglang.Engine script with the stage's settings (raw) against the stage on
#           SGLang and the stage on vLLM (vllm:stage, /root/site), alternating (MODES, REPEATS, WARMUP: the first
#           SGLang start compiles its JIT kernels with nvcc into ~/.cache/tvm-ffi, which later starts reuse)
#   sglang-settings  the stage on SGLang with SGLANG_SETTINGS (JSON merged into its engine section, e.g.
#           '{"sglang": {"cuda_graph_max_bs": 512}}', '{"max_num_seqs": 1024}', '{"gpu_memory_utilization": 0.85}')
#           against without (stage-x against stage)
#   thinking  a Qwen3-8B-shaped random-weight model (bench/shapes/qwen3-8b; QTOK, a Qwen3 tokenizer:
#           .venv/bin/python -m bench qwen-tokenizer --qwen3 --out .gpu-stage/qwen3tok && xz -9 .gpu-stage/qwen3tok/tokenizer.json)
#           on vLLM, the chat dataset: thinking on with a BUDGET-token thinking budget against thinking off
#   vl      a Qwen2.5-VL-7B-shaped random-weight model (bench/shapes/qwen2.5-vl-7b; VLTOK, a Qwen2.5 tokenizer with
#           Qwen2.5-VL's chat template and processor settings:
#           .venv/bin/python -m bench qwen-tokenizer --vl --out .gpu-stage/vltok && xz -9 .gpu-stage/vltok/tokenizer.json)
#           over N (1000) rows of one generated PNG and a question each (the images dataset): a plain LLM.chat
#           script with file:// image parts and the stage's engine settings (raw-tuned; raw: vLLM's defaults) against
#           the stage over the same rows as JSONL (MODES raw-tuned,stage, REPEATS, WARMUP 1; a 600 s limit (T) fits
#           the warm-up and about four runs on an H100); VL_ARGS adds options (--image-size 448, --out-len 256 by
#           default; --mm-processor-kwargs)
#   vl-preprocess  the CPU side of an image row (python -m bench image-preprocess): PNG decode and the shape's image
#           processor (PIL and torchvision) at 1-16 threads, then vLLM's own per-row preparation (process_inputs), timed
#           and profiled, with the shape's config and VLTOK's tokenizer (N images, 300)
#   vl-kept  image rows (N distinct images a batch, 64 tokens out) on one engine of the Qwen2.5-VL-7B shape with the
#           engine's Hugging Face processor kept (the stage's engine) against vLLM as it is, alternating (REPEATS)
#   review-placement  filter.review as its own worker after the shard (the review task) against the generating worker
#           swapping engines (python -m bench review-placement), the 7B shape reviewing itself, TOK as above
set -uo pipefail
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
M=${MODEL:-/root/work/qwen7b_cfg}  # MODEL: another shape, e.g. bench/shapes/qwen2.5-1.5b
TOK=${TOK:-.gpu-stage/tok}
QTOK=${QTOK:-.gpu-stage/qwen3tok}
VLTOK=${VLTOK:-.gpu-stage/vltok}
for t in $TOK $QTOK $VLTOK; do
  if [ -f $t/tokenizer.json.xz ] && [ ! -f $t/tokenizer.json ]; then  # copied xz-packed (1.9 MB): unpack it
    python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
      $t/tokenizer.json.xz $t/tokenizer.json
  fi
done
vllm_env() {
  python3 -m pip install -q --no-index --no-deps --target /root/site .gpu-stage/extra/*.whl 2>&1 | grep -v WARNING
  export PYTHONPATH=/root/site:$PWD/include
}
telemetry_on() {  # the GPU's clocks, power and temperature every 0.2 s into $OUT, for `telemetry by-run` over $1's runs
  [ "${TELEMETRY:-1}" = 1 ] || return 0
  TELEMETRY_RUNS=${1:-$OUT/gpu.jsonl}
  python3 -m bench telemetry record --out $OUT/gpu_telemetry.jsonl & TELEMETRY_PID=$!
  trap 'kill $TELEMETRY_PID 2>/dev/null; wait $TELEMETRY_PID 2>/dev/null
        python3 -m bench telemetry by-run --telemetry $OUT/gpu_telemetry.jsonl --runs $TELEMETRY_RUNS \
          > $OUT/gpu_telemetry_by_run.jsonl && cat $OUT/gpu_telemetry_by_run.jsonl' EXIT
}
log_summary() {  # the lines of a log that matter, short
  grep -E "^RESULT|GPU KV cache size|Maximum concurrency|torch.compile took|init engine|Error|Traceback" "$1" \
    | grep -v "^RESULT.*\"phase\": \"engine\".*kv_cache_tokens" | cut -c1-500 | tail -30
  grep -E "^RESULT.*\"phase\": \"engine\"" "$1" | grep -oE "\"(construct_s|kv_cache_tokens|import_s)\": [0-9.]+" | tr '\n' ' '; echo
}
sglang_env() {  # SGLang's folder (/root/sgl, installed with pip --target), and vLLM's for the comparison
  test -f /root/sgl/.staged || { echo "SGL_NOT_STAGED: install SGLang into /root/sgl first (pip --target; docs/engines-and-gpus.md)"; exit 3; }
  [ -d /root/site/vllm ] && vllm_env  # the vLLM stage, for the vllm: modes
  SGL_PATHS=(--engine-path sglang=/root/sgl:$PWD/include --engine-path vllm=/root/site:$PWD/include)
  export PYTHONPATH=/root/sgl:$PWD/include
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case "${1:-fixed}" in
  fixed) vllm_env; telemetry_on; timeout ${T:-570} python3 -m bench inference --model $M --dummy --dataset fixed \
           --n ${N:-1000} --in-len ${IN_LEN:-256} --out-len ${OUT_LEN:-256} --modes ${MODES:-raw,stage} \
           --repeats ${REPEATS:-3} --warmup ${WARMUP:-1} --out $OUT/gpu.jsonl --logs $OUT/logs \
           ${ENGINE_SETTINGS:+--engine-settings "$ENGINE_SETTINGS"} ${STAGE_ENGINE:+--stage-engine "$STAGE_ENGINE"} \
           ${PRECISION_STORE:+--precision-store "$PRECISION_STORE"} ;;
  mix)   vllm_env; telemetry_on; timeout ${T:-570} python3 -m bench inference --model $M --dummy --dataset mix --n 2000 \
           --modes ${MODES:-raw,stage} --repeats ${REPEATS:-3} --warmup ${WARMUP:-1} --out $OUT/gpu.jsonl --logs $OUT/logs \
           ${STAGE_EXTRA:+--stage-extra "$STAGE_EXTRA"} ;;
  unique) vllm_env; telemetry_on; timeout ${T:-570} python3 -m bench inference --model $M --dummy --dataset unique \
           --n ${N:-12000} --modes ${MODES:-raw-tuned,stage} --repeats ${REPEATS:-1} --warmup ${WARMUP:-0} \
           --out $OUT/gpu_unique.jsonl --logs $OUT/logs ${STAGE_EXTRA:+--stage-extra "$STAGE_EXTRA"} \
           ${ENGINE_SETTINGS:+--engine-settings "$ENGINE_SETTINGS"} ${STAGE_ENGINE:+--stage-engine "$STAGE_ENGINE"} ;;
  replicas) vllm_env; M=${MODEL:-bench/shapes/qwen2.5-1.5b}  # a short unrecorded run fills the caches a first start fills
    timeout 200 python3 -m bench inference --model $M --dummy --dataset unique --n 300 --modes raw-tuned --repeats 1 \
      > $OUT/replicas-warmup.log 2>&1
    telemetry_on; timeout ${T:-540} python3 -m bench inference --model $M --dummy --dataset unique --n ${N:-12000} \
           --modes ${MODES:-raw-tuned,stage-x,stage} --repeats ${REPEATS:-1} --warmup 0 --out $OUT/gpu_replicas.jsonl \
           --logs $OUT/logs --stage-engine "{\"replicas\": ${R:-2}}" ;;
  chat)  vllm_env; telemetry_on; timeout ${T:-570} python3 -m bench inference --model $M --dummy --tokenizer $TOK \
           --dataset chat --n ${N:-4000} --modes ${MODES:-raw-tuned,stage} --repeats ${REPEATS:-3} --warmup ${WARMUP:-0} \
           --out $OUT/gpu_chat.jsonl --logs $OUT/logs ${STAGE_EXTRA:+--stage-extra "$STAGE_EXTRA"} ${CHAT_ARGS:-} ;;
  shards) vllm_env; timeout ${T:-570} python3 -m bench inference --model $M --dummy --dataset mix --n 2000 \
           --shards ${SHARDS:-10} --modes stage-shards --repeats 1 --out $OUT/gpu_shards.jsonl --logs $OUT/logs ;;
  hf)    vllm_env; timeout 540 python3 -m bench inference --model $M --dummy --dataset fixed --n 1000 \
           --modes raw,hf --repeats 1 --hf-n 128 --hf-batch 32 --out $OUT/gpu.jsonl ;;
  checks) vllm_env; timeout 540 python3 -m bench gpu-checks --model $M --dummy stop resume | tee $OUT/checks.txt ;;
  resume|leases) vllm_env; timeout 540 python3 -m bench gpu-checks --model $M --dummy "$1" | tee $OUT/$1.txt ;;
  guided) vllm_env
    timeout -k 10 ${T:-540} python3 -m bench gpu-features guided --model $M --tokenizer $TOK ${GUIDED_ARGS:-} \
      --out $OUT/features_guided.jsonl >$OUT/guided${TAG:-}.log 2>&1; echo "guided rc=$?"; log_summary $OUT/guided${TAG:-}.log ;;
  spec) vllm_env
    python3 -m pip install -q --no-index --no-deps --target /root/site .gpu-stage/numba/*.whl 2>&1 | grep -v WARNING
    python3 -c "import numba; print('numba', numba.__version__)" >$OUT/numba_import.txt 2>&1; tail -2 $OUT/numba_import.txt
    for m in ${METHODS:-plain ngram ngram_gpu}; do
      timeout -k 10 ${T:-180} python3 -m bench gpu-features spec --model $M --method $m \
        --out $OUT/features_spec.jsonl >$OUT/spec_$m.log 2>&1; echo "spec $m rc=$?"; log_summary $OUT/spec_$m.log
    done ;;
  fp8) vllm_env; export VLLM_DISABLE_COMPILE_CACHE=1
    for v in ${VARIANTS:-bf16 fp8 fp8kv}; do
      timeout -k 10 ${T:-185} python3 -m bench gpu-features fp8 --model $M --variant $v \
        --out $OUT/features_fp8.jsonl >$OUT/fp8_$v.log 2>&1; echo "fp8 $v rc=$?"; log_summary $OUT/fp8_$v.log
    done ;;
  compile_cache) vllm_env  # engine.compile_cache cold vs warm, a fresh process per engine start (file:// store)
    timeout 565 python3 -m bench compile-cache --model $M --dummy --pairs ${PAIRS:-3} --timeout ${T:-140} \
      --out $OUT/compile_cache.jsonl 2>&1 | tee $OUT/compile_cache.log ;;
  gc_import) vllm_env  # the engine start with the collector paused over vLLM's import against without (bench/gc_import.py)
    timeout ${T:-565} python3 -m bench gc-import --model $M --dummy --pairs ${PAIRS:-3} --timeout 150 \
      --out $OUT/gc_import.jsonl 2>&1 | tee $OUT/gc_import.log ;;
  lmdeploy-stage)
    S=.gpu-stage/lmd; mkdir -p /root/lmd && tar -C /root/lmd -xJf $S/site312.tar.xz || exit 3
    mkdir -p shared/gpu && cp -r $S/qwen7b_cfg shared/gpu/  # make_model.py reads the shape from there
    PYTHONPATH=/root/lmd timeout 300 python3 $S/make_model.py /root/q7 big 2>&1 | tail -2 ;;
  profile)  # where each process of one raw and one stage run spends its time in generation: py-spy
    # (.gpu-stage/pyspy), non-blocking sampling at RATE Hz (blocking sampling slowed the engine start ~3x),
    # summarized on the host (the raw stacks are large)
    vllm_env; python3 -m pip install -q --no-index --no-deps --target /root/pyspy .gpu-stage/pyspy/*.whl 2>&1 | grep -v WARNING
    modes=${MODES:-raw,stage}
    for mode in ${modes//,/ }; do
      BENCH_T0=$(date +%s.%N) timeout -k 10 ${T:-300} /root/pyspy/bin/py-spy record --nonblocking --subprocesses --idle \
        --threads -r ${RATE:-50} -f raw -o /tmp/profile_$mode.txt -- python3 -m bench inference --model $M --dummy \
        --dataset ${DATASET:-mix} --n ${N:-2000} ${PROFILE_ARGS:-} --child $mode > $OUT/profile_$mode.log 2>&1
      echo "profile $mode rc=$?"; grep -E "^RESULT" $OUT/profile_$mode.log | cut -c1-400
      python3 -m bench profile-summary /tmp/profile_$mode.txt > $OUT/profile_${mode}_summary.txt
      gzip -c /tmp/profile_$mode.txt > $OUT/profile_$mode.txt.gz
    done ;;
  sglang-mix|sglang-chat)  # raw: the plain sglang.Engine script with the stage's settings
    sglang_env; telemetry_on $OUT/gpu_sglang.jsonl
    if [ "$1" = sglang-mix ]; then data=(--dataset mix --n ${N:-2000}); else data=(--dataset chat --n ${N:-4000}); fi
    timeout ${T:-570} python3 -m bench inference --engine sglang "${SGL_PATHS[@]}" --model $M --dummy --tokenizer $TOK \
      "${data[@]}" --modes ${MODES:-raw,stage,vllm:stage} --repeats ${REPEATS:-3} --warmup ${WARMUP:-1} \
      --out $OUT/gpu_sglang.jsonl --logs $OUT/logs ;;
  sglang-settings)
    sglang_env
    timeout ${T:-570} python3 -m bench inference --engine sglang "${SGL_PATHS[@]}" --model $M --dummy --tokenizer $TOK \
      --dataset ${DATASET:-mix} --n ${N:-2000} --modes ${MODES:-stage,stage-x} --repeats ${REPEATS:-3} \
      --warmup ${WARMUP:-0} --stage-engine "${SGLANG_SETTINGS:?a JSON of engine keys}" \
      --out $OUT/gpu_sglang_settings.jsonl --logs $OUT/logs ;;
  thinking)
    vllm_env; telemetry_on $OUT/gpu_thinking.jsonl
    timeout ${T:-570} python3 -m bench inference --model bench/shapes/qwen3-8b --dummy --tokenizer $QTOK --dataset chat \
      --n ${N:-2000} --thinking-budget ${BUDGET:-256} --modes ${MODES:-stage,stage-think-off} --repeats ${REPEATS:-3} \
      --warmup ${WARMUP:-0} --out $OUT/gpu_thinking.jsonl --logs $OUT/logs ;;
  vl)
    vllm_env; telemetry_on $OUT/gpu_vl.jsonl
    timeout ${T:-570} python3 -m bench inference --model bench/shapes/qwen2.5-vl-7b --dummy --tokenizer $VLTOK \
      --dataset images --n ${N:-1000} --modes ${MODES:-raw-tuned,stage} --repeats ${REPEATS:-3} --warmup ${WARMUP:-1} \
      --out $OUT/gpu_vl.jsonl --logs $OUT/logs ${VL_ARGS:-} ;;
  vl-preprocess)
    vllm_env; d=$(mktemp -d); cp $VLTOK/* $d/; rm -f $d/tokenizer.json.xz; cp bench/shapes/qwen2.5-vl-7b/*.json $d/
    timeout ${T:-400} python3 -m bench image-preprocess --processor $d --vllm-model $d --n ${N:-300} --threads 1,4,8,16 --vllm-threads ${VLLM_THREADS:-1,4,8} \
      --out $OUT/image_preprocess.jsonl > $OUT/image_preprocess.log 2>&1; echo "vl-preprocess rc=$?"
    grep -E "^RESULT" $OUT/image_preprocess.log ;;
  vl-kept)  # image rows with the engine's Hugging Face processor kept against vLLM as it is, one engine, alternating
    vllm_env; timeout ${T:-400} python3 -m bench processor-kept --shape bench/shapes/qwen2.5-vl-7b --tokenizer $VLTOK \
      --n ${N:-300} --repeats ${REPEATS:-2} --out $OUT/processor_kept.jsonl > $OUT/processor_kept.log 2>&1
    echo "vl-kept rc=$?"; grep -E "^RESULT|started in" $OUT/processor_kept.log ;;
  review-placement)
    vllm_env
    timeout ${T:-570} python3 -m bench review-placement --model $M --dummy --tokenizer $TOK --n ${N:-2000} \
      --modes ${MODES:-task,swap} --repeats ${REPEATS:-3} --timeout ${RUN_T:-300} --out $OUT/gpu_review_placement.jsonl \
      2>&1 | tee $OUT/review_placement.log | grep -vE "^\s+\[stage\]" ;;
  lmdeploy|lmdeploy-mix)  # raw gets the same token ids as the stage; REPEATS runs of each mode, alternating
    python3 -m pip install -q --no-index --no-deps --target /root/lmd .gpu-stage/extra/*.whl 2>&1 | grep -v WARNING
    export PYTHONPATH=/root/lmd:$PWD/include TOKENIZERS_PARALLELISM=false
    if [ "$1" = lmdeploy ]; then data=(--dataset fixed --n 1000); else data=(--dataset mix --n 2000); fi
    timeout ${T:-540} python3 -m bench inference --engine lmdeploy --model /root/q7 --vocab 32000 "${data[@]}" \
      --modes raw,stage --repeats ${REPEATS:-3} --out $OUT/gpu_lmdeploy.jsonl ;;
esac
