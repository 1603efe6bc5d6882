"""The inference benchmark's images dataset, without an engine: its rows and image files (decodable, the same bytes
from two calls, mostly distinct), the raw LLM.chat script's conversations against the stage's JSONL input and plan
(the same images, in the same order, hashed from the same files), both modes' image settings, and the Qwen2.5-VL-7B
shape (config through transformers' AutoConfig, its image processor's token count, the --vl chat template)."""
from __future__ import annotations

import hashlib
import io
import json
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import inference, qwen_tokenizer  # noqa: E402

SHAPE = ROOT / "bench" / "shapes" / "qwen2.5-vl-7b"


def _rows(folder: Path, n: int, size: int = 32) -> list[dict]:
    return inference.make_dataset("images", n, 0, 8, 1000, 2048, image_dir=str(folder), image_size=size)


def _path(url: str) -> Path:
    assert url.startswith("file://"), url
    return Path(urlparse(url).path)


def test_rows_are_one_decodable_image_and_a_question_each_and_the_same_from_two_calls(tmp_path):
    from PIL import Image

    a, b = _rows(tmp_path / "a", 200), _rows(tmp_path / "b", 200)
    assert [r["id"] for r in a] == [f"r{i}" for i in range(200)] and all(r["max_tokens"] == 8 for r in a)
    files = []
    for ra, rb in zip(a, b):
        [msg] = ra["messages"]
        assert msg["role"] == "user" and [p["type"] for p in msg["content"]] == ["image_url", "text"]
        assert msg["content"][1]["text"].startswith(f"Item {int(ra['id'][1:]) + 1}. ")
        [pa], [pb] = inference.image_urls(ra["messages"]), inference.image_urls(rb["messages"])
        fa, fb = _path(pa), _path(pb)
        assert fa.parent == (tmp_path / "a").resolve() and fa.name == fb.name
        assert fa.read_bytes() == fb.read_bytes()  # deterministic: seeded per image
        assert rb["messages"][0]["content"][1] == msg["content"][1]
        files.append(fa)
    with Image.open(files[0]) as img:
        img.load()
        assert (img.format, img.size, img.mode) == ("PNG", (32, 32), "RGB")
    distinct = set(files)
    for f in distinct:
        with Image.open(f) as img:
            img.load()  # every file decodes in full
    # mostly distinct images, a few shown again under another question; distinct files are distinct pictures
    assert 0.85 * len(a) <= len(distinct) < len(a)
    assert len({hashlib.sha256(f.read_bytes()).digest() for f in distinct}) == len(distinct)
    assert len({json.dumps(r["messages"]) for r in a}) == len(a)  # no two prompts equal
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(f.name for f in distinct)  # no stray files


def test_the_default_size_is_448_pixels(tmp_path):
    from PIL import Image

    a = inference.build_parser().parse_args(["--model", "/m", "--dataset", "images"])
    rows = inference.make_dataset("images", 1, 0, 8, 1000, 2048, image_dir=str(tmp_path), image_size=a.image_size)
    with Image.open(_path(inference.image_urls(rows[0]["messages"])[0])) as img:
        assert img.size == (448, 448)


def test_raw_and_the_stage_read_the_same_images_in_the_same_order_with_the_same_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(inference.tempfile, "tempdir", str(tmp_path))  # the stage's work folder: under tmp_path
    images = tmp_path / "images"
    a = inference.build_parser().parse_args([
        "--model", str(SHAPE), "--dummy", "--dataset", "images", "--n", "24", "--image-size", "32",
        "--image-dir", str(images), "--out-len", "8"])
    rows = inference.make_dataset("images", a.n, 0, a.out_len, 1000, a.max_model_len, image_dir=a.image_dir,
                                  image_size=a.image_size)
    raw = {r["id"]: inference.image_urls(m) for r, m in zip(rows, inference.conversations(rows))}
    assert all(len(urls) == 1 for urls in raw.values())

    plan, spec = inference._planned_spec(a, rows, "stage")
    cfg = spec["config"]
    assert Path(cfg["input"]["path"]).parent.parent == tmp_path
    # the stage's JSONL input: the rows, in input order, naming the same image URLs
    written = [json.loads(x) for x in Path(cfg["input"]["path"]).read_text().splitlines()]
    assert [(r["id"], inference.image_urls(r["messages"])) for r in written] == list(raw.items())
    # its plan: every row valid, each row's image the file the raw script reads, hashed from its bytes
    assert plan.valid == a.n
    shard = [json.loads(x) for x in Path(plan.shards[0].url).read_text().splitlines()]
    assert {r["id"] for r in shard} == set(raw)
    for r in shard:
        urls = [_path(u) for u in raw[r["id"]]]
        assert [Path(i["url"]) for i in r["images"]] == urls
        assert [i["sha256"] for i in r["images"]] == [hashlib.sha256(u.read_bytes()).hexdigest() for u in urls]
        parts = [p for p in r["messages"][0]["content"] if p["type"] == "image"]
        assert [p["sha256"] for p in parts] == [i["sha256"] for i in r["images"]]

    # the same engine settings for images: one a prompt; raw reads file:// URLs from the images' folder, the stage
    # has that folder among its input's image roots
    kw = inference.engine_kwargs(a)
    assert kw["limit_mm_per_prompt"] == cfg["engine"]["limit_mm_per_prompt"] == {"image": 1}
    assert kw["allowed_local_media_path"] == str(images.resolve()) and cfg["input"]["image_roots"] == [kw[
        "allowed_local_media_path"]]
    assert all(str(u).startswith(kw["allowed_local_media_path"] + "/") for urls in raw.values()
               for u in map(_path, urls))
    # random weights, but the tokenizer stays (the chat template, vLLM's image processor)
    assert kw["skip_tokenizer_init"] is False and cfg["engine"]["extra"]["skip_tokenizer_init"] is False
    assert (kw["max_model_len"], kw["dtype"]) == (cfg["engine"]["max_model_len"], cfg["engine"]["dtype"])
    assert "mm_processor_kwargs" not in kw and not cfg["engine"]["mm_processor_kwargs"]
    a.mm_processor_kwargs = json.dumps({"max_pixels": 200704})
    assert inference.engine_kwargs(a)["mm_processor_kwargs"] == {"max_pixels": 200704} == \
        inference.stage_config(a).engine.mm_processor_kwargs
    text = inference.build_parser().parse_args(["--model", "/m", "--dummy", "--dataset", "fixed"])
    assert "limit_mm_per_prompt" not in inference.engine_kwargs(text)
    assert inference.stage_config(text).engine.limit_mm_per_prompt is None


