"""The production path on one GPU with the real demo weights (SmolLM2-135M-Instruct, built offline as the demo
builds them): each item is a ``batch-llm run`` process, as a user runs it (fetch → quantize → plan → infer →
filter → publish; evaluate off: EvalScope is not part of what is checked here), checked on what it published.

    python -m bench gpu-check --out DIR [--items bf16,fp32,...] [--rows 512]     # on a machine with a GPU
    python -m bench gpu-check --reference FILE                                   # on a CPU: the greedy reference

Items (each passes or fails with the reason; a missing part is a failure that says what is missing):
  bf16      the demo pipeline, bf16, the GPU defaults (offline CUDA graphs); greedy outputs against the CPU reference
  fp32      the same in float32 (what the CPU runs here): greedy outputs against the CPU reference
  fp8       quantize FP8_DYNAMIC (llm-compressor, on the GPU), served by vLLM; published rows all valid
  awq       quantize W4A16 with AWQ calibration (llm-compressor, on the GPU), served by vLLM's 4-bit kernels
  lora      an adapter (made here with peft, seeded random lora_B) served (merge: false) and merged (merge: true),
            float16 (vLLM's GPU LoRA kernels take no float32): greedy outputs equal between the two or parting at a
            near tie (the merged model's top-2 log-probabilities there), and different from the base model's
  guided    dags/pipelines/review_extraction.yaml (JSON-schema guided decoding): share of valid outputs
  fallback  the same with sampling.guided_decoding: fallback (free first, the misses again under the schema, the
            per-request grammar on the GPU engine): share of valid outputs, and the misses asked again (the 135M
            model misses the schema free)
  samples   n = 3 at temperature 0.8 with logprobs 2: three samples per row, log-probabilities per token
  embed     engine.task embed: one L2-normalized vector per row of the model's hidden size
  spec      n-gram speculative decoding through the stage: greedy outputs equal to bf16's (this call's bf16 run)
  lmdeploy  the LMDeploy engine (PyTorch backend) on the same rows (``--lmdeploy-python``: its interpreter)
  sglang    engine.kind: sglang (SGLang's offline engine, bf16, CUDA graphs) on the same rows: greedy outputs against
            the CPU reference and against this call's vLLM bf16 run (``--sglang-path``: the folder SGLang is
            installed in, put first on the runs' PYTHONPATH; BATCH_LLM_SGLANG_PATH)
  sglang_guided  the review-extraction pipeline (JSON Schema) on SGLang (its xgrammar backend): share of valid outputs

Every item but bf16 runs eager (no CUDA graphs; the demo file's setting), to keep engine starts short; what it
ran with is in its result. Rows: ``--rows`` prompts, the demo's 20 valid prompts numbered (``(#i)``) so that no two
are equal; the first 64 are the reference rows. Results: one JSON line per item in ``DIR/gpu_check.jsonl``, a
table on stdout, each run's log and published rows under ``DIR``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from bench.runners import ROOT, append_jsonl, run

DEMO_YAML = ROOT / "dags" / "pipelines" / "demo.yaml"
REVIEW_YAML = ROOT / "dags" / "pipelines" / "review_extraction.yaml"
DEMO_PROMPTS = ROOT / "include" / "sample_data" / "demo_prompts.jsonl"
REVIEWS = ROOT / "include" / "sample_data" / "reviews_zh.jsonl"
REFERENCE = ROOT / "docs" / "bench-results" / "gpu-check-cpu-reference.jsonl"
REFERENCE_ROWS = 64
MAX_TOKENS = 64
DS = "2026-12-03"
ITEMS = ("bf16", "fp32", "fp8", "awq", "lora", "guided", "fallback", "samples", "embed", "spec", "lmdeploy", "sglang",
         "sglang_guided")
COMMON = ["sharding.num_shards=1", "evaluate.enabled=false", "cache.enabled=false", "engine.max_error_rate=0.5",
          f"sampling.max_tokens={MAX_TOKENS}", "engine.commit_every_rows=256"]


def make_rows(n: int) -> list[dict]:
    """``n`` chat rows: the demo's valid prompts, numbered so that no two are equal (no folding of duplicates)."""
    base = []
    for line in DEMO_PROMPTS.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # the demo's deliberately malformed lines
        if not isinstance(r, dict):
            continue
        text = r.get("prompt") or (r.get("messages") or [{}])[-1].get("content")
        if isinstance(text, str) and text.strip() and len(text) < 2000:
            base.append(text.strip())
    return [{"id": f"g{i:05d}", "prompt": f"{base[i % len(base)]} (#{i})"} for i in range(n)]


