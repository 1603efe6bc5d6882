"""python -m bench COMMAND [ARGS ...]: each command is a module of this package (its ``main(argv)``);
``python -m bench COMMAND --help`` shows its options."""
from __future__ import annotations

import importlib
import os
import sys

from bench.runners import ROOT

COMMANDS = {  # command: (module, what it measures)
    "inference": ("inference", "the raw engine (vLLM, SGLang, LMDeploy) against the inference stage, one clock, "
                  "alternating (CPU or GPU)"),
    "review-placement": ("review_placement", "filter.review as its own task against in the generating worker"),
    "swift": ("swift", "ms-swift's `swift infer` against `batch-llm run` and the DAG, on this CPU"),
    "guided": ("guided", "guided decoding's cost in the whole pipeline (`batch-llm run` processes)"),
    "guided-engine": ("guided_engine", "guided decoding's cost inside one vLLM engine"),
    "gc-import": ("gc_import", "the engine start with the collector paused over vLLM's import, and without"),
    "compile-cache": ("compile_cache", "engine.compile_cache: the engine start cold against warm"),
    "scale": ("scale", "plan, filter, evaluate, publish at 100k-10M rows (seconds, peak RSS)"),
    "mapped-steps": ("mapped_steps", "filter per shard, publish from parts vs one task each, 10M-100M tiny rows"),
    "dag-day": ("dag_day", "a day of tiny rows through the DAG under a real scheduler, the echo engine (plan in parts)"),
    "scale-cache": ("scale_cache", "the result cache's lookup as its history grows"),
    "cache-large": ("cache_large", "the result cache at 300M entries: a shard's lookup, compaction (seconds, peak RSS)"),
    "cache-formats": ("cache_formats", "the result cache's own table format against sorted Parquet (pyarrow, DuckDB)"),
    "gpu-features": ("gpu_features", "guided | spec | fp8: engine features, one vLLM process per configuration (GPU)"),
    "gpu-check": ("gpu_check", "the production path on one GPU with the real demo weights, feature by feature"),
    "gpu-checks": ("gpu_checks", "stop | resume | leases: the GPU operator's worker on a real GPU"),
    "telemetry": ("gpu_telemetry", "record | by-run: the GPU's clocks, power and temperature per run phase"),
    "profile-summary": ("profile_summary", "a py-spy profile summarized per process and thread"),
    "recommend-check": ("recommend_check", "predict | run: the recommend model against a fresh H200 run"),
    "recommend-calibration": ("recommend_calibration", "fits recommend.py's constants to the measurements"),
    "shards-per-task": ("shards_per_task", "sharding.shards_per_task: one engine start per shard against per task"),
    "grammar-cost": ("grammar_cost", "xgrammar's and llguidance's mask fill and token accept, per token, per tokenizer"),
    "image-load": ("image_load", "the shard's image loading: one at a time against input.image_workers threads"),
    "image-preprocess": ("image_preprocess", "an image row's CPU side: PNG decode and the image processor, threads"),
    "processor-kept": ("processor_kept", "image rows in vLLM with the Hugging Face processor kept / vLLM as it is"),
    "openai-batch-api": ("openai_batch_api", "the OpenAI Batch API (upload to completed, real Airflow services) "
                         "against `batch-llm run-batch` on the same file, CPU vLLM"),
    "csv-read": ("csv_read", "CSV input: the planner's reader (csv module) against pyarrow's open_csv, 1M rows"),
    "qwen-tokenizer": ("qwen_tokenizer", "builds a Qwen2.5 tokenizer offline (a 7B model's real vocabulary)"),
}
SCRIPTS = {  # command: (shell script, what it runs)
    "cpu": ("run_cpu.sh", "the CPU benchmark (`make bench`): inference on the demo model, fixed and mix"),
    "gpu": ("run_gpu.sh", "MODE: a GPU benchmark on a GPU host without network (fixed, mix, checks, guided, ...)"),
}


def usage() -> str:
    width = max(map(len, [*COMMANDS, *SCRIPTS]))
    lines = [__doc__.strip(), "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += [f"  {name:<{width}}  {what} (bash bench/{script})" for name, (script, what) in SCRIPTS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, args = argv[0], argv[1:]
    if name in SCRIPTS:
        script = ROOT / "bench" / SCRIPTS[name][0]
        if args[:1] in (["-h"], ["--help"]):  # the script's opening comment
            head = script.read_text().splitlines()[1:]
            print("\n".join(x[2:] for x in head[:next(i for i, x in enumerate(head) if not x.startswith("#"))]))
            return 0
        os.execvp("bash", ["bash", str(script), *args])
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"python -m bench {name}", *args]  # the module's --help names the command
    return importlib.import_module(f"bench.{COMMANDS[name][0]}").main(args) or 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
