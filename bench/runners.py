"""What the benchmarks share: running and timing a child process, the alternating schedule, the statistics of
repeated runs, the result lines (``RESULT {json}`` on stdout, JSON lines appended to a file), the benchmark
pipeline config, and the environment of a vLLM run on this CPU.

Imports nothing beyond the standard library at module level (no Airflow, no engine): the GPU machine that runs
these has vLLM and the stage library, nothing else of the project's environment.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

T0 = time.time()  # this process's start, near enough (``python -m bench`` imports this first)
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DUMMY = {"load_format": "dummy", "skip_tokenizer_init": True}  # vLLM: random weights, token-id prompts only
# SGLang: random weights; its engine in the stage needs the tokenizer (it refuses skip_tokenizer_init: it returns text)
SGLANG_DUMMY = {"load_format": "dummy"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


# ------------------------------------------------------------------------------------------ processes
def bench_command(name: str, *args) -> list[str]:
    """This package's subcommand ``name`` as a fresh Python process: ``python -m bench NAME ARGS``."""
    return [sys.executable, "-m", "bench", name, *(str(x) for x in args)]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child of ``bench_command``: unbuffered output, and this checkout on
    the path (after what is there) so that ``-m bench`` resolves from any working folder."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment of a vLLM run on this CPU: offline (hub, transformers, usage stats), no GPU for
    batch-llm, the checkout's model cache (where ``python -m batch_llm.demo_model`` puts the demo model)."""
    cache = str(ROOT / ".cache" / "modelscope")
    return {**os.environ, **OFFLINE_ENV, "TOKENIZERS_PARALLELISM": "false", "BATCH_LLM_GPUS": "",
            "BATCH_LLM_MODEL_CACHE": cache, "MODELSCOPE_CACHE": cache, **extra}


@dataclass
class Proc:
    """A finished child: exit status (124: killed at its timeout), output, and its clock."""

    rc: int
    out: str
    err: str  # empty when stderr went into ``out``
    started: float  # epoch seconds just before the start: the child's BENCH_T0
    wall_s: float  # start -> exit

    def result(self, tag: str = "RESULT ") -> dict | None:
        """The first ``RESULT {json}`` line the child printed, parsed; None when it printed none."""
        line = next((x for x in self.out.splitlines() if x.startswith(tag)), None)
        return None if line is None else json.loads(line[len(tag):])


def run(cmd: list, *, env: dict | None = None, timeout: float | None = None, cwd: Path | None = None,
        log: Path | None = None, merge_stderr: bool = True, settle: float = 0.0) -> Proc:
    """Runs ``cmd`` in a process group of its own and times it, start to exit; then ends the group whole, so
    nothing it started (vLLM's engine core) outlives the run and holds memory into the next. So does this
    process's end by SIGTERM (``timeout`` around the driver) or Ctrl-C: the group does not outlive its driver.

    The child's environment has BENCH_T0, the start on the wall clock: the one clock on which a child measures
    its own phases (``engine_ready_s``, ``outputs_s``), comparable with ``wall_s``. ``timeout``: the group is
    killed, rc 124. ``log``: the output goes to that file as it comes (and is read back). ``settle``: seconds to
    wait after the group ended (the GPU memory of a killed group is freed)."""
    t0 = time.time()
    env = {**(os.environ if env is None else env), "BENCH_T0": repr(t0)}
    with open(log, "w") if log else contextlib.nullcontext() as fh, _sigterm_raises():
        proc = subprocess.Popen([str(c) for c in cmd], stdout=fh or subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True, env=env,
                                cwd=cwd, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
            rc = 124
        except BaseException:
            _kill_group(proc.pid)
            raise
        wall = time.time() - t0
    _kill_group(proc.pid)
    if settle:
        time.sleep(settle)
    if log:
        out = Path(log).read_text(errors="replace")
    return Proc(rc, out or "", err or "", t0, wall)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises SystemExit meanwhile (in the main thread), so that ``run`` ends its child's group."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def wait_quiet(idle: float = 0.85, sample_s: float = 3.0, limit_s: float = 600.0) -> float:
    """Waits until this machine is quiet (at least ``idle`` of its CPU time idle over ``sample_s``), at most
    ``limit_s``; returns the seconds waited (``limit_s`` or more: it never got quiet). A shared machine's other
    work, started before a run, would otherwise land on one mode's clock."""
    def busy_total() -> tuple[int, int]:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)

    t0 = time.time()
    while True:
        b0, a0 = busy_total()
        time.sleep(sample_s)
        b1, a1 = busy_total()
        if (b1 - b0) <= (1 - idle) * max(a1 - a0, 1) or time.time() - t0 >= limit_s:
            return round(time.time() - t0, 1)


# ------------------------------------------------------------------------------------ schedule, figures
def alternating(modes, repeats: int, start: int = 0) -> list[tuple[int, str]]:
    """(repeat, mode) in alternating order, a, b | b, a | a, b ...: each mode's runs spread evenly over the
    benchmark, so a machine that drifts favours none. ``start``: the repeat an earlier invocation stopped before (its
    parity sets the order)."""
    return [(i, m) for i in range(start, start + repeats) for m in (modes if i % 2 == 0 else modes[::-1])]


