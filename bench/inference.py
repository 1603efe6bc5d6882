"""Throughput of the inference stage against the raw engine: the same work, on one clock, repeated.

    python -m bench inference --model DIR [--dummy] --dataset fixed|mix --n 1000 --in-len 256 --out-len 256 \
        --repeats 3
    python -m bench inference --engine lmdeploy --model DIR --vocab 32000 --modes raw,stage   # GPU only
    python -m bench inference --engine sglang --model DIR --dummy --tokenizer TOK --dataset mix \
        --modes raw,stage,vllm:stage --engine-path sglang=/root/sgl:include --engine-path vllm=/root/site:include

Modes, each run in a fresh process (so GPU memory is free between them):
  raw    vllm.LLM.generate over the whole list, as a user would call it (input order, one call), then the
         completions written to a JSONL file; with --engine lmdeploy: LMDeploy's engine fed the same token
         ids (no re-tokenized text), then the completions written
  stage  the project's plan and inference stages as the DAG runs them: the input file planned into one shard
         (validation, the shard's order: largest output budget first, then prompt length), the spawned
         worker (batch_llm.isolation.worker_parent), streaming into the engine, chunk commits, resume bookkeeping, the merged
         outputs.jsonl / errors.jsonl and the manifest
  stage-x  the stage with --stage-extra's engine arguments added (engine.extra): a tuning knob against the same raw
  stage-vllm-graphs  the stage with vLLM's own CUDA graphs (engine.cuda_graphs: vllm) instead of the offline set:
         what the smaller capture is worth at engine start and costs in generation
  stage-compile  the stage with torch.compile (engine.torch_compile: true) under the offline graphs: what skipping
         the compile is worth at engine start and costs in generation
  stage-length-order  the stage with rows that share a prompt prefix not grouped (sharding.group_prefixes: false):
         budget, then prompt length alone; against stage, what the grouping is worth (the docs dataset)
  stage-budget-order  the stage ordering by output budget without the output-length history
         (sharding.length_history: false); against stage with --lengths-store, what the history is worth (the tasks
         dataset with --eos)
  stage-input-order  the stage with its shard in input order (sharding.sort_by_length: false): what the planner's
         order (largest output budget first, then prompt length) is worth
  stage-shards  the input --shards times as large (--n rows a shard), planned into --shards shards that one task
         runs on one engine (sharding.shards_per_task = --shards): a day of many shards on one GPU. Reports the
         engine start (once) against the shards' own time, measured, and the share 100 such shards would pay,
         projected from the measured per-shard time (bench/shards_per_task.py measures both layouts on the CPU)
  raw-tuned  the same raw script with the stage's engine settings: the strongest baseline a user could write in
         ~10 lines (run_raw_tuned's docstring shows them). vLLM imported with the collector paused (the stage's
         gc_paused_import); the engine's constructor arguments and process layout taken from the stage's own
         engine object (VllmEngine: _constructor_args, _multiprocessing, the CPU KV cache variable), so they
         cannot drift: on a GPU decode-only full CUDA graphs at the offline sizes up to 1,024 sequences and no
         torch.compile, the engine core in its own process; on a CPU the engine core in-process
         (VLLM_ENABLE_V1_MULTIPROCESSING=0), the dtype the stage resolves, enforce_eager as the stage, the same
         VLLM_CPU_KVCACHE_SPACE. Only the raw loop differs: one LLM.generate call in input order
  hf     transformers static batching (what ms-swift's `pt` backend does), on the first --hf-n prompts; with
         --engine transformers --dataset images: every row, a plain script of a vision-language model
         (AutoModelForImageTextToText and its processor, batches of --hf-batch rows in input order, the dtype the
         stage resolves), against ``stage`` on the transformers engine with engine.batch_size --hf-batch
  --engine sglang: raw is a plain ``sglang.Engine`` script with the stage's engine settings (the arguments come
         from the stage's own engine object, ``SglangEngine.constructor_args``, as raw-tuned's do for vLLM): one
         ``Engine.generate`` over every row in input order (token ids; the chat dataset: the tokenizer's chat
         template applied first, on the clock, as LLM.chat does), then the completions written; stage is the stage
         on SGLang. SGLang returns text, so its model folder needs a tokenizer: with --dummy, --tokenizer's files
         beside --model's config (the vLLM modes then detokenize too: skip_tokenizer_init off)
  ENGINE:MODE  a mode on another engine in the same alternating schedule, e.g. ``vllm:stage`` beside
         ``--engine sglang``'s raw and stage: the same rows, the same model folder; ``--engine-path ENGINE=PATH``
         gives that engine's children their own PYTHONPATH (engines whose pins conflict live in separate folders)
  --thinking-budget N (chat dataset, a reasoning model's tokenizer, e.g. bench/shapes/qwen3-8b with
         ``qwen-tokenizer --qwen3``): the cost of a thinking day. ``stage`` thinks (sampling.thinking: on,
         sampling.max_thinking_tokens: N, engine.reasoning_parser chosen from the model), each row's max_tokens
         raised by N (the thinking comes on top of the same answer budget); ``stage-think-off`` runs the same rows
         with thinking off (the template's empty thinking block) and the answer budget alone. Random weights never
         end their thinking: the budget ends it, so a thinking row generates N + its answer. The result has the
         shard's reasoning tokens and the rows whose thinking never ended
  --stage-engine JSON: keys merged into stage-x's engine section (e.g. '{"sglang": {"cuda_graph_max_bs": 512}}',
         '{"max_num_seqs": 1024}'): an engine setting against the plain stage's
  --output-schema FILE: the stage modes decode under that JSON Schema (guided decoding through the stage; the
         H200's `run_gpu.sh chat` with CHAT_ARGS="--output-schema ..." MODES=stage,stage-x STAGE_EXTRA=... compares
         one engine setting for guided runs, e.g. vLLM's asynchronous scheduling on, its default, with off)
  raw-inproc / stage-inproc   raw and stage with vLLM's engine core in the calling process
         (VLLM_ENABLE_V1_MULTIPROCESSING=0; the stage's engine.multiprocessing: false): what that saves at start
         (no engine-core process importing vLLM again) against what it costs in generation (no overlap of
         the scheduler with this process's work)

Datasets (token-id prompts, so they also work with random weights, ``--dummy``; chat: messages and a tokenizer):
  fixed  N × in-len random tokens → out-len tokens, ignore_eos
  tiny   N × 8-token prompts → 1 token: the worker's peak RSS as N grows (10k vs 100k rows)
  mix    long-tailed prompt lengths (lognormal), a shared 192-token system prefix on 80 % of rows, 10 % of rows
         repeating an earlier prompt, long-tailed output limits (per-row max_tokens), ignore_eos
  unique the mix without its repeated prompts: every row's prompt is its own (a day of unique prompts, where folding
         duplicates gains nothing and only the order and the overlap can count)
  docs   N // 4 documents of in-len tokens asked 4 questions each (16-40 tokens after the document), question-major
         (every document's first question, then every document's second, ...: a table of questions joined to its
         documents), out-len tokens each (one budget), ignore_eos: rows that share a long prefix lie N // 4 rows
         apart, so an engine fed in input order finds a document in its prefix cache only while the cache holds
         N // 4 documents (a small KV cache: --engine-settings '{"extra": {"kv_cache_memory_bytes": ...}}')
  chat   N review-extraction chats (a system turn and a numbered review from include/sample_data/reviews_zh.jsonl,
         10 % of rows repeating an earlier chat), long-tailed output limits as mix, ignore_eos; the model's
         tokenizer (--tokenizer: a real one, e.g. the demo model's, beside --dummy's random weights) applies its chat
         template: raw and raw-tuned call LLM.chat, the stage gets the messages rows (its own templating)
  tasks  N chats, each a review under one of four task templates whose answers run from a word to a long reply
         (yes/no, an aspect, a summary, a reply to the customer), shuffled, out-len tokens each (one budget): with
         --eos and a real model, rows of one budget end at very different lengths, which the stage learns per
         template (sharding.length_history, --lengths-store); with --dummy, every row runs to its budget
  images N rows of one image and a short question about it (which product, its colour, damage, material, ...; the row
         number in each), out-len tokens each, ignore_eos; the images are PNGs generated once (--image-size pixels
         square, seeded per image: a gradient, a box, coarse noise; 5 % of rows reuse an earlier row's image under
         their own question) into a folder the driver makes (--image-dir) and every run reads. raw and raw-tuned: one
         ``LLM.chat`` over messages whose image parts are ``file://`` URLs (``allowed_local_media_path``: the
         folder), as a user would write it; the stage: the same messages rows as its JSONL input, the folder in
         input.image_roots. Every mode with engine.limit_mm_per_prompt {image: 1} and --mm-processor-kwargs. vLLM
         only (the other engines take no images); a vision-language model: e.g. bench/shapes/qwen2.5-vl-7b --dummy
         --tokenizer (``qwen-tokenizer --vl``), or the tiny BLIP-2 of batch_llm.tiny_models on a CPU

The clock (the same for every mode):
  wall_s          process start → outputs on disk → process exit, measured by this driver around the child
  outputs_s       process start → outputs on disk (raw: its output file written and fsynced; stage: the shard's
                  manifest written, the end of its timeline's commit phase): wall_s without the exit
  engine_ready_s  process start → the engine accepts requests (imports and engine construction included)
  generate_s      the generation call (raw) or the shard's generation phase (stage), nothing else
  tokens          generated (what the engine produced) apart from delivered (output tokens in the rows
                  written: a duplicate prompt generated once and fanned out is delivered twice, generated once)
Each mode runs --repeats times, in alternating order (raw, stage, stage, raw, raw, stage, ...), so a machine
that drifts favours neither; the summary gives the median and the spread (min–max) of each figure, and the
ratios are of medians: whole-process (raw wall / stage wall: the same rows delivered), and generated tokens
per second of generation (stage / raw).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.runners import (
    DUMMY,
    ROOT,
    alternating,
    append_jsonl,
    bench_command,
    bench_config,
    child_env,
    model_vocab,
    print_result,
    run,
    spread,
    wait_quiet,
)


def make_dataset(kind: str, n: int, in_len: int, out_len: int, vocab: int, max_model_len: int, seed: int = 0,
                 image_dir: str | None = None, image_size: int = 448):
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    if kind == "images":
        if image_dir is None:
            raise ValueError("the images dataset needs image_dir: the folder its images are written to")
        return image_rows(n, out_len, Path(image_dir), image_size, seed)
    if kind == "tiny":  # memory check: many rows, 8-token prompts, 1 output token
        return [{"id": f"r{i}", "prompt_token_ids": rng.integers(100, vocab, 8).tolist(), "max_tokens": 1}
                for i in range(n)]
    if kind == "fixed":
        for i in range(n):
            rows.append({"id": f"r{i}", "prompt_token_ids": rng.integers(100, vocab, in_len).tolist(),
                         "max_tokens": out_len})
        return rows
    if kind == "chat":
        return chat_rows(n, out_len, rng)
    if kind == "tasks":
        return task_rows(n, out_len, rng)
    if kind == "docs":
        docs = [rng.integers(100, vocab, min(in_len, max_model_len - out_len - 64)).tolist()
                for _ in range(max(1, n // DOC_QUESTIONS))]
        return [{"id": f"r{q * len(docs) + d}", "max_tokens": out_len,
                 "prompt_token_ids": doc + rng.integers(100, vocab, int(rng.integers(16, 41))).tolist()}
                for q in range(DOC_QUESTIONS) for d, doc in enumerate(docs)]
    prefix = rng.integers(100, vocab, 192).tolist()
    for i in range(n):
        if kind == "mix" and i > 10 and rng.random() < 0.10:  # a repeated prompt
            src = rows[int(rng.integers(0, len(rows)))]
            rows.append({**src, "id": f"r{i}"})
            continue
        plen = int(min(max(16, rng.lognormal(np.log(in_len * 0.6), 0.8)), max_model_len - out_len - 200))
        body = rng.integers(100, vocab, plen).tolist()
        ids = (prefix + body) if rng.random() < 0.8 else body
        olen = int(min(max(8, rng.lognormal(np.log(out_len * 0.4), 0.9)), out_len))
        rows.append({"id": f"r{i}", "prompt_token_ids": ids, "max_tokens": olen})
    return rows


DOC_QUESTIONS = 4  # the docs dataset: questions asked of each document


CHAT_SYSTEM = "从商品评论中提取一个方面、情感和原文证据，只输出 JSON。"


def sample_reviews() -> list[str]:
    """The review texts of include/sample_data/reviews_zh.jsonl: the chat and tasks datasets' material."""
    root = Path(__file__).resolve().parents[1]
    return [json.loads(x)["prompt"] for x in (root / "include" / "sample_data" / "reviews_zh.jsonl").open()]