@pytest.mark.parametrize("argv", [["--engine", "sglang", "--tokenizer", "/t"], ["--engine", "lmdeploy"],
                                  ["--modes", "raw,hf"], ["--modes", "stage,sglang:stage"],
                                  ["--engine", "transformers", "--modes", "raw,stage"]])
def test_engines_and_modes_that_take_no_images_are_refused(argv, capsys):
    p = inference.build_parser()
    with pytest.raises(SystemExit):
        inference.check_args(p, p.parse_args(["--model", "/m", "--dummy", "--dataset", "images", *argv]))
    assert "--dataset images" in capsys.readouterr().err
    ok = p.parse_args(["--model", "/m", "--dataset", "images", "--modes", "raw,raw-tuned,stage,stage-inproc,vllm:stage"])
    assert inference.check_args(p, ok) == {}
    ok = p.parse_args(["--model", "/m", "--dataset", "images", "--engine", "transformers", "--modes", "hf,stage"])
    assert inference.check_args(p, ok) == {}


def test_the_transformers_stage_batches_as_the_plain_script_does(tmp_path):
    """--engine transformers: the stage's engine.batch_size is the hf script's --hf-batch, its images' settings the
    same as vLLM's stage; the summary pairs the stage with hf."""
    a = inference.build_parser().parse_args(["--model", str(SHAPE), "--dataset", "images", "--engine", "transformers",
                                             "--hf-batch", "8", "--image-dir", str(tmp_path)])
    cfg = inference.stage_config(a)
    assert (cfg.engine.kind, cfg.engine.batch_size, cfg.engine.limit_mm_per_prompt) == ("transformers", 8, {"image": 1})
    run = {"wall_s": 10.0, "outputs_s": 9.0, "generate_s": 5.0, "generated_tok_s": 100.0, "generated_tokens": 500,
           "delivered_tokens": 500}
    summary = inference.summarize({"hf": [run], "stage": [{**run, "wall_s": 12.5, "outputs_s": 10.0}]})
    assert summary["stage_over_hf"]["whole_process"] == 0.8 and summary["stage_over_hf"]["to_outputs_on_disk"] == 0.9


def test_the_qwen2_5_vl_7b_shape_loads_as_transformers_reads_it():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(SHAPE)
    assert type(cfg).__name__ == "Qwen2_5_VLConfig" and cfg.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size,
            t.vocab_size) == (3584, 28, 28, 4, 18944, 152064)
    rope = getattr(t, "rope_parameters", None) or t.rope_scaling
    assert rope["mrope_section"] == [16, 24, 24]
    assert (v.depth, v.hidden_size, v.out_hidden_size, v.patch_size, v.spatial_merge_size, v.window_size,
            v.fullatt_block_indexes, v.temporal_patch_size, v.tokens_per_second) == (
        32, 1280, 3584, 14, 2, 112, [7, 15, 23, 31], 2, 2)
    ids = (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
    assert ids == (151655, 151656, 151652, 151653)
    # the tokenizer the --vl option builds has those tokens at those ids (it checks them when it builds)
    assert qwen_tokenizer.VL_TOKENS == {"<|vision_start|>": 151652, "<|vision_end|>": 151653,
                                        "<|image_pad|>": 151655, "<|video_pad|>": 151656}


def test_the_shape_s_image_processor_makes_a_448_pixel_image_256_tokens():
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(SHAPE)
    png = io.BytesIO(inference.product_image(0, 448))
    out = processor(images=[Image.open(png).convert("RGB")])
    [[frames, h, w]] = [list(map(int, x)) for x in out["image_grid_thw"]]
    assert (frames, h, w) == (1, 32, 32)  # 14-pixel patches
    assert frames * h * w // processor.merge_size ** 2 == 256  # merged 2x2 into the language model's tokens


def test_the_vl_chat_template_puts_one_image_placeholder_per_image_part():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        qwen_tokenizer.VL_TEMPLATE)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    raw = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///x.png"}},
                                        {"type": "text", "text": "Describe it."}]}]
    stage = [{"role": "user", "content": [{"type": "image", "sha256": "ab"}, {"type": "text", "text": "Describe it."}]}]
    want = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + image
            + "Describe it.<|im_end|>\n<|im_start|>assistant\n")
    assert template.render(messages=raw, add_generation_prompt=True) == want
    assert template.render(messages=stage, add_generation_prompt=True) == want
    two = [{"role": "user", "content": [*stage[0]["content"][:1], *stage[0]["content"]]}]
    assert template.render(messages=two, add_generation_prompt=False).count(image) == 2
