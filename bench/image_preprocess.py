"""The CPU side of an image row before the engine sees it: decoding the PNG and the model's Hugging Face image
processor, per image, one thread against a pool of threads, the slow (PIL / NumPy) processor against the fast one
(torchvision) where it loads.

Why: on the GPU the image rows of a Qwen2.5-VL-7B shape kept the GPU about a third busy while vLLM's front end
prepared the rows one at a time, in the script and the stage alike (docs/benchmarks.md). This says how much of a row's
time that preparation is, and whether threads would share it out (it only helps where the work leaves the GIL).

    python -m bench image-preprocess --processor DIR [--n 200] [--size 448] [--threads 1,4,8]
    python -m bench image-preprocess --processor DIR --vllm-model DIR [--n 200]: vLLM's own front end too (random
        weights, the images dataset's engine settings): its per-row preparation of a token prompt with one image,
        timed and profiled (cProfile's top functions), as the stage hands rows to it
"""
from __future__ import annotations

import argparse
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

from bench.inference import product_image


def _time(fn, items, threads: int) -> float:
    t0 = time.perf_counter()
    if threads == 1:
        for x in items:
            fn(x)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, items))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench image-preprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("--processor", required=True, help="a folder with the model's preprocessor_config.json")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--threads", default="1,4,8")
    p.add_argument("--out", default=None, help="append the results as JSON lines")
    p.add_argument("--vllm-model", default=None, help="a model folder (config and tokenizer): profile vLLM's front end")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--vllm-threads", default="1", help="with --vllm-model: also prepare the rows on these numbers of "
                   "threads (vLLM's processor cache off, as threads need it: its sender and receiver must see one order)")
    a = p.parse_args(argv)
    from PIL import Image
    from transformers import AutoImageProcessor

    pngs = [product_image(k, a.size) for k in range(a.n)]

    def decode(data: bytes):
        return Image.open(io.BytesIO(data)).convert("RGB")

    images = [decode(x) for x in pngs]
    results = []
    if a.vllm_model:  # first: vLLM's engine process must not be forked after the processors' threads ran
        results.append(_vllm_front_end(a, images))
    threads = [int(t) for t in a.threads.split(",")]
    for t in threads:
        s = _time(decode, pngs, t)
        results.append({"step": "decode", "threads": t, "ms_per_image": round(1000 * s / a.n, 2)})
    for fast in (False, True):
        try:
            proc = AutoImageProcessor.from_pretrained(a.processor, use_fast=fast)
        except Exception as e:  # noqa: BLE001 - the fast processor needs torchvision: say so and go on
            results.append({"step": "processor", "fast": fast, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        kind = type(proc).__name__
        proc(images=images[:2], return_tensors="pt")  # first-call costs (imports, kernels) out of the timing
        for t in threads:
            s = _time(lambda im: proc(images=[im], return_tensors="pt"), images, t)  # noqa: B023 - used at once
            results.append({"step": "processor", "class": kind, "fast": fast, "threads": t,
                            "ms_per_image": round(1000 * s / a.n, 2)})
    for r in results:
        print("RESULT", json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            for r in results:
                f.write(json.dumps({**r, "n": a.n, "size": a.size}) + "\n")
    return 0


def _vllm_front_end(a, images) -> dict:
    """vLLM's preparation of each row in the calling process (``input_processor.process_inputs``: the image
    processor, the image's hash, the prompt's placeholders, the request), as ``LLMEngine.add_request`` runs it for
    the stage's token prompts, one at a time; what is left is sending the request to the engine core."""
    import cProfile
    import os
    import pstats

    # A forked engine process stalled once in its model runner's start after this process had run torch's threads
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    tok = AutoTokenizer.from_pretrained(a.vllm_model)
    pools = [int(t) for t in a.vllm_threads.split(",") if int(t) > 1]
    llm = LLM(model=a.vllm_model, load_format="dummy", max_model_len=2048, limit_mm_per_prompt={"image": 1},
              gpu_memory_utilization=0.9, dtype="bfloat16", **({"mm_processor_cache_gb": 0} if pools else {}))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    engine = llm.llm_engine
    tasks, params = engine.get_supported_tasks(), SamplingParams(max_tokens=8)
    prompts = [TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": im}) for im in images]

    def prepare(i: int) -> None:
        engine.input_processor.process_inputs(f"p{i}", prompts[i], params, tasks)

    prepare(0)  # first-call costs out of the timing
    half = len(prompts) // 2  # distinct images for each pass: vLLM caches a processed image by its hash
    t0 = time.perf_counter()
    for i in range(1, half):
        prepare(i)
    s = time.perf_counter() - t0
    prof = cProfile.Profile()  # the other half, profiled (the timed half's time is the figure)
    prof.enable()
    for i in range(half, len(prompts)):
        prepare(i)
    prof.disable()
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(a.top)
        print(out.getvalue()[-10000:], flush=True)
    result: dict = {"step": "vllm_process_inputs", "ms_per_image": round(1000 * s / (half - 1), 2),
                    "prompt_tokens_before": len(ids), "mm_cache": not pools}
    for t in pools:  # the same rows again: with the cache off nothing is remembered between passes
        result[f"ms_per_image_{t}_threads"] = round(1000 * _time(prepare, range(1, half), t) / (half - 1), 2)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