def chat_rows(n: int, out_len: int, rng) -> list[dict]:
    """The chat dataset: review-extraction conversations, each review numbered (no two equal but the repeats)."""
    import numpy as np

    reviews = sample_reviews()
    rows: list[dict] = []
    for i in range(n):
        if i > 10 and rng.random() < 0.10:  # a repeated chat
            rows.append({**rows[int(rng.integers(0, len(rows)))], "id": f"r{i}"})
            continue
        olen = int(min(max(8, rng.lognormal(np.log(out_len * 0.4), 0.9)), out_len))
        rows.append({"id": f"r{i}", "max_tokens": olen, "messages": [
            {"role": "system", "content": CHAT_SYSTEM},
            {"role": "user", "content": f"第{i + 1}条评论：{reviews[i % len(reviews)]}"}]})
    return rows


TASKS = ("Read the customer review below and answer with a single word, yes or no: is the customer happy?",
         "Read the customer review below and name the one product aspect it is about, in at most three words.",
         "Read the customer review below and summarize what the customer liked and disliked in two sentences.",
         "Read the customer review below and write a long, warm and detailed reply from the shop to this customer, "
         "addressing every point they raise, at least two hundred words.")


def task_rows(n: int, out_len: int, rng) -> list[dict]:
    """The tasks dataset: each review (numbered: no two prompts alike) under a task template drawn at random."""
    reviews = sample_reviews()
    return [{"id": f"r{i}", "max_tokens": out_len, "messages": [
        {"role": "user", "content": f"{TASKS[int(rng.integers(0, len(TASKS)))]}\n\nReview {i + 1}: "
                                    f"{reviews[i % len(reviews)]}"}]} for i in range(n)]


IMAGE_QUESTIONS = ("Describe the product in the photo in one sentence.",
                   "What colour is the product in the photo? Answer in one sentence.",
                   "Does the product in the photo look damaged? Answer in one sentence.",
                   "What material does the product in the photo seem to be made of? One sentence.",
                   "Write a one-sentence caption for this product photo.")