def spread(values: list[float], digits: int = 3) -> dict:
    """A figure over repeated runs, as the summaries record it: median, min, max, n."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "n": len(values)}


def spread_text(values: list[float], digits: int = 1, unit: str = "") -> str:
    """The same for a printed summary: ``12.3 s (11.9–13.0)``, the median and (min–max)."""
    return f"{statistics.median(values):.{digits}f}{unit} ({min(values):.{digits}f}–{max(values):.{digits}f})"


# ------------------------------------------------------------------------------------------- results
def print_result(rec: dict, tag: str = "RESULT ", ensure_ascii: bool = True) -> None:
    """A child's result line, which its parent (``Proc.result``) picks out of its output."""
    print(tag + json.dumps(rec, ensure_ascii=ensure_ascii), flush=True)


def append_jsonl(path: str | Path | None, *records: dict, ensure_ascii: bool = True) -> None:
    """Appends each record as a JSON line (nothing when ``path`` is empty). Called as each run ends, so a call
    cut short by its time limit keeps the runs it finished."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=ensure_ascii) + "\n" for r in records)


def emit(out: str | Path | None, bench: str, rec: dict, *, ensure_ascii: bool = True) -> None:
    """A measurement made in this process: stamped with the benchmark's name and the UTC time, printed as a
    ``RESULT`` line and appended to ``out``."""
    rec = {"bench": bench, "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **rec}
    print_result(rec, ensure_ascii=ensure_ascii)
    append_jsonl(out, rec, ensure_ascii=ensure_ascii)


# ---------------------------------------------------------------------------------------- the engine
def model_vocab(model: str | Path, cap: int = 150_000) -> int:
    """The model's vocabulary size (its config.json; 32000 when it names none), at most ``cap``: prompt
    token ids are drawn below it."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    return min(cfg.get("vocab_size", 32000), cap)


def bench_config(model: str, *, engine: dict, max_tokens: int, dummy: bool = False, name: str = "bench",
                 input: str = "unused.jsonl", output: str = "unused", label: str = "bench", **sections):
    """The pipeline config the engine benchmarks run under: greedy, seed 0, ``ignore_eos``, ``max_tokens``; the
    result cache, evaluation and the content filter off (``sections`` add or replace top-level sections);
    ``engine`` (kind vllm unless it says) with random weights under ``dummy`` (vLLM: token-id prompts, no tokenizer;
    SGLang: its tokenizer stays, the model folder needs one)."""
    from batch_llm.config import parse_config

    engine = {"kind": "vllm", **engine}
    random_weights = SGLANG_DUMMY if engine["kind"] == "sglang" else DUMMY
    engine["extra"] = {**(random_weights if dummy else {}), **engine.get("extra", {})}
    return parse_config({
        "name": name, "model": {"ref": model}, "input": {"path": input}, "output": {"path": output},
        "engine": engine, "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "seed": 0, "ignore_eos": True},
        "cache": {"enabled": False}, "evaluate": {"enabled": False}, "filter": {"enabled": False}, **sections}, label)


def serves(engine) -> bool:
    """8 short greedy requests (32 prompt tokens -> 16): whether a started engine serves."""
    from batch_llm.engines.base import GenRequest

    out = list(engine.generate([GenRequest(key=str(i), prompt_token_ids=[100 + i] * 32) for i in range(8)]))
    return len(out) == 8 and all(r.error is None and r.completion_tokens == 16 for r in out)


def start_vllm(model: str, **kwargs) -> tuple[Any, dict]:
    """vLLM's ``LLM`` on random weights (bf16, max_model_len 2048, 90 % of the GPU, seed 0; ``kwargs`` add or
    replace), imported and built in this process. Returns it with what it got: vLLM's version, the GPU, the
    seconds (process start -> imported -> built), the KV cache, the scheduler's settings."""
    import torch
    import vllm
    from vllm import LLM

    imported = time.time()
    kw = {"load_format": "dummy", "max_model_len": 2048, "gpu_memory_utilization": 0.9, "dtype": "bfloat16",
          "seed": 0, **kwargs}
    llm = LLM(model=model, **kw)
    built = time.time()
    vc = llm.llm_engine.vllm_config
    blocks = vc.cache_config.num_gpu_blocks
    info = dict(vllm=vllm.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                engine_kwargs=kw,
                import_s=round(imported - T0, 1), construct_s=round(built - imported, 1),
                process_to_ready_s=round(built - T0, 1),
                num_gpu_blocks=blocks, block_size=vc.cache_config.block_size,
                kv_cache_tokens=blocks * vc.cache_config.block_size if blocks else None,
                kv_cache_dtype=str(vc.cache_config.cache_dtype), quantization=vc.model_config.quantization,
                max_num_seqs=vc.scheduler_config.max_num_seqs,
                max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
                async_scheduling=getattr(vc.scheduler_config, "async_scheduling", None),
                structured_outputs_backend=str(getattr(vc.structured_outputs_config, "backend", "")))
    return llm, info
