"""Throughput of the inference stage against the raw engine, measured in one run on the same prompts.

    python bench/bench_inference.py --model DIR [--dummy] --dataset fixed|mix --n 1000 --in-len 256 --out-len 256
    python bench/bench_inference.py --engine lmdeploy --model DIR --vocab 32000 --modes raw,stage   # GPU only

Modes, each in a fresh process (so GPU memory is free between them):
  raw    vllm.LLM.generate over the whole list, as a user would call it (input order, one call); with
         --engine lmdeploy: LMDeploy's pipeline(prompts, gen_config) over the whole list (the prompts as text,
         decoded from the same token ids: its public batch API takes text)
  stage  the project's inference stage exactly as the operator runs it: shard file in storage, the spawned
         worker (batch_llm.worker), streaming into the engine, chunk commits, resume bookkeeping, outputs
  hf     transformers static batching (what ms-swift's `pt` backend does), on the first --hf-n prompts

Datasets (token-id prompts, so they also work with random weights, ``--dummy``):
  fixed  N × in-len random tokens → out-len tokens, ignore_eos
  tiny   N × 8-token prompts → 1 token: the worker's peak RSS as N grows (10k vs 100k rows)
  mix    long-tailed prompt lengths (lognormal), a shared 192-token system prefix on 80 % of rows, 10 % of rows
         repeating an earlier prompt, long-tailed output limits (per-row max_tokens), ignore_eos

Prints one RESULT line per mode and the ratios stage/raw and stage/hf (output tokens per second of
generation, engine start excluded for all; engine start is reported separately).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_dataset(kind: str, n: int, in_len: int, out_len: int, vocab: int, max_model_len: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    if kind == "tiny":  # memory check: many rows, 8-token prompts, 1 output token
        return [{"id": f"r{i}", "prompt_token_ids": rng.integers(100, vocab, 8).tolist(), "max_tokens": 1}
                for i in range(n)]
    if kind == "fixed":
        for i in range(n):
            rows.append({"id": f"r{i}", "prompt_token_ids": rng.integers(100, vocab, in_len).tolist(),
                         "max_tokens": out_len})
        return rows
    prefix = rng.integers(100, vocab, 192).tolist()
    for i in range(n):
        if i > 10 and rng.random() < 0.10:  # a repeated prompt
            src = rows[int(rng.integers(0, len(rows)))]
            rows.append({**src, "id": f"r{i}"})
            continue
        plen = int(min(max(16, rng.lognormal(np.log(in_len * 0.6), 0.8)), max_model_len - out_len - 200))
        body = rng.integers(100, vocab, plen).tolist()
        ids = (prefix + body) if rng.random() < 0.8 else body
        olen = int(min(max(8, rng.lognormal(np.log(out_len * 0.4), 0.9)), out_len))
        rows.append({"id": f"r{i}", "prompt_token_ids": ids, "max_tokens": olen})
    return rows


# ------------------------------------------------------------------------------------------ the modes
def run_raw(a, rows) -> dict:
    if a.engine == "lmdeploy":
        return run_raw_lmdeploy(a, rows)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(a))
    start = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=not a.dummy)
              for r in rows]
    llm.generate(prompts[:16], params[:16], use_tqdm=False)  # warm-up, as the reference benchmark does
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    el = time.perf_counter() - t1
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(mode="raw", seconds=el, output_tokens=n_out, engine_start_s=start)


def run_raw_lmdeploy(a, rows) -> dict:
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    texts = [tok.decode(r["prompt_token_ids"]) for r in rows]
    t0 = time.perf_counter()
    pipe = pipeline(a.model, backend_config=PytorchEngineConfig(session_len=a.max_model_len, max_batch_size=256,
                    cache_max_entry_count=a.gpu_util, dtype=a.dtype, eager_mode=a.enforce_eager), log_level="WARNING")
    start = time.perf_counter() - t0
    gens = [GenerationConfig(max_new_tokens=r["max_tokens"], do_sample=False, ignore_eos=True) for r in rows]
    pipe(texts[:16], gen_config=gens[:16], do_preprocess=False)  # warm-up
    t1 = time.perf_counter()
    outs = pipe(texts, gen_config=gens, do_preprocess=False)
    el = time.perf_counter() - t1
    pipe.close()
    return dict(mode="raw", engine="lmdeploy", seconds=el, output_tokens=sum(o.generate_token_len for o in outs),
                input_tokens=sum(o.input_token_len for o in outs), engine_start_s=start)


def run_stage(a, rows) -> dict:
    from batch_llm.config import parse_config
    from batch_llm.stages import RunLayout
    from batch_llm.storage import Location, write_jsonl
    from batch_llm.worker import WorkerHandle

    work = Path(tempfile.mkdtemp(prefix="bench_stage_"))
    shard_url = str(work / "shard-00000.jsonl")
    write_jsonl(Location(shard_url).path(), ({**r, "idx": i, "messages": []} for i, r in enumerate(rows)))
    extra = {"load_format": "dummy", "skip_tokenizer_init": True} if a.dummy else {}
    if a.engine == "lmdeploy":
        extra = {}
    cfg = parse_config({
        "name": "bench", "model": {"ref": a.model}, "input": {"path": shard_url}, "output": {"path": str(work)},
        "engine": {"kind": a.engine, "max_model_len": a.max_model_len, "gpu_memory_utilization": a.gpu_util,
                   "enforce_eager": a.enforce_eager, "dtype": a.dtype, "extra": extra,
                   "commit_every_rows": a.commit_rows, "progress_every_seconds": 30},
        "sampling": {"max_tokens": a.out_len, "temperature": 0.0, "seed": 0, "ignore_eos": True},
        "cache": {"enabled": False}, "evaluate": {"enabled": False}, "filter": {"enabled": False}}, "bench")
    layout = RunLayout.for_run(cfg, run_id="bench", ds="2026-01-01")
    spec = {"config": cfg.model_dump(mode="json"), "layout": layout.to_dict(),
            "model": {"local_dir": a.model, "model_key": "bench"},
            "shard": {"index": 0, "rows": len(rows), "url": shard_url}}
    t0 = time.perf_counter()
    m = WorkerHandle.start(spec).wait(on_line=lambda line: print("  [stage]", line[:200], flush=True)
                                      if "progress" in line or "done" in line or "Error" in line else None)
    wall = time.perf_counter() - t0
    mt = m["metrics"]
    return dict(mode="stage", engine=a.engine, seconds=mt["generate_seconds"], output_tokens=mt["output_tokens"],
                engine_start_s=mt["engine_start_seconds"], wall_s=wall, unique_prompts=mt["unique_prompts"],
                worker_peak_rss_mb=mt.get("peak_rss_mb"))


def run_hf(a, rows) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = rows[: a.hf_n]
    if a.dummy:
        cfg = AutoConfig.from_pretrained(a.model)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(dev)
    model.eval()
    model.generation_config.eos_token_id = None
    t1 = time.perf_counter()
    n_out = 0
    with torch.inference_mode():
        for i in range(0, len(rows), a.hf_batch):
            batch = rows[i:i + a.hf_batch]
            width = max(len(r["prompt_token_ids"]) for r in batch)
            ids = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + r["prompt_token_ids"] for r in batch],
                               device=dev)
            mask = (torch.arange(width, device=dev)[None, :] >=
                    torch.tensor([width - len(r["prompt_token_ids"]) for r in batch], device=dev)[:, None]).long()
            new = max(r["max_tokens"] for r in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
            n_out += sum(r["max_tokens"] for r in batch)  # static batching: each row's own limit is useful work
    if dev == "cuda":
        torch.cuda.synchronize()
    return dict(mode="hf", seconds=time.perf_counter() - t1, output_tokens=n_out, rows=len(rows))


def engine_kwargs(a) -> dict:
    kw = dict(model=a.model, max_model_len=a.max_model_len, gpu_memory_utilization=a.gpu_util, dtype=a.dtype,
              enforce_eager=a.enforce_eager, seed=0)
    if a.dummy:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    return kw


def child(a) -> None:
    cfg = json.load(open(Path(a.model) / "config.json"))
    vocab = a.vocab or min(cfg.get("vocab_size", 32000), 150000)
    rows = make_dataset(a.dataset, a.n, a.in_len, a.out_len, vocab - 1, a.max_model_len)
    res = {"raw": run_raw, "stage": run_stage, "hf": run_hf}[a.child](a, rows)
    res["tok_s"] = round(res["output_tokens"] / res["seconds"], 1)
    import resource

    res["process_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--engine", choices=["vllm", "lmdeploy"], default="vllm")
    p.add_argument("--vocab", type=int, default=0, help="draw prompt token ids below this (default: the model's)")
    p.add_argument("--dummy", action="store_true", help="random weights (load_format=dummy), token-id prompts")
    p.add_argument("--dataset", choices=["fixed", "mix", "tiny"], default="fixed")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--in-len", type=int, default=256)
    p.add_argument("--out-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-util", type=float, default=0.90)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--commit-rows", type=int, default=256)
    p.add_argument("--hf-n", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--modes", default="raw,stage,hf")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help="append results as JSON lines to this file")
    a = p.parse_args()
    if a.child:
        return child(a)
    results = {}
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if not line:
            print(f"{mode} FAILED rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", flush=True)
            continue
        results[mode] = json.loads(line[7:])
        print(f"{mode}: {results[mode]}", flush=True)
    summary = {"engine": a.engine, "dataset": a.dataset, "n": a.n, "in_len": a.in_len, "out_len": a.out_len, "dummy": a.dummy,
               "model": a.model, **{f"{m}_tok_s": r["tok_s"] for m, r in results.items()}}
    if "stage" in results and "raw" in results:
        summary["stage_over_raw"] = round(results["stage"]["tok_s"] / results["raw"]["tok_s"], 3)
    if "stage" in results and "hf" in results:
        summary["stage_over_hf"] = round(results["stage"]["tok_s"] / results["hf"]["tok_s"], 2)
    print("SUMMARY " + json.dumps(summary), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as f:
            f.write(json.dumps({"summary": summary, "results": results}) + "\n")


if __name__ == "__main__":
    main()