def product_image(k: int, size: int, seed: int = 0) -> bytes:
    """Image ``k`` as PNG bytes, the same for the same (k, size, seed): a two-colour gradient at a random angle, a
    box of a third colour (the "product"), and noise in 8-pixel cells (images that differ beyond their colours)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([seed, k])
    y, x = np.mgrid[0:size, 0:size] / size
    angle = rng.uniform(0, 2 * np.pi)
    t = np.cos(angle) * x + np.sin(angle) * y
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-9)
    low, high = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    img = low + (high - low) * t[..., None]
    x0, y0 = rng.integers(size // 8, size // 2, 2)
    w, h = rng.integers(size // 6, size // 2, 2)
    img[y0:y0 + h, x0:x0 + w] = rng.integers(0, 256, 3)
    cell = 8
    cells = rng.normal(0, 12, (size // cell + 1, size // cell + 1, 3))
    img = img + np.repeat(np.repeat(cells, cell, 0), cell, 1)[:size, :size]
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_rows(n: int, out_len: int, image_dir: Path, size: int = 448, seed: int = 0) -> list[dict]:
    """The images dataset: ``n`` chats of one image and a question each, the images written into ``image_dir``
    where they are not yet (the driver writes them once; each run's process finds them there). 5 % of rows (after
    the first ten) show an earlier row's image under their own question: no two rows' prompts are equal."""
    import numpy as np

    rng = np.random.default_rng(seed)
    image_dir.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []  # the distinct images, in the order they were drawn
    rows: list[dict] = []
    for i in range(n):
        if i > 10 and rng.random() < 0.05:
            path = made[int(rng.integers(0, len(made)))]
        else:
            path = image_dir / f"img-{len(made):05d}-{size}.png"
            if not path.exists():  # written whole, then renamed: a reader never sees half an image
                part = path.with_suffix(f".{os.getpid()}.part")
                part.write_bytes(product_image(len(made), size, seed))
                part.replace(path)
            made.append(path)
        question = f"Item {i + 1}. {IMAGE_QUESTIONS[int(rng.integers(0, len(IMAGE_QUESTIONS)))]}"
        rows.append({"id": f"r{i}", "max_tokens": out_len, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": path.resolve().as_uri()}},
            {"type": "text", "text": question}]}]})
    return rows


def conversations(rows: list[dict]) -> list[list[dict]]:
    """What the raw scripts' one ``LLM.chat`` call gets: each row's messages, in input order (the stage's JSONL input
    is the rows themselves)."""
    return [r["messages"] for r in rows]


def image_urls(messages: list[dict]) -> list[str]:
    """The image URLs of a chat's parts, in order."""
    return [p["image_url"]["url"] for m in messages if isinstance(m["content"], list) for p in m["content"]
            if p.get("type") == "image_url"]


def chat_model_dir(a) -> str:
    """The model folder the chat dataset runs: --model itself, or with --dummy a folder of the model's config
    beside the tokenizer's files (random weights need no weights, a chat template needs a tokenizer)."""
    return shape_with_tokenizer(a.model, a.tokenizer or a.model) if a.dummy else a.model


def shape_with_tokenizer(shape: str, tokenizer: str) -> str:
    """A new folder of a model shape's config files (``*.json``) beside a tokenizer's files: a random-weight model
    that renders chats and detokenizes."""
    import shutil

    d = Path(tempfile.mkdtemp(prefix="bench_chat_model_"))
    for f in Path(tokenizer).iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    for f in Path(shape).glob("*.json"):  # the architecture wins over the tokenizer folder's own config
        shutil.copy(f, d / f.name)
    return str(d)


# ------------------------------------------------------------------------------------------ the modes
def _since_start() -> float:
    """Seconds since the driver started this process (BENCH_T0, wall clock): the one clock of every mode."""
    return time.time() - float(os.environ.get("BENCH_T0", time.time()))


def _write_outputs(path: Path, rows, token_lists) -> None:
    with open(path, "w") as f:
        for r, toks in zip(rows, token_lists):
            f.write(json.dumps({"id": r["id"], "completion_token_ids": toks, "completion_tokens": len(toks)}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _generate_and_write(llm, rows, a) -> tuple[float, float, int]:
    """What both raw scripts do once their engine is up: one ``llm.generate`` over every row in input order
    (greedy, ``ignore_eos``, each row's max_tokens; the chat dataset: one ``llm.chat``), then the completions
    written to a JSONL file. Returns the call's seconds, its start on the one clock, and the tokens generated."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    chat = a.dataset in ("chat", "tasks", "images")
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=not a.eos,
                             detokenize=detokenizes(a)) for r in rows]
    t1, gen_start = time.perf_counter(), _since_start()
    if chat:
        outs = llm.chat(conversations(rows), params, use_tqdm=False)
    else:
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows], params,
                            use_tqdm=False)
    el = time.perf_counter() - t1
    toks = [list(o.outputs[0].token_ids) for o in outs]
    _write_outputs(Path(tempfile.mkdtemp(prefix="bench_raw_")) / "outputs.jsonl", rows, toks)
    return el, gen_start, sum(map(len, toks))


def run_raw(a, rows, *, in_process: bool = False) -> dict:
    if a.engine == "lmdeploy":
        return run_raw_lmdeploy(a, rows)
    if a.engine == "sglang":
        return run_raw_sglang(a, rows)
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(a))
    construct = time.perf_counter() - t0
    ready = _since_start()
    el, gen_start, n_out = _generate_and_write(llm, rows, a)
    return dict(mode="raw-inproc" if in_process else "raw", engine="vllm", generate_s=el, generated_tokens=n_out,
                delivered_tokens=n_out, engine_construct_s=construct, engine_ready_s=ready, rows=len(rows),
                generate_start_s=gen_start, outputs_s=_since_start())


def run_raw_lmdeploy(a, rows) -> dict:
    """LMDeploy's own engine fed the same token ids as the stage (no re-tokenized text, no tokenization on
    the clock): its async engine's ``preprocess(input_ids=...)`` then ``generate``, every request in flight at
    once on the pipeline's own event loop (as the engine interface drives it, without the shard around it)."""
    import asyncio

    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

    t0 = time.perf_counter()
    pipe = pipeline(a.model, backend_config=PytorchEngineConfig(session_len=a.max_model_len, max_batch_size=256,
                    cache_max_entry_count=a.gpu_util, dtype=a.dtype, eager_mode=a.enforce_eager), log_level="WARNING")
    construct = time.perf_counter() - t0
    ready = _since_start()
    engine, loop = pipe.async_engine, pipe.internal_thread.loop  # as engines/lmdeploy_engine.py drives it

    async def one(r: dict) -> tuple[list[int], int]:
        gen = GenerationConfig(max_new_tokens=r["max_tokens"], do_sample=False, ignore_eos=True)
        pre = await engine.preprocess(None, pipe.session_mgr.get(), gen_config=gen,
                                      input_ids=list(r["prompt_token_ids"]), do_preprocess=False)
        out = None
        async for part in engine.generate(pre, stream_response=False):
            resp = part.to_response(0)
            out = out.extend(resp) if out else resp
        if out is None:
            raise RuntimeError("LMDeploy's engine answered nothing")
        return list(getattr(out, "token_ids", None) or []), int(out.generate_token_len)

    t1 = time.perf_counter()
    futures = [asyncio.run_coroutine_threadsafe(one(r), loop) for r in rows]  # all in flight, as pipeline() does
    done = [f.result() for f in futures]
    el = time.perf_counter() - t1
    toks = [t for t, _ in done]
    pipe.close()
    _write_outputs(Path(tempfile.mkdtemp(prefix="bench_raw_")) / "outputs.jsonl", rows, toks)
    n_out = sum(n for _, n in done)
    return dict(mode="raw", engine="lmdeploy", generate_s=el, generated_tokens=n_out, delivered_tokens=n_out,
                engine_construct_s=construct, engine_ready_s=ready, rows=len(rows), outputs_s=_since_start())


def sglang_settings(a) -> dict:
    """The plain SGLang script's ``sglang.Engine`` arguments: the stage's, from the stage's own engine object
    (``SglangEngine.constructor_args``: the engine section mapped as the worker maps it; the same memory share,
    context, CUDA graph ceiling, random weights), without the worker's start-failure handler."""
    import torch
    from batch_llm.engines.sglang_engine import SglangEngine
    from sglang.srt.server_args import ServerArgs

    cfg = stage_config(a)
    eng = SglangEngine(a.model, cfg.engine, cfg.sampling)
    return eng.constructor_args(frozenset(ServerArgs.__dataclass_fields__), on_gpu=torch.cuda.is_available())


def run_raw_sglang(a, rows) -> dict:
    """A plain ``sglang.Engine`` script with the stage's settings (``sglang_settings``), what a user would write::

        import sglang
        llm = sglang.Engine(model_path=model, context_length=2048, mem_fraction_static=0.9, dtype="bfloat16", ...)
        outs = llm.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": n, "temperature": 0,
                                                                 "ignore_eos": True} for n in limits])
        write(outs)

    One batch call in input order; the chat dataset's rows through the tokenizer's chat template first (on the
    clock, as vLLM's LLM.chat templates inside its call). SGLang's engine is imported with the collector paused,
    as the stage imports it."""
    from batch_llm.engines.base import gc_paused_import

    with gc_paused_import("sglang"):
        import sglang
    kwargs = sglang_settings(a)
    t0 = time.perf_counter()
    llm = sglang.Engine(**kwargs)
    construct = time.perf_counter() - t0
    ready = _since_start()
    params = [{"max_new_tokens": r["max_tokens"], "temperature": 0.0, "ignore_eos": True} for r in rows]
    t1, gen_start = time.perf_counter(), _since_start()
    if a.dataset == "chat":
        tok = llm.tokenizer_manager.tokenizer
        ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True) for r in rows]
        ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    else:
        ids = [r["prompt_token_ids"] for r in rows]
    outs = llm.generate(input_ids=ids, sampling_params=params)
    el = time.perf_counter() - t1
    toks = [list(o.get("output_ids") or []) for o in outs]
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    _write_outputs(Path(tempfile.mkdtemp(prefix="bench_raw_")) / "outputs.jsonl", rows, toks)
    info = llm.get_server_info()
    state = (info.get("internal_states") or [{}])[0]
    settings = {k: info.get(k) for k in ("mem_fraction_static", "max_total_num_tokens", "chunked_prefill_size",
                                         "attention_backend", "sampling_backend", "cuda_graph_max_bs",
                                         "disable_cuda_graph", "dtype", "load_format")}
    settings["max_running_requests"] = state.get("effective_max_running_requests_per_dp") or info.get(
        "max_running_requests")
    res = dict(mode="raw", engine="sglang", version=sglang.__version__, generate_s=el, generated_tokens=n_out,
               delivered_tokens=n_out, engine_construct_s=construct, engine_ready_s=ready, rows=len(rows),
               generate_start_s=gen_start, outputs_s=_since_start(), engine_args={k: v for k, v in kwargs.items()
                                                                                  if k != "model_path"},
               tuned_settings=settings)
    print_result(res, "SGLANG_RAW ")  # before the shutdown: what ran, should the teardown hang
    return res