def review_rows(n: int) -> list[dict]:
    base = [json.loads(x) for x in REVIEWS.read_text(encoding="utf-8").splitlines()]
    return [{**base[i % len(base)], "id": f"r{i:05d}", "prompt": f"{base[i % len(base)]['prompt']}（{i}）"}
            for i in range(n)]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


class Check:
    """One check: where runs go, the model, and how a run of the CLI is made and read back."""

    def __init__(self, out: Path, model: str, rows: int, timeout: float, env: dict[str, str]):
        self.out, self.model, self.timeout, self.env = out, model, timeout, env
        self.input = write_rows(out / "rows.jsonl", make_rows(rows))
        self.rows = rows
        self.greedy_bf16: dict[str, str] = {}  # the bf16 item's outputs, which later items compare with

    def run(self, name: str, sets: list[str], *, yaml: Path = DEMO_YAML, src: Path | None = None,
            env: dict | None = None) -> dict:
        """One ``batch-llm run``; returns its published rows by id, the summary, the shard manifest, the wall."""
        dest = self.out / name
        shutil.rmtree(dest, ignore_errors=True)
        args = [sys.executable, "-m", "batch_llm", "run", str(yaml), "--input", str(src or self.input),
                "--output", str(dest), "--ds", DS, "--run-id", name, "--plain", "--set", f"model.ref={self.model}"]
        for s in [*COMMON, *sets]:
            args += ["--set", s]
        proc = run(args, env={**self.env, **(env or {})}, timeout=self.timeout, log=self.out / f"{name}.log")
        if proc.rc != 0:
            tail = " | ".join(x for x in proc.out.splitlines()[-6:] if x.strip())
            raise CheckFailed(f"run exited {proc.rc}: {tail[-900:]}")
        current = json.loads(next(dest.glob("*/dt=*/_CURRENT.json")).read_text())
        summary = json.loads((Path(_path(current["version"])) / "summary.json").read_text())
        (manifest,) = summary["manifests"]["infer"]
        return {"rows": {r["id"]: r for r in _read_rows(_path(current["dataset"]))}, "summary": summary,
                "manifest": manifest, "wall_s": round(proc.wall_s, 1)}


class CheckFailed(Exception):
    pass


