"""An image row's preparation in vLLM with the engine's Hugging Face processor kept (the stage's engine, as it
starts) against vLLM as it is, on one engine: batches of distinct images, alternating, each batch timed from its
first request to its last result, with vLLM's processor-cache misses counted over the batch.

Why: a profile of an image shard on an H100 (vLLM 0.26) spent ~73 % of each row's preparation in this process
loading the Hugging Face processor again (vLLM's cached lookup missed on every row) while the GPU waited
(docs/benchmarks.md); ``engines.vllm_engine.keep_hf_processor`` keeps it. This times what that saves.

    python -m bench processor-kept --shape bench/shapes/qwen2.5-vl-7b --tokenizer DIR [--n 300] [--repeats 2]
        [--out-len 64] [--out FILE]
"""
from __future__ import annotations

import argparse
import io
import json
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench processor-kept", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help="a vision-language model's config folder (random weights)")
    p.add_argument("--tokenizer", required=True, help="its tokenizer's folder (tokenizer.json unpacked)")
    p.add_argument("--n", type=int, default=300, help="rows a batch")
    p.add_argument("--repeats", type=int, default=2, help="batches a mode, alternating, after one warm-up batch")
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", default=None, help="append the results as JSON lines")
    a = p.parse_args(argv)
    from batch_llm.config.engine import EngineConfig
    from batch_llm.config.sampling import SamplingConfig
    from batch_llm.engines.base import GenRequest
    from batch_llm.engines.registry import make_engine
    from batch_llm.engines.vllm_engine import VllmEngine
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm.transformers_utils import processor as hf_processor

    from bench.inference import product_image, shape_with_tokenizer

    folder = shape_with_tokenizer(a.shape, a.tokenizer)
    tok = AutoTokenizer.from_pretrained(folder)
    engine = make_engine(folder, EngineConfig(kind="vllm", limit_mm_per_prompt={"image": 1}, max_model_len=2048,
                                              enforce_eager=a.enforce_eager,
                                              extra={"load_format": "dummy", "skip_tokenizer_init": False}),
                         SamplingConfig(max_tokens=a.out_len, ignore_eos=True))
    info = engine.start()
    print(f"engine started in {info.start_seconds:.1f}s, processor kept: {info.settings.get('hf_processor_kept')}",
          flush=True)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    assert isinstance(engine, VllmEngine)
    mm_info = engine.llm.llm_engine.renderer.mm_processor.info
    kept = vars(mm_info).get("get_hf_processor")  # keep_hf_processor's, on the object; vLLM's is the class's
    modes = ["kept"] + [m for _ in range(a.repeats) for m in ("vllm", "kept")]  # one warm-up batch first
    results = []
    for k, mode in enumerate(modes):
        if mode == "vllm":
            vars(mm_info).pop("get_hf_processor", None)
        elif kept is not None:
            mm_info.get_hf_processor = kept
        pngs = [product_image(k * a.n + i, a.size) for i in range(a.n)]  # distinct images: vLLM caches by content
        requests = [GenRequest(key=f"b{k}-{i}", prompt_token_ids=ids,
                               images=[Image.open(io.BytesIO(png)).convert("RGB")]) for i, png in enumerate(pngs)]
        before = hf_processor.cached_get_processor.cache_info()
        t = time.perf_counter()
        out = list(engine.generate(requests))
        seconds = time.perf_counter() - t
        after = hf_processor.cached_get_processor.cache_info()
        r = {"mode": mode, "warmup": k == 0, "rows": a.n, "s": round(seconds, 2),
             "ms_per_row": round(1000 * seconds / a.n, 2), "errors": sum(1 for o in out if o.error),
             "processor_misses": after.misses - before.misses, "processor_hits": after.hits - before.hits}
        results.append(r)
        print("RESULT", json.dumps(r), flush=True)
    engine.close()
    if a.out:
        with open(a.out, "a") as f:
            for r in results:
                f.write(json.dumps({**r, "shape": a.shape, "out_len": a.out_len}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