def image_settings(a) -> dict:
    """The images dataset's engine settings, the same for every mode: one image a prompt, and the image processor's
    settings of --mm-processor-kwargs (e.g. a lower max_pixels)."""
    if a.dataset != "images":
        return {}
    kwargs = json.loads(a.mm_processor_kwargs) if a.mm_processor_kwargs else {}
    return {"limit_mm_per_prompt": {"image": 1}, **({"mm_processor_kwargs": kwargs} if kwargs else {})}


def stage_config(a, mode: str = "stage", **paths):
    """The pipeline config a stage mode runs under (``paths``: input and output); raw-tuned takes its engine
    settings from the plain ``stage``'s."""
    extra = json.loads(a.stage_extra or "{}") if mode == "stage-x" else {}
    if detokenizes(a) and a.engine == "vllm":  # random weights, but the tokenizer (chat template, detokenized text)
        extra = {"skip_tokenizer_init": False, **extra}
    more = {**json.loads(a.engine_settings or "{}"),  # every mode's
            **(json.loads(a.stage_engine or "{}") if mode == "stage-x" else {})}
    thinking: dict[str, Any] = {}
    if a.thinking_budget is not None:  # a reasoning model: thinking on (budgeted) or off, the parser from the model
        thinking = {"thinking": "off"} if mode == "stage-think-off" else {
            "thinking": "on", "max_thinking_tokens": a.thinking_budget}
        more = {"reasoning_parser": "auto", **more}
    guided: dict[str, Any] = {}
    if a.output_schema:  # decoded under the schema, rows end where the object does; no free whitespace, in which
        # random weights would otherwise loop to max_tokens
        guided = {"sampling": {"max_tokens": a.out_len, "temperature": 0.0, "seed": 0,
                               "output_schema": str(Path(a.output_schema).resolve())}}
        extra = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}, **extra}
    if thinking:
        guided = {**guided, "sampling": {"max_tokens": a.out_len + (a.thinking_budget or 0), "temperature": 0.0,
                                         "seed": 0, "ignore_eos": True, **guided.get("sampling", {}), **thinking}}
    if a.precision_store or a.lengths_store:  # engine.precision: auto's decisions, the output-length history
        # kept across runs (the result cache stays off)
        guided = {**guided, "cache": {"enabled": False,
                                      "path": str(Path(a.precision_store or a.lengths_store).resolve())}}
    if a.eos:  # rows end where the model ends them
        guided = {**guided, "sampling": {"max_tokens": a.out_len, "temperature": 0.0, "seed": 0, "ignore_eos": False,
                                         **guided.get("sampling", {})}}
    return bench_config(
        a.model, max_tokens=a.out_len, dummy=a.dummy and a.engine != "lmdeploy",
        sharding={"num_shards": 1, "sort_by_length": mode != "stage-input-order",
                  **({"group_prefixes": False} if mode == "stage-length-order" else {}),
                  **({"length_history": False} if mode == "stage-budget-order" else {})},
        engine={"kind": a.engine, "max_model_len": a.max_model_len, "gpu_memory_utilization": a.gpu_util,
                **({"batch_size": a.hf_batch} if a.engine == "transformers" else {}),
                "enforce_eager": a.enforce_eager, "dtype": a.dtype, "extra": extra,
                "commit_every_rows": a.commit_rows, "progress_every_seconds": 30,
                **({"multiprocessing": False} if mode == "stage-inproc" else {}),
                **({"cuda_graphs": "vllm"} if mode == "stage-vllm-graphs" else {}),
                **({"torch_compile": True} if mode == "stage-compile" else {}), **image_settings(a),
                **{k: ({**v} if isinstance(v, dict) else v) for k, v in more.items()}}, **guided, **paths)


def detokenizes(a) -> bool:
    """Whether this run's model folder has a tokenizer that the engines use: a real model, the chat and images
    datasets (vLLM's image processor needs it too), or random weights with --tokenizer (SGLang always: it returns
    text)."""
    return not a.dummy or a.dataset in ("chat", "tasks", "images") or bool(a.tokenizer)