def _path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def _read_rows(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def figures(r: dict) -> dict:
    """The shard's own clock: engine start, generation, generated tokens per second of generation."""
    m = r["manifest"]["metrics"]
    gen = m.get("generate_seconds") or 0.0
    return {"wall_s": r["wall_s"], "engine_start_s": m.get("engine_start_seconds"), "generate_s": gen,
            "rows_published": r["summary"].get("rows_published"), "output_tokens": m.get("output_tokens"),
            "gen_tok_s": round(m["output_tokens"] / gen, 1) if gen else None,
            "engine": _engine(r)}


def _engine(r: dict) -> dict:
    """The engine the shard ran, as its manifest records it (kind, version, the settings that matter here)."""
    e = r["manifest"].get("engine") or {}
    st = e.get("settings") or {}
    return {"kind": e.get("kind"), "version": e.get("version"),
            **{k: st.get(k) for k in ("dtype", "enforce_eager", "quantization", "speculative_config") if k in st}}


def compare(rows: dict, reference: dict[str, str]) -> dict:
    """Greedy outputs against the reference: how many equal, and for the others where they part (in characters)."""
    same, differ = 0, []
    for rid, want in reference.items():
        got = rows.get(rid, {}).get("output")
        if got == want:
            same += 1
        else:
            at = next((i for i, (a, b) in enumerate(zip(got or "", want)) if a != b), min(len(got or ""), len(want)))
            differ.append({"id": rid, "parts_at_char": at, "got": (got or "")[:80], "want": want[:80]})
    return {"equal": same, "of": len(reference), "first_differences": differ[:5]}


def item_bf16(c: Check, ref: dict) -> dict:
    r = c.run("bf16", ["engine.dtype=bfloat16", "engine.enforce_eager=false"])  # the GPU path: CUDA graphs
    cmp = compare(r["rows"], ref)
    c.greedy_bf16 = {k: v["output"] for k, v in r["rows"].items()}
    ok = r["summary"]["rows_published"] == c.rows
    return {"ok": ok, **figures(r), "vs_cpu_float32": cmp}


def item_fp32(c: Check, ref: dict) -> dict:
    r = c.run("fp32", ["engine.dtype=float32"])
    cmp = compare(r["rows"], ref)
    return {"ok": r["summary"]["rows_published"] == c.rows, **figures(r), "vs_cpu_float32": cmp}


def _quantized(c: Check, name: str, sets: list[str]) -> dict:
    # the whole section: the demo's own quantize keys are W4A16 settings, which FP8_DYNAMIC refuses
    r = c.run(name, [f"quantize={{enabled: true, {', '.join(sets)}}}", "engine.enforce_eager=true"])
    q = (r["summary"]["manifests"].get("quantize") or {}).get("quantization") or {}
    empty = sum(1 for v in r["rows"].values() if not (v.get("output") or "").strip())
    ok = r["summary"]["rows_published"] == c.rows and empty < c.rows // 10
    return {"ok": ok, **figures(r), "empty_outputs": empty, "export": q,
        "sample": next(iter(r["rows"].values()))["output"][:120]}


def item_fp8(c: Check, ref: dict) -> dict:
    return _quantized(c, "fp8", ["scheme: FP8_DYNAMIC"])


def item_awq(c: Check, ref: dict) -> dict:
    return _quantized(c, "awq", ["scheme: W4A16", "method: awq", "group_size: 64", "calibration_samples: 32",
                                 "calibration_seq_len: 256"])


def make_adapter(model: str, dest: Path) -> Path:
    """A rank-8 LoRA adapter on the attention projections, lora_B seeded random (peft starts it at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_obj = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    peft_model = get_peft_model(model_obj, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    gen = torch.Generator().manual_seed(0)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.02
    peft_model.save_pretrained(dest)
    return dest


LORA_DTYPE = "float16"  # the most precise dtype vLLM's GPU LoRA kernels take (float16, bfloat16: lora_shrink_op)
NEAR_TIE = 0.25  # nats between the merged model's first and second choice: a tie at float16's rounding


def parting(a: list[dict], b: list[dict]) -> int | None:
    """The first token position where two greedy runs of one prompt part (by token), None where they do not."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x["token"] != y["token"]:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _gap(t: dict) -> float | None:
    top = t.get("top") or []
    return round(top[0]["logprob"] - top[1]["logprob"], 4) if len(top) >= 2 else None


def explain_parts(served: dict, merged: dict) -> dict:
    """Where served and merged greedy outputs part, was it a near tie? At the first token where they differ both
    runs have read the same context, so the merged model's top-2 log-probabilities there say how close its first
    and second choices were; a served adapter that was wrong (dropped, mis-scaled) parts from merged on tokens the
    merged model was sure of. Counts the rows that part at a near tie (gap <= NEAR_TIE nats, the served token among
    the merged model's top two) and gives the gaps there against the median gap over all merged tokens."""
    gaps_all = sorted(t["top"][0]["logprob"] - t["top"][1]["logprob"]
                      for r in merged.values() for t in r.get("logprobs") or [] if len(t.get("top") or []) >= 2)
    parts = []
    for rid, m in merged.items():
        s = served.get(rid)
        if s is None or s["output"] == m["output"]:
            continue
        i = parting(s.get("logprobs") or [], m.get("logprobs") or [])
        if i is None or i >= len(m["logprobs"]) or i >= len(s["logprobs"]):
            parts.append({"id": rid, "at_token": i, "gap": None, "in_top2": False})  # parts in text only
            continue
        top = m["logprobs"][i]["top"]
        gap = top[0]["logprob"] - top[1]["logprob"] if len(top) >= 2 else None
        # in the merged model's top two (at an exact tie the rank of two equal log-probabilities is arbitrary,
        # so the served token may be listed first and the merged one second)
        parts.append({"id": rid, "at_token": i, "gap": None if gap is None else round(gap, 4),
                      "in_top2": s["logprobs"][i]["token"] in [t["token"] for t in top[:2]],
                      "served_gap": _gap(s["logprobs"][i])})
    tie = [p for p in parts if p["gap"] is not None and p["gap"] <= NEAR_TIE and p["in_top2"]]
    gaps = sorted(p["gap"] for p in parts if p["gap"] is not None)
    return {"rows_parting": len(parts), "parting_at_near_tie": len(tie),
            "gap_at_parting_max": gaps[-1] if gaps else None,
            "gap_at_parting_median": gaps[len(gaps) // 2] if gaps else None,
            "gap_median_all_tokens": round(gaps_all[len(gaps_all) // 2], 4) if gaps_all else None,
            "not_at_near_tie": [p for p in parts if p not in tie][:5]}


def item_lora(c: Check, ref: dict) -> dict:
    """Served (merge: false) against merged (merge: true) and the base, each in float16 with top-2 logprobs.
    float32, which the CPU test compares in, is not served on a GPU: vLLM's GPU LoRA kernels take float16 and
    bfloat16 only (the engine refuses float32 with a served adapter on a GPU, before starting). In 16 bits a
    merged folder rounds W + BA once where a served adapter adds BA to W at run time, so a near tie in greedy
    decoding may go either way: the check passes where every row either equals or parts at a near tie."""
    adapter = make_adapter(c.model, c.out / "adapter")
    sets = ["engine.enforce_eager=true", f"engine.dtype={LORA_DTYPE}", "sampling.logprobs=2"]
    base = c.run("lora-base", sets)
    served = c.run("lora-served", [*sets, f"model.lora={{ref: {adapter}, merge: false}}"])
    merged = c.run("lora-merged", [*sets, f"model.lora={{ref: {adapter}, merge: true}}"])
    a, b, o = served["rows"], merged["rows"], base["rows"]
    equal = sum(1 for k in a if a[k]["output"] == b.get(k, {}).get("output"))
    changed = sum(1 for k in a if a[k]["output"] != o.get(k, {}).get("output"))
    why = explain_parts(a, b)
    ok = (len(a) == len(b) == c.rows and changed > c.rows // 2
          and equal + why["parting_at_near_tie"] == c.rows)
    return {"ok": ok, "dtype": LORA_DTYPE, "served": figures(served), "merged": figures(merged),
            "base": figures(base), "served_equal_merged": equal, "of": len(a), "served_differs_from_base": changed,
            "merged_differs_from_base": sum(1 for k in b if b[k]["output"] != o.get(k, {}).get("output")),
            "near_tie_nats": NEAR_TIE, **why}


def _review_run(c: Check, name: str, *sets: str, env: dict | None = None) -> dict:
    """The review-extraction pipeline (JSON Schema) over ``c.rows`` numbered reviews, eager, 256 tokens a row."""
    src = write_rows(c.out / "reviews.jsonl", review_rows(c.rows))
    return c.run(name, ["engine.enforce_eager=true", "sampling.max_tokens=256", "filter.enabled=false", *sets],
                 yaml=REVIEW_YAML, src=src, env=env)


def item_guided(c: Check, ref: dict) -> dict:
    r = _review_run(c, "guided")
    m = r["manifest"]["metrics"]
    valid = r["summary"]["rows_published"]
    return {"ok": valid >= 0.9 * c.rows, **figures(r), "valid_outputs": valid, "of": c.rows,
            "invalid_outputs": m.get("invalid_outputs"), "sample": next(iter(r["rows"].values()))}


def item_fallback(c: Check, ref: dict) -> dict:
    r = _review_run(c, "fallback", "sampling.guided_decoding=fallback")
    m = r["manifest"]["metrics"]
    valid = r["summary"]["rows_published"]
    again = m.get("outputs_asked_again", 0)
    return {"ok": valid >= 0.9 * c.rows and 0 < again <= c.rows, **figures(r), "valid_outputs": valid,
            "of": c.rows, "asked_again_under_the_schema": again, "invalid_outputs": m.get("invalid_outputs")}


def item_samples(c: Check, ref: dict) -> dict:
    r = c.run("samples", ["engine.enforce_eager=true", "sampling.n=3", "sampling.temperature=0.8",
                          "sampling.logprobs=2", "sampling.max_tokens=16"])
    rows = list(r["rows"].values())
    three = sum(1 for x in rows if len(x.get("outputs") or []) == 3)
    lp = sum(1 for x in rows if x.get("logprobs") and all(len(t["top"]) == 2 for t in x["logprobs"]))
    varied = sum(1 for x in rows if len(set(x.get("outputs") or [])) > 1)
    ok = three == len(rows) == c.rows and lp == len(rows) and varied > len(rows) // 2
    return {"ok": ok, **figures(r), "rows_with_3_samples": three, "rows_with_logprobs": lp,
            "rows_whose_samples_differ": varied, "of": c.rows}


def item_embed(c: Check, ref: dict) -> dict:
    r = c.run("embed", ["engine.enforce_eager=true", "engine.task=embed", "filter.enabled=false"])
    hidden = json.loads((Path(c.model) / "config.json").read_text())["hidden_size"]
    vecs = [x["embedding"] for x in r["rows"].values()]
    right = sum(1 for v in vecs if len(v) == hidden and math.isclose(math.sqrt(sum(t * t for t in v)), 1.0,
                                                                       abs_tol=1e-3))
    return {"ok": right == len(vecs) == c.rows, **figures(r), "unit_vectors_of_hidden_size": right, "of": c.rows,
            "hidden_size": hidden}


def item_spec(c: Check, ref: dict) -> dict:
    r = c.run("spec", ["engine.dtype=bfloat16", "engine.speculative={num_speculative_tokens: 4}"])
    base = getattr(c, "greedy_bf16", None)
    equal = None if base is None else sum(1 for k, v in r["rows"].items() if v["output"] == base.get(k))
    ok = r["summary"]["rows_published"] == c.rows and (equal is None or equal >= 0.9 * c.rows)
    return {"ok": ok, **figures(r), "equal_to_bf16_greedy": equal, "of": c.rows,
}


def item_lmdeploy(c: Check, ref: dict) -> dict:
    py = os.environ.get("BATCH_LLM_LMDEPLOY_PYTHON")
    if not py:
        raise CheckFailed("no LMDeploy interpreter: set BATCH_LLM_LMDEPLOY_PYTHON (or --lmdeploy-python)")
    lmd = os.environ.get("BATCH_LLM_LMDEPLOY_PATH")  # where LMDeploy is importable, ahead of the path
    env = {"PYTHONPATH": f"{lmd}:{os.environ.get('PYTHONPATH', '')}"} if lmd else None
    r = c.run("lmdeploy", ["engine.kind=lmdeploy", f"engine.python={py}", "engine.dtype=bfloat16"], env=env)
    base = getattr(c, "greedy_bf16", None)
    equal = None if base is None else sum(1 for k, v in r["rows"].items() if v["output"] == base.get(k))
    return {"ok": r["summary"]["rows_published"] == c.rows, **figures(r), "equal_to_vllm_bf16_greedy": equal,
            "of": c.rows}


def _sglang_env() -> dict:
    """The runs' environment with SGLang's folder first on the path (its pins conflict with vLLM's: a folder of its
    own), the project's code after it."""
    path = os.environ.get("BATCH_LLM_SGLANG_PATH")
    if not path:
        raise CheckFailed("no SGLang: set BATCH_LLM_SGLANG_PATH (or --sglang-path), the folder SGLang is installed in")
    return {"PYTHONPATH": os.pathsep.join([path, str(ROOT / "include"), str(ROOT)])}


def item_sglang(c: Check, ref: dict) -> dict:
    r = c.run("sglang", ["engine.kind=sglang", "engine.dtype=bfloat16", "engine.enforce_eager=false"],
              env=_sglang_env())
    base = getattr(c, "greedy_bf16", None)
    equal = None if base is None else sum(1 for k, v in r["rows"].items() if v["output"] == base.get(k))
    return {"ok": r["summary"]["rows_published"] == c.rows, **figures(r), "vs_cpu_float32": compare(r["rows"], ref),
            "equal_to_vllm_bf16_greedy": equal, "of": c.rows}


def item_sglang_guided(c: Check, ref: dict) -> dict:
    r = _review_run(c, "sglang-guided", "engine.kind=sglang", "engine.dtype=bfloat16", env=_sglang_env())
    m = r["manifest"]["metrics"]
    valid = r["summary"]["rows_published"]
    return {"ok": valid >= 0.9 * c.rows, **figures(r), "valid_outputs": valid, "of": c.rows,
            "invalid_outputs": m.get("invalid_outputs"), "sample": next(iter(r["rows"].values()))}


def make_reference(dest: Path, env: dict) -> None:
    """The CPU's greedy outputs (float32, vLLM CPU) of the reference rows, written to ``dest`` as JSON lines."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu_check_ref_") as tmp:
        c = Check(Path(tmp), _demo_model(), REFERENCE_ROWS, 1800, env)
        r = c.run("cpu-reference", ["engine.dtype=float32"])
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps({"id": k, "output": v["output"]}, ensure_ascii=False) + "\n"
                            for k, v in sorted(r["rows"].items())), encoding="utf-8")
    print(f"{len(r['rows'])} reference outputs → {dest} ({figures(r)})")


def _demo_model() -> str:
    from batch_llm.demo_model import build_demo_model

    return str(build_demo_model())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "var" / "gpu-check"))
    ap.add_argument("--items", default=",".join(ITEMS))
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--model", help="the model folder (default: the demo model, built if missing)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per run")
    ap.add_argument("--lmdeploy-python", help="interpreter with LMDeploy (BATCH_LLM_LMDEPLOY_PYTHON)")
    ap.add_argument("--sglang-path", help="the folder SGLang is installed in (BATCH_LLM_SGLANG_PATH)")
    ap.add_argument("--reference", help="write the CPU reference here instead of checking")
    a = ap.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if a.reference:
        make_reference(Path(a.reference), env)
        return 0
    if a.lmdeploy_python:
        os.environ["BATCH_LLM_LMDEPLOY_PYTHON"] = a.lmdeploy_python
    if a.sglang_path:
        os.environ["BATCH_LLM_SGLANG_PATH"] = a.sglang_path
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ref = {}
    if REFERENCE.exists():
        ref = {r["id"]: r["output"] for r in map(json.loads, REFERENCE.read_text(encoding="utf-8").splitlines())}
    c = Check(out, a.model or _demo_model(), a.rows, a.timeout, env)
    failed = 0
    for name in a.items.split(","):
        t0 = time.time()
        try:
            rec = globals()[f"item_{name}"](c, ref)
        except CheckFailed as e:
            rec = {"ok": False, "why": str(e)}
        rec = {"item": name, **rec, "item_s": round(time.time() - t0, 1)}
        failed += not rec["ok"]
        append_jsonl(out / "gpu_check.jsonl", rec, ensure_ascii=False)
        print(("PASS " if rec["ok"] else "FAIL ") + json.dumps(rec, ensure_ascii=False)[:1500], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