def tuned_settings(a) -> tuple[dict, dict]:
    """The stage's engine settings for this run, from the stage's own engine object (nothing copied): vLLM's
    constructor arguments (``VllmEngine._constructor_args``: the compilation_config of engine.cuda_graphs /
    engine.torch_compile, the dtype ``cpu_dtype`` resolves, enforce_eager, the seed, the same max_model_len and
    memory share) and the environment its ``start`` sets (VLLM_ENABLE_V1_MULTIPROCESSING from
    ``_multiprocessing``, VLLM_CPU_KVCACHE_SPACE). Call it after vLLM is imported (``_multiprocessing`` asks
    vLLM's platform)."""
    from batch_llm.engines.vllm_engine import VllmEngine

    cfg = stage_config(a)
    eng = VllmEngine(a.model, cfg.engine, cfg.sampling)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if eng._multiprocessing() else "0"}
    if "kv_cache_memory_bytes" not in cfg.engine.extra:
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or str(cfg.engine.cpu_kv_cache_gib)
    return eng._constructor_args(), env


def run_raw_tuned(a, rows, on_built=None) -> dict:
    """``raw`` with the stage's engine settings. What a user would write, on a GPU::

        import gc; gc.collect(); gc.disable()
        from vllm import LLM, SamplingParams; from vllm.inputs import TokensPrompt
        gc.freeze(); gc.enable()
        sizes = [1, 2, 4, 8, 16, 32, 64, 128, *range(144, 513, 16), *range(544, 1025, 32)]
        llm = LLM(model, max_model_len=2048, dtype="bfloat16", seed=0, compilation_config={
            "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes, "mode": 0})
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                            [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in limits])
        write(outs)

    and on a CPU ``VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=2`` and ``enforce_eager=True``
    (the bench's --enforce-eager) instead of the compilation_config. Here the settings come from
    ``tuned_settings`` (the stage's engine object), so they are the stage's by construction."""
    from batch_llm.engines.base import gc_paused_import

    with gc_paused_import("vllm"):  # as VllmEngine.start imports it
        from vllm import LLM
    kwargs, env = tuned_settings(a)
    kwargs.update(media_access(a))
    os.environ.update(env)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    construct = time.perf_counter() - t0
    ready = _since_start()
    if on_built is not None:  # raw-tuned-xN: the next process builds its engine now
        on_built()
    el, gen_start, n_out = _generate_and_write(llm, rows, a)
    vc = llm.llm_engine.vllm_config
    if on_built is not None:  # a part of raw-tuned-xN: its process joins its children at exit, the engine core too
        llm.llm_engine.engine_core.shutdown()
    settings = dict(env, dtype=str(vc.model_config.dtype).removeprefix("torch."),
                    enforce_eager=vc.model_config.enforce_eager,
                    compilation_config=kwargs.get("compilation_config"),
                    max_num_seqs=vc.scheduler_config.max_num_seqs, num_kv_blocks=vc.cache_config.num_gpu_blocks)
    return dict(mode="raw-tuned", engine="vllm", generate_s=el, generated_tokens=n_out, delivered_tokens=n_out,
                engine_construct_s=construct, engine_ready_s=ready, rows=len(rows), generate_start_s=gen_start,
                outputs_s=_since_start(), tuned_settings=settings)


def _split_part(a, rows, k: int, results, built) -> None:
    """One process of ``raw-tuned-xN``: waits for the one before it to build its engine, then runs its rows."""
    try:
        if k:
            built[k - 1].wait()
        results.put(run_raw_tuned(a, rows, on_built=built[k].set))
    except BaseException as e:  # the parent raises it: it would otherwise wait for this part forever
        built[k].set()
        results.put({"error": f"part {k}: {e!r}"})


def run_raw_tuned_split(a, rows, n: int) -> dict:
    """``raw-tuned-xN``: the raw-tuned script as N processes sharing the one GPU, each with 1/N of the memory share
    and every N-th row: whether N engines keep a GPU busier than one (a small model, whose engine's own CPU work per
    step can leave the GPU idle). The processes import vLLM at once and build their engines one after another
    (each engine sizes its KV cache from the memory it sees free). The clock: the last one's outputs on disk.
    Each part shuts its engine core down when its outputs are written: a part's process joins its children as it
    exits, and an engine core left running kept both parts (and this run) waiting after their last row (2026-12-07,
    on an H100 and on the CPU). Spawned: nothing of this process's state goes into the parts' engines."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results, built = ctx.Queue(), [ctx.Event() for _ in range(n)]
    a.gpu_util = round(a.gpu_util / n, 3)
    procs = [ctx.Process(target=_split_part, args=(a, rows[k::n], k, results, built)) for k in range(n)]
    for pr in procs:
        pr.start()
    parts = [results.get() for _ in range(n)]
    for pr in procs:
        pr.join()
    if failed := [r["error"] for r in parts if "error" in r]:
        raise RuntimeError("; ".join(failed))
    start = min(r["generate_start_s"] for r in parts)
    end = max(r["generate_start_s"] + r["generate_s"] for r in parts)
    return dict(mode=f"raw-tuned-x{n}", engine="vllm", generate_s=end - start,
                generated_tokens=sum(r["generated_tokens"] for r in parts),
                delivered_tokens=sum(r["delivered_tokens"] for r in parts),
                engine_construct_s=max(r["engine_construct_s"] for r in parts),
                engine_ready_s=max(r["engine_ready_s"] for r in parts), rows=len(rows), generate_start_s=start,
                outputs_s=max(r["outputs_s"] for r in parts), tuned_settings=parts[0]["tuned_settings"],
                parts=[{k: r[k] for k in ("generate_s", "generate_start_s", "engine_ready_s", "outputs_s", "rows")}
                       for r in parts])


def _planned_spec(a, rows, mode: str, shards: int = 1):
    """The stage modes' input: ``rows`` written to a file, planned as the plan task plans it into ``shards``
    shards (more than one: one task runs them all on one engine, ``sharding.shards_per_task``), and the worker's
    spec for them. Returns (plan, spec)."""
    from batch_llm.io.storage import Location, write_jsonl
    from batch_llm.isolation.shard_process import worker_spec
    from batch_llm.layout import RunLayout
    from batch_llm.stages.plan import length_history, write_plan

    work = Path(tempfile.mkdtemp(prefix="bench_stage_"))
    input_url = str(work / "input.jsonl")
    write_jsonl(Location(input_url).path(), rows)
    cfg = stage_config(a, mode, input=input_url, output=str(work))
    if a.dataset == "images":  # the images stay where the driver wrote them, outside the input's folder
        cfg = cfg.with_overrides({"input.image_roots": [str(Path(a.image_dir).resolve())]})
    if shards > 1:
        cfg = cfg.with_overrides({"sharding.num_shards": shards, "sharding.shards_per_task": shards})
    layout = RunLayout.for_run(cfg, run_id="bench", ds="2026-01-01")
    plan = write_plan(cfg, input_loc=Location(input_url), plan_dir=Location(str(work / "plan")),
                      history=length_history(cfg, layout))  # as the plan task reads it: from --lengths-store, if any
    assert plan.valid == len(rows) and len(plan.shards) == shards, plan
    model = {"local_dir": a.model, "model_key": "bench"}
    return plan, worker_spec(cfg, layout, model, list(plan.shards) if shards > 1 else plan.shards[0])


def run_stage_shards(a, rows) -> dict:
    """``stage-shards``: every row planned into ``--shards`` shards of ``--n`` rows, one worker and one engine for
    all of them (``sharding.shards_per_task``), as a GPU task of the DAG runs them. The clock: the worker's
    process start to its last shard's manifest; per shard, its phases from the engine being ready (or the end of
    the shard before) to its commit's end."""
    from batch_llm.isolation.worker_parent import WorkerHandle
    from batch_llm.manifests import ShardManifest

    _, spec = _planned_spec(a, rows, "stage", shards=a.shards)
    t0 = time.time()
    result = WorkerHandle.start(spec).wait(on_line=lambda line: print("  [stage]", line[:300], flush=True)
                                           if any(k in line for k in ("done", "Error", "started in")) else None)
    ms = [ShardManifest.model_validate(m) for m in result["shards"]]
    ends = [max(p.end for p in m.phases if p.end) for m in ms]
    first = min(p.start for p in ms[0].phases)
    start = ms[0].metrics.engine_start_seconds
    cold = sum(p.end - p.start for p in ms[0].phases if p.name in ("spawn", "imports", "engine"))
    per_shard = [e - b for b, e in zip([first + cold, *ends[:-1]], ends)]
    whole = ends[-1] - first
    per = sorted(per_shard)[len(per_shard) // 2]
    return dict(mode="stage-shards", engine=a.engine, shards=len(ms), rows=sum(m.metrics.rows for m in ms),
                generate_s=sum(m.metrics.generate_seconds for m in ms),
                generated_tokens=sum(m.metrics.output_tokens_this_attempt for m in ms),
                delivered_tokens=sum(m.metrics.output_tokens for m in ms),
                unique_prompts=sum(m.metrics.unique_prompts for m in ms),
                engine_starts=sum(m.metrics.engine_start_seconds > 0 for m in ms),
                engine_start_s=round(start, 2), cold_start_s=round(cold, 2), worker_s=round(whole, 2),
                driver_s=round(time.time() - t0, 2), per_shard_s=[round(x, 2) for x in per_shard],
                per_shard_median_s=round(per, 2), generate_s_per_shard=[round(m.metrics.generate_seconds, 2)
                                                                        for m in ms],
                engine_start_share=round(start / whole, 4), cold_start_share=round(cold / whole, 4),
                # the same engine start over 100 shards of the measured median time each: a projection
                engine_start_share_100_projected=round(start / (cold + 100 * per), 4),
                cold_start_share_100_projected=round(cold / (cold + 100 * per), 4),
                outputs_s=_outputs_written([p.model_dump() for p in ms[-1].phases]))


def run_stage(a, rows, mode: str = "stage") -> dict:
    """``mode``: stage, stage-inproc, stage-x, stage-vllm-graphs, stage-compile, stage-length-order or
    stage-input-order (the module's docstring says what each is)."""
    from batch_llm.isolation.worker_parent import WorkerHandle

    plan, spec = _planned_spec(a, rows, mode)
    ready: list[float] = []

    def on_line(line: str) -> None:
        if " started in " in line and "engine " in line and not ready:
            ready.append(_since_start())  # the worker says so the moment the engine is up
        if any(k in line for k in ("progress", "done", "Error", *ENGINE_LOG_MARKS)):
            print("  [stage]", line[:300], flush=True)

    m = WorkerHandle.start(spec).wait(on_line=on_line)
    mt = m["metrics"]
    settings = (m.get("engine") or {}).get("settings") or {}
    return dict(mode=mode, engine=a.engine, generate_s=mt["generate_seconds"],
                generated_tokens=mt["output_tokens_this_attempt"], delivered_tokens=mt["output_tokens"],
                engine_construct_s=mt["engine_start_seconds"], engine_ready_s=ready[0] if ready else None,
                unique_prompts=mt["unique_prompts"], rows=mt["rows"], worker_peak_rss_mb=mt.get("peak_rss_mb"),
                ok_rows=mt.get("ok"), invalid_outputs=mt.get("invalid_outputs"),
                reasoning_tokens=mt.get("reasoning_tokens"), thinking_unfinished=mt.get("thinking_unfinished"),
                async_scheduling=settings.get("async_scheduling"), model_runner_v2=settings.get("model_runner_v2"),
                engine_start_phases=settings.get("start_phases"), precision=settings.get("precision"),
                quantization=settings.get("quantization"), plan_s=plan.seconds, phases=m.get("phases"),
                prompt_tokens=mt.get("input_tokens"), cached_prompt_tokens=mt.get("cached_prompt_tokens"),
                order=plan.order, length_history=plan.length_history,
                outputs_s=_outputs_written(m.get("phases") or []))


# vLLM's own lines on where its start went (kept in --logs)
ENGINE_LOG_MARKS = ("Graph capturing", "init engine", "torch.compile took", "KV cache size", "Model loading took",
                    "cudagraph", "CUDAGraphMode", "Asynchronous scheduling",
                    # SGLang's
                    "Capture cuda graph", "KV Cache is allocated", "max_total_num_tokens", "Load weight end",
                    "attention_backend")


def _outputs_written(phases: list[dict]) -> float | None:
    """Seconds since the driver started this process until the shard's manifest was written (its commit
    phase's end, on the worker's wall clock, which is this machine's)."""
    end = next((p["end"] for p in phases if p["name"] == "commit" and p.get("end")), None)
    t0 = os.environ.get("BENCH_T0")
    return None if end is None or t0 is None else end - float(t0)


def run_hf(a, rows) -> dict:
    if a.dataset == "images":
        return run_hf_images(a, rows)
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
    return dict(mode="hf", generate_s=time.perf_counter() - t1, generated_tokens=n_out, delivered_tokens=n_out,
                rows=len(rows))


def run_hf_images(a, rows) -> dict:
    """``hf`` on the images dataset: what a user of plain transformers writes for a vision-language model, with the
    stage's transformers settings (the dtype ``cpu_dtype`` resolves, batches of --hf-batch, transformers imported
    with the collector paused): each row's chat
    rendered by the processor's template (an image part as ``{"type": "image"}``, as the stage renders it), its
    image read with PIL, the processor over a batch (left padding), one greedy ``generate`` each batch, every row's
    tokens written."""
    from batch_llm.engines.base import gc_paused_import
    from batch_llm.host.probes import cpu_dtype
    from PIL import Image

    with gc_paused_import("transformers"):  # as TransformersEngine.start imports it
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = cpu_dtype(a.dtype, a.model, on_gpu=dev == "cuda")
    t0 = time.perf_counter()
    model = AutoModelForImageTextToText.from_pretrained(
        a.model, dtype="auto" if dtype == "auto" else getattr(torch, dtype)).to(dev).eval()
    processor = AutoProcessor.from_pretrained(a.model)
    processor.tokenizer.padding_side = "left"
    pad = processor.tokenizer.pad_token_id
    construct, ready = time.perf_counter() - t0, _since_start()
    t1 = time.perf_counter()
    toks: list[list[int]] = []
    with torch.inference_mode():
        for i in range(0, len(rows), a.hf_batch):
            batch = rows[i:i + a.hf_batch]
            chats = [[{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image_url" else p
                                                      for p in m["content"]]} for m in r["messages"]] for r in batch]
            texts = [processor.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                     for c in chats]
            images = [[Image.open(Path(p["image_url"]["url"].removeprefix("file://"))).convert("RGB")
                       for p in r["messages"][-1]["content"] if p["type"] == "image_url"] for r in batch]
            inputs = processor(text=texts, images=images, padding=True, add_special_tokens=False, return_tensors="pt")
            inputs = {k: v.to(dev, dtype=model.dtype) if v.is_floating_point() else v.to(dev) for k, v in inputs.items()}
            out = model.generate(**inputs, max_new_tokens=max(r["max_tokens"] for r in batch), do_sample=False,
                                 eos_token_id=None, pad_token_id=pad)
            width = inputs["input_ids"].shape[1]
            toks += [row[width:width + r["max_tokens"]] for r, row in zip(batch, out.tolist())]
    el = time.perf_counter() - t1
    _write_outputs(Path(tempfile.mkdtemp(prefix="bench_hf_")) / "outputs.jsonl", rows, toks)
    n_out = sum(map(len, toks))
    return dict(mode="hf", engine="transformers", generate_s=el, generated_tokens=n_out, delivered_tokens=n_out,
                engine_construct_s=construct, engine_ready_s=ready, rows=len(rows), outputs_s=_since_start(),
                tuned_settings={"dtype": dtype, "batch_size": a.hf_batch, "device": dev})


def engine_kwargs(a) -> dict:
    kw = dict(model=a.model, max_model_len=a.max_model_len, gpu_memory_utilization=a.gpu_util, dtype=a.dtype,
              enforce_eager=a.enforce_eager, seed=0)
    if a.dummy:
        kw.update(DUMMY, **({"skip_tokenizer_init": False} if detokenizes(a) else {}))
    return {**kw, **image_settings(a), **media_access(a)}


def media_access(a) -> dict:
    """What LLM.chat needs to read the images dataset's ``file://`` URLs: the folder they are in."""
    return {"allowed_local_media_path": str(Path(a.image_dir).resolve())} if a.dataset == "images" else {}


def child(a) -> None:
    vocab = a.vocab or model_vocab(a.model)
    n = a.n * a.shards if a.child == "stage-shards" else a.n  # --n rows a shard
    if a.dataset == "images" and not a.image_dir:  # a child started on its own (bench/run_gpu.sh profile)
        a.image_dir = tempfile.mkdtemp(prefix="bench_images_")
    rows = make_dataset(a.dataset, n, a.in_len, a.out_len, vocab - 1, a.max_model_len, image_dir=a.image_dir,
                        image_size=a.image_size)
    if a.dataset in ("chat", "tasks", "images") or (a.dummy and a.tokenizer):
        a.model = chat_model_dir(a)
    if a.thinking_budget is not None and a.child != "stage-think-off":  # the thinking on top of the answer budget
        rows = [{**r, "max_tokens": r["max_tokens"] + a.thinking_budget} for r in rows]
    modes = {"raw": run_raw, "hf": run_hf, "raw-inproc": lambda a, rows: run_raw(a, rows, in_process=True),
             "raw-tuned": run_raw_tuned}
    modes["stage-shards"] = run_stage_shards
    if a.child.startswith("raw-tuned-x"):
        modes[a.child] = lambda a, rows: run_raw_tuned_split(a, rows, int(a.child.removeprefix("raw-tuned-x")))
    res = modes[a.child](a, rows) if a.child in modes else run_stage(a, rows, a.child)
    res.setdefault("unique_prompts", len({(json.dumps(r.get("messages") or r["prompt_token_ids"]), r["max_tokens"])
                                          for r in rows}))
    res["generated_tok_s"] = round(res["generated_tokens"] / res["generate_s"], 1)
    import resource

    res["process_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print_result(res)


def summarize(runs: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for mode, rs in runs.items():
        out[mode] = {k: spread([r[k] for r in rs if r.get(k) is not None])
                     for k in ("wall_s", "outputs_s", "engine_ready_s", "generate_s", "generated_tok_s")
                     if any(r.get(k) is not None for r in rs)}
        out[mode].update(generated_tokens=rs[0]["generated_tokens"], delivered_tokens=rs[0]["delivered_tokens"],
                         unique_prompts=rs[0].get("unique_prompts"), rows=rs[0].get("rows"),
                         **{k: rs[0][k] for k in ("reasoning_tokens", "thinking_unfinished") if rs[0].get(k)})
        if any(r.get("cached_prompt_tokens") is not None for r in rs):  # stage modes: the engine's prefix cache
            out[mode]["cached_prompt_tokens"] = spread([r["cached_prompt_tokens"] for r in rs
                                                        if r.get("cached_prompt_tokens") is not None])
            out[mode]["prompt_tokens"] = rs[0].get("prompt_tokens")
    pairs = [(m, "raw") for m in ("stage", "stage-x", "stage-vllm-graphs", "stage-compile", "stage-input-order",
                                  "stage-inproc", "raw-inproc", "raw-tuned")]
    pairs += [(m, "raw-tuned") for m in ("stage", "stage-x", "stage-inproc", "raw-tuned-x2", "raw-tuned-x3")]
    pairs += [(m, "vllm:stage") for m in ("stage", "raw", "stage-x")]  # --engine sglang (or lmdeploy) against vLLM
    pairs += [("stage-x", "stage"), ("stage", "stage-think-off"), ("stage", "hf"),  # hf: --engine transformers
              ("stage", "stage-length-order"), ("stage", "stage-budget-order")]
    for mode, base in pairs:
        if base in out and mode in out:  # "stage_over_raw", "stage-inproc_over_raw", "stage_over_raw-tuned", ...
            out[f"{mode}_over_{base}"] = {
                "whole_process": round(out[base]["wall_s"]["median"] / out[mode]["wall_s"]["median"], 3),
                **({"to_outputs_on_disk": round(out[base]["outputs_s"]["median"] / out[mode]["outputs_s"]["median"], 3)}
                   if "outputs_s" in out[base] and "outputs_s" in out[mode] else {}),
                "generated_tok_s_in_generation": round(out[mode]["generated_tok_s"]["median"]
                                                       / out[base]["generated_tok_s"]["median"], 3),
                "whole_process_pairs": [round(r["wall_s"] / s["wall_s"], 3) for r, s in zip(runs[base], runs[mode])]}
    return out


ENGINES = ("vllm", "lmdeploy", "sglang", "transformers")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--engine", choices=ENGINES, default="vllm")
    p.add_argument("--engine-path", action="append", default=[], metavar="ENGINE=PATH",
                   help="the PYTHONPATH of that engine's runs (replacing this process's), e.g. sglang=/root/sgl:include")
    p.add_argument("--vocab", type=int, default=0, help="draw prompt token ids below this (default: the model's)")
    p.add_argument("--dummy", action="store_true", help="random weights (load_format=dummy), token-id prompts")
    p.add_argument("--dataset", choices=["fixed", "mix", "unique", "docs", "tiny", "chat", "tasks", "images"],
                   default="fixed")
    p.add_argument("--tokenizer", help="chat, images: the tokenizer's folder (default: --model's)")
    p.add_argument("--image-size", type=int, default=448, help="images: each image's side in pixels")
    p.add_argument("--image-dir", help="images: the folder of the images (default: a new one, written once)")
    p.add_argument("--mm-processor-kwargs", help="images: JSON, the image processor's settings in every mode "
                   "(vLLM's mm_processor_kwargs, the stage's engine.mm_processor_kwargs), e.g. '{\"max_pixels\": 1003520}'")
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
    p.add_argument("--modes", default="raw,stage")
    p.add_argument("--shards", type=int, default=8, help="stage-shards: shards of --n rows each, one engine")
    p.add_argument("--stage-extra", default="", help="JSON: engine arguments of the stage-x mode (engine.extra)")
    p.add_argument("--stage-engine", default="", help="JSON: keys merged into the stage-x mode's engine section")
    p.add_argument("--engine-settings", default="", help="JSON: keys merged into every mode's engine section (raw-tuned "
                   "takes them from the stage's engine), e.g. '{\"quantization\": \"fp8\", \"max_num_seqs\": 1024}'")
    p.add_argument("--precision-store", help="stage modes: cache.path, where engine.precision: auto stores its "
                   "decision: runs after the first start in the decided precision without calibrating")
    p.add_argument("--eos", action="store_true", help="rows end at the model's end of sequence (no ignore_eos) in "
                   "raw, raw-tuned and the stage modes: a real model's lengths (the tasks dataset)")
    p.add_argument("--lengths-store", help="stage modes: cache.path, where the shards record their output lengths "
                   "and the plan reads them (sharding.length_history): a first unrecorded run (--warmup 1) records")
    p.add_argument("--thinking-budget", type=int, help="chat, a reasoning model: stage thinks (this budget, on top of "
                   "each row's answer budget), stage-think-off does not")
    p.add_argument("--output-schema", help="stage modes only: sampling.output_schema (a JSON Schema file), xgrammar "
                   "without free whitespace, rows ending where the object does (no ignore_eos): guided decoding "
                   "through the stage, e.g. --modes stage,stage-x --stage-extra '{\"async_scheduling\": true}'")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode, in alternating order (>= 3)")
    p.add_argument("--warmup", type=int, choices=(0, 1), default=0, help="one unrecorded run first (compile cache)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help="append results as JSON lines to this file: each run as it ends, then the "
                   "summary (earlier files carry the runs inside the summary line instead)")
    p.add_argument("--wait-quiet", type=float, default=0, help="before each run, wait up to this many seconds "
                   "for the machine to be quiet (>= 85 %% idle over 3 s; a shared machine); the wait is recorded")
    p.add_argument("--logs", help="keep each child's output (the engine's own log) in this folder")
    return p


def _takes_images(mode: str, default_engine: str) -> bool:
    """Whether a mode can run the images dataset: vLLM's raw scripts and stage modes, the transformers engine's
    hf script and stage."""
    engine, _, m = mode.rpartition(":")
    if (engine or default_engine) == "transformers":
        return m in ("hf", "stage")
    return (engine or default_engine) == "vllm" and (m in ("raw", "raw-inproc", "raw-tuned") or m.startswith("stage"))


def check_args(p: argparse.ArgumentParser, a) -> dict[str, str]:
    """Refuses what cannot run together (argparse's error); returns --engine-path as {engine: PYTHONPATH}."""
    if a.engine != "vllm" and "raw-tuned" in a.modes.split(","):
        p.error("raw-tuned takes the stage's vLLM engine settings: --engine vllm only (SGLang's raw is its tuned "
                "plain script)")
    if a.thinking_budget is not None and (a.dataset != "chat" or any(
            m.split(":")[-1] not in ("stage", "stage-think-off") for m in a.modes.split(","))):
        p.error("--thinking-budget: the chat dataset and the modes stage, stage-think-off")
    if a.precision_store and a.lengths_store and Path(a.precision_store).resolve() != Path(a.lengths_store).resolve():
        p.error("--precision-store and --lengths-store are both the stage's cache.path: give one folder, or the same")
    if a.eos and a.thinking_budget is not None:
        p.error("--eos with --thinking-budget: the thinking runs keep ignore_eos (the budget is what they measure)")
    if a.engine == "sglang" and a.dummy and not a.tokenizer:
        p.error("--engine sglang with --dummy needs --tokenizer: SGLang's engine in the stage returns text")
    for m in a.modes.split(","):
        if ":" in m and m.split(":", 1)[0] not in ENGINES:
            p.error(f"mode {m}: ENGINE:MODE with ENGINE one of {', '.join(ENGINES)}")
    if a.output_schema and any(not m.startswith("stage") for m in a.modes.split(",")):
        p.error("--output-schema: stage modes only (the raw modes decode freely)")
    if a.dataset == "images" and not all(_takes_images(m, a.engine) for m in a.modes.split(",")):
        p.error("--dataset images: engine vllm's raw and stage modes, engine transformers' hf and stage (LMDeploy's "
                "and SGLang's take no images here)")
    if a.engine == "transformers" and any(m.split(":")[-1] not in ("hf", "stage") for m in a.modes.split(",")
                                          if ":" not in m):
        p.error("--engine transformers: the modes hf (the plain script) and stage")
    return dict(x.split("=", 1) for x in a.engine_path)


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    paths = check_args(p, a)
    if a.child:
        return child(a)
    runs: dict[str, list[dict]] = {}
    images_s = None
    if a.dataset == "images" and not a.image_dir:  # written once, here; every run reads the same files
        a.image_dir = tempfile.mkdtemp(prefix="bench_images_")
        t = time.perf_counter()
        image_rows(a.n * (a.shards if "stage-shards" in a.modes.split(",") else 1), a.out_len, Path(a.image_dir),
                   a.image_size)
        images_s = round(time.perf_counter() - t, 2)
        argv = [*argv, "--image-dir", a.image_dir]
        print(f"images: {len(list(Path(a.image_dir).glob('*.png')))} in {a.image_dir} ({images_s} s)", flush=True)
    schedule = [m for _, m in alternating(a.modes.split(","), a.repeats)]
    # A first run on a fresh machine also fills vLLM's compile cache (~/.cache/vllm), which every later run
    # of either mode reuses: --warmup runs one, unrecorded, so no mode pays for it alone.
    for i, mode in enumerate(([schedule[0]] * a.warmup) + schedule):
        waited = wait_quiet(limit_s=a.wait_quiet) if a.wait_quiet else None
        engine, child_mode = mode.split(":", 1) if ":" in mode else (a.engine, mode)
        env = child_env()
        if engine in paths:  # that engine's folder, not this process's
            env["PYTHONPATH"] = os.pathsep.join([paths[engine], str(ROOT)])
        proc = run(bench_command("inference", *argv, "--engine", engine, "--child", child_mode), env=env,
                   merge_stderr=False)
        if a.logs:
            Path(a.logs).mkdir(parents=True, exist_ok=True)
            (Path(a.logs) / f"{i:02d}-{mode}.log").write_text(proc.out + "\n--- stderr\n" + proc.err)
        res = proc.result()
        if res is None:
            print(f"{mode} FAILED rc={proc.rc}\n{proc.out[-2000:]}\n{proc.err[-3000:]}", flush=True)
            continue
        res.update(wall_s=round(proc.wall_s, 2), started_epoch=round(proc.started, 3),
                   **({"waited_quiet_s": waited} if waited is not None else {}))
        if a.warmup and not runs.get("_warmup"):
            runs["_warmup"] = [res]
            print(f"warm-up ({mode}, not counted): wall {res['wall_s']} s", flush=True)
            continue
        runs.setdefault(mode, []).append(res)
        print(f"{mode}: " + json.dumps({k: v for k, v in res.items() if k != "phases"}), flush=True)
        append_jsonl(a.out, {"run": res})  # as it ends: a call cut short by its time limit keeps the runs it finished
    warm = runs.pop("_warmup", None)
    summary = {"engine": a.engine, "warmup_wall_s": warm[0]["wall_s"] if warm else None, "dataset": a.dataset,
               "n": a.n, "in_len": a.in_len, "out_len": a.out_len, "dummy": a.dummy, "model": a.model,
               "output_schema": a.output_schema, "stage_extra": a.stage_extra or None,
               "stage_engine": a.stage_engine or None, "tokenizer": a.tokenizer,
               "thinking_budget": a.thinking_budget,
               **({"image_size": a.image_size, "images_written_s": images_s} if a.dataset == "images" else {}),
               "repeats": a.repeats, "order": schedule, **summarize(runs)}
    print_result(summary, "SUMMARY ")
    append_jsonl(a.out, {"summary": summary})  # its runs are the {"run": ...} lines above it
