"""Images in rows without an engine: chat image parts in JSONL and OpenAI Batch lines, image columns of
CSV and Parquet tables, the planner's cheap checks (each bad image the row's error with its reason, the rest of the
file going on), the content hash in the prompt's key instead of the URL, object storage through fsspec, the
shard-time load (hash compared, decoded with PIL) and its errors, images decoded only as the engine pulls them, the
config keys and their refusals, and the review's requests for rows with images. The engine-backed path is in
tests/system/test_vision_language.py."""
from __future__ import annotations

import base64
import io
import json
import os
import threading
import time
from pathlib import Path

import pytest
from batch_llm.config import ConfigError, ReviewConfig, parse_config
from batch_llm.io import images as im
from batch_llm.io.storage import Location, iter_jsonl, write_jsonl
from batch_llm.stages.plan import write_plan
from pydantic import ValidationError


def _png(colour="red", size=(32, 24)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _jpeg(colour="blue") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 24), colour).save(buf, format="JPEG")
    return buf.getvalue()


def _url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _row(rid: str, *parts: dict, text: str = "What is in the picture?") -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def _cfg(tmp: Path, path: Path, **extra) -> object:
    data = {"name": "vl", "model": {"ref": "/models/vl"}, "input": {"path": str(path)},
            "output": {"path": str(tmp / "out")}, "engine": {"kind": "vllm"}}
    for key, value in extra.items():
        section, _, name = key.partition("__")
        data.setdefault(section, {})[name] = value
    return parse_config(data, "vl.yaml")


def _plan(cfg, path: Path, tmp: Path) -> tuple[object, dict[str, dict], dict[str, str]]:
    plan_dir = Location(str(tmp / "plan"))
    m = write_plan(cfg, input_loc=Location(str(path)), plan_dir=plan_dir)
    good = {r["id"]: r for s in m.shards for r in iter_jsonl(Location(s.url).path())}
    bad = {e["id"]: e["reason"] for e in iter_jsonl(Location(m.errors).path())}
    return m, good, bad


@pytest.fixture
def corpus(tmp_path) -> Path:
    """The bad-image corpus of the system test, and a few more, with good images beside them."""
    d = tmp_path / "in" / "imgs"
    d.mkdir(parents=True)
    (d / "red.png").write_bytes(_png("red"))
    (d / "blue.jpg").write_bytes(_jpeg("blue"))
    (d / "red-copy.png").write_bytes(_png("red"))               # the same bytes under another name
    (d / "truncated.png").write_bytes(_png("green")[:-40])
    (d / "jpeg-named.png").write_bytes(_jpeg("green"))         # wrong extension
    (d / "notes.jpg").write_bytes(b"hello, not a picture\n")   # text named like an image
    (d / "empty.png").write_bytes(b"")
    (d / "drawing.svg").write_bytes(b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>')
    with open(d / "huge.png", "wb") as f:                      # 50 MB (sparse): refused by its size alone
        f.truncate(50 * 2**20)
    return d


@pytest.mark.parametrize("workers", [1, 4])
def test_the_planner_checks_every_image_and_reports_each_bad_row(tmp_path, corpus, workers):
    data = "data:image/png;base64," + base64.b64encode(_png("red")).decode()
    rows = [_row("good-png", _url_part("imgs/red.png")), _row("good-jpeg", _url_part(str(corpus / "blue.jpg"))),
            _row("good-data", _url_part(data)), _row("good-copy", _url_part("file://" + str(corpus / "red-copy.png"))),
            {"id": "good-text", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                           {"type": "text", "text": "there"}]}]},
            _row("bad-truncated", _url_part("imgs/truncated.png")), _row("bad-ext", _url_part("imgs/jpeg-named.png")),
            _row("bad-text", _url_part("imgs/notes.jpg")), _row("bad-empty", _url_part("imgs/empty.png")),
            _row("bad-svg", _url_part("imgs/drawing.svg")), _row("bad-huge", _url_part("imgs/huge.png")),
            _row("bad-missing", _url_part("imgs/gone.png")), _row("bad-outside", _url_part("/etc/hostname")),
            _row("bad-escape", _url_part("../../../etc/hostname")), _row("bad-http", _url_part("https://x.org/a.png")),
            _row("bad-data", _url_part("data:text/plain;base64,aGk=")), _row("bad-b64", _url_part("data:image/png;base64,@@")),
            _row("bad-two", _url_part("imgs/red.png"), _url_part("imgs/blue.jpg")),
            {"id": "bad-part", "messages": [{"role": "user", "content": [{"type": "input_audio", "x": 1}]}]},
            {"id": "bad-url", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}]
    src = corpus.parent / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m, good, bad = _plan(_cfg(tmp_path, src, engine__limit_mm_per_prompt={"image": 1}, input__image_workers=workers),
                         src, tmp_path)
    assert set(good) == {"good-png", "good-jpeg", "good-data", "good-copy", "good-text"}
    assert m.rows_read == len(rows) and m.valid == 5 and m.invalid == len(rows) - 5
    expected = {
        "bad-truncated": "image 1 (imgs/truncated.png): a truncated PNG: it does not end with the IEND chunk",
        "bad-ext": "wrong extension: its name says PNG (.png) but its bytes are a JPEG image",
        "bad-text": "not an image: its bytes are text ('hello, not a picture",
        "bad-empty": "image 1 (imgs/empty.png): empty (0 bytes)",
        "bad-svg": "an SVG drawing (vector graphics)",
        "bad-huge": "image 1 (imgs/huge.png): 50.0 MiB, over input.max_image_bytes (20.0 MiB)",
        "bad-missing": f"no such file {corpus / 'gone.png'}",
        "bad-outside": "/etc/hostname is outside the folders images may be read from",
        "bad-escape": "is outside the folders images may be read from",
        "bad-http": "https:// is refused: a row's images come from data: URLs, or local paths under the input's folder",
        "bad-data": "a data: URL of type 'text/plain', not an image",
        "bad-b64": "its base64 does not decode",
        "bad-two": "the row has 2 images; engine.limit_mm_per_prompt allows 1 per prompt",
        "bad-part": "content part 'input_audio' is not read (text and image_url parts are)",
        "bad-url": "an image_url part needs image_url.url"}
    for rid, reason in expected.items():
        assert reason in bad[rid], (rid, bad[rid])
    # the shard row: each image part by content hash, the references beside the messages (absolute, checked)
    png = good["good-png"]
    assert png["messages"][0]["content"][0] == {"type": "image", "sha256": im.hashlib.sha256(_png("red")).hexdigest()}
    assert png["images"] == [{"url": str(corpus / "red.png"), "sha256": png["messages"][0]["content"][0]["sha256"],
                              "format": "png", "bytes": len(_png("red")), "pixels": 32 * 24}]
    assert "imgs/red.png" not in json.dumps(png["messages"])
    assert good["good-text"]["messages"][0]["content"] == "Hi\nthere" and "images" not in good["good-text"]
    assert good["good-jpeg"]["images"][0]["format"] == "jpeg"


def test_the_planner_writes_the_same_plan_with_its_image_checks_on_threads(tmp_path, corpus, monkeypatch):
    """200 rows cycling through good and bad images in object storage (fsspec's memory://, the input's store) and local
    ones, text rows, in two files: the plan whose object-storage checks ran on 4 threads is the plan checked one
    image at a time, byte for byte (shards, records, errors, the images read), in the input's order."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for name in ("red.png", "blue.jpg", "truncated.png", "notes.jpg", "empty.png"):
        fs.pipe(f"/bucket48p/{name}", (corpus / name).read_bytes())
    refs = [f"memory://bucket48p/{n}" for n in ("red.png", "blue.jpg", "truncated.png", "notes.jpg", "gone.png",
                                                 "empty.png")] + [str(corpus / "red-copy.png"), "jpeg-named.png"]
    fs.pipe("/bucket48p/in/jpeg-named.png", (corpus / "jpeg-named.png").read_bytes())  # relative to the input there
    for f in range(2):
        lines = []
        for i in range(100):
            k = f * 100 + i
            if i % 9 == 4:
                lines.append({"id": f"t{k}", "prompt": f"text row {k}"})
            else:
                lines.append(_row(f"r{k}", _url_part(refs[k % len(refs)])))
        fs.pipe(f"/bucket48p/in/part-{f}.jsonl", "".join(json.dumps(r) + "\n" for r in lines).encode())
    threads: set[str] = set()
    real = im.ImageChecker._check

    def noting(self, url):
        threads.add(threading.current_thread().name.split("_")[0])
        return real(self, url)

    monkeypatch.setattr(im.ImageChecker, "_check", noting)
    plans = {}
    for workers in (1, 4):
        threads.clear()
        cfg = _cfg(tmp_path, "memory://bucket48p/in", input__image_workers=workers, input__format="jsonl",
                   input__image_roots=[str(corpus)])
        plan_dir = tmp_path / f"plan{workers}"
        m = write_plan(cfg, input_loc=Location("memory://bucket48p/in"), plan_dir=Location(str(plan_dir)))
        plans[workers] = (m.rows_read, m.valid, m.invalid,
                          {p.name: p.read_bytes() for p in sorted(plan_dir.rglob("*.jsonl"))})
        assert ("image-load" in threads) == (workers > 1), threads
    assert plans[1][:3] == (200, plans[1][1], 200 - plans[1][1]) and 0 < plans[1][1] < 200
    assert plans[4] == plans[1]
    errors = [json.loads(x) for x in plans[4][3]["errors.jsonl"].splitlines()]
    assert [e["id"] for e in errors] == sorted((e["id"] for e in errors), key=lambda i: int(i[1:]))
    assert any("truncated PNG" in e["reason"] for e in errors) and any("no such object" in e["reason"] for e in errors)


def test_the_prompt_key_holds_the_images_content_not_their_url(tmp_path, corpus):
    from batch_llm.cache.results import prompt_key
    from batch_llm.stages.infer.request_builder import prompt_basis, row_params

    (corpus / "other.png").write_bytes(_png("blue"))
    rows = [_row("a", _url_part("imgs/red.png")), _row("b", _url_part("imgs/red-copy.png")),
            _row("c", _url_part("data:image/png;base64," + base64.b64encode(_png("red")).decode())),
            _row("d", _url_part("imgs/other.png"))]
    src = corpus.parent / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, good, _ = _plan(_cfg(tmp_path, src), src, tmp_path)
    keys = {rid: prompt_key(prompt_basis(r), row_params(r)) for rid, r in good.items()}
    assert keys["a"] == keys["b"] == keys["c"] != keys["d"]  # the same bytes anywhere: one key; other bytes: another


def test_openai_batch_lines_take_image_parts(tmp_path, corpus):
    line = {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": [_url_part("imgs/red.png"), {"type": "text", "text": "Caption?"}]}]}}
    bad = {**line, "custom_id": "q2", "body": {**line["body"], "messages": [
        {"role": "user", "content": [_url_part("imgs/truncated.png"), {"type": "text", "text": "Caption?"}]}]}}
    src = corpus.parent / "batch.jsonl"
    src.write_text(json.dumps(line) + "\n" + json.dumps(bad) + "\n")
    m, good, errors = _plan(_cfg(tmp_path, src), src, tmp_path)
    assert m.format == "openai_batch" and set(good) == {"q1"} and good["q1"]["images"][0]["format"] == "png"
    assert "truncated PNG" in errors["q2"]


def test_image_columns_of_a_csv_and_of_parquet(tmp_path, corpus):
    import pyarrow as pa
    import pyarrow.parquet as pq

    csv = corpus.parent / "rows.csv"
    csv.write_text('id,prompt,photo\nc1,Describe it,imgs/red.png\nc2,Both?,"[""imgs/red.png"", ""imgs/blue.jpg""]"\n'
                   "c3,No picture,\nc4,Broken,imgs/empty.png\n")
    m, good, bad = _plan(_cfg(tmp_path, csv, input__image_columns=["photo"]), csv, tmp_path)
    assert set(good) == {"c1", "c2", "c3"} and len(good["c2"]["images"]) == 2 and "images" not in good["c3"]
    assert good["c1"]["messages"][0]["content"][1] == {"type": "text", "text": "Describe it"}  # the image goes first
    assert "empty (0 bytes)" in bad["c4"]

    table = pa.table({"id": ["p1", "p2", "p3", "p4"], "prompt": ["a", "b", "c", "d"],
                      "img": [_png("red"), _png("red")[:-30], None, _jpeg()],
                      "hf": [{"bytes": _jpeg(), "path": "x.jpg"}, None, None, {"bytes": _jpeg(), "path": "x.png"}]})
    pq.write_table(table, tmp_path / "rows.parquet")
    m, good, bad = _plan(_cfg(tmp_path, tmp_path / "rows.parquet", input__image_columns=["img", "hf"]),
                         tmp_path / "rows.parquet", tmp_path / "p")
    assert set(good) == {"p1", "p3"} and [i["format"] for i in good["p1"]["images"]] == ["png", "jpeg"]
    assert good["p1"]["images"][0]["url"].startswith("data:image/png;base64,")
    assert "truncated PNG" in bad["p2"] and "wrong extension: its name says PNG (.png)" in bad["p4"]
    # a table without the named column is refused once, naming it
    from batch_llm.io.formats import InputFileError

    with pytest.raises(InputFileError, match=r"lacks the image column\(s\) 'picture' \(input.image_columns\)"):
        _plan(_cfg(tmp_path, csv, input__image_columns=["picture"]), csv, tmp_path / "q")


def test_object_storage_images_are_read_through_fsspec():
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/bucket48/red.png", _png("red"))
    fs.pipe("/bucket48/cut.png", _png("red")[:-20])
    checker = im.ImageChecker(stores=("memory",))
    ref = checker.check("memory://bucket48/red.png", "image 1")
    assert (ref.url, ref.format, ref.bytes) == ("memory://bucket48/red.png", "png", len(_png("red")))
    with pytest.raises(im.ImageProblem, match=r"image 1: no such object memory://bucket48/gone.png"):
        checker.check("memory://bucket48/gone.png", "image 1")
    with pytest.raises(im.ImageProblem, match="truncated PNG"):
        checker.check("memory://bucket48/cut.png", "image 2")
    # relative to an input in object storage, and under its folder
    fs.pipe("/bucket48/in/sub/red.png", _png("red"))
    assert im.ImageChecker(base="memory://bucket48/in", stores=("memory",)).check(
        "sub/./x/../red.png", "image 1").url == "memory://bucket48/in/sub/red.png"
    with pytest.raises(im.ImageProblem, match=r"\.\./red.png climbs out of the input's folder memory://bucket48/in"):
        im.ImageChecker(base="memory://bucket48/in", stores=("memory",)).check("../red.png", "image 1")
    rel = im.ImageChecker(base="memory://bucket48", stores=("memory",)).check("red.png", "image 1")
    assert rel.url == "memory://bucket48/red.png" and rel.sha256 == ref.sha256
    assert im.load_image(ref, {}, 2**20, stores=("memory",)).size == (32, 24)


def test_the_shard_load_compares_the_hash_and_decodes_in_full(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(_png("red"))
    ref = im.ImageChecker(roots=[str(tmp_path)]).check(str(path), "image 1")
    img = im.load_image(ref.to_json(), {}, 2**20)
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (255, 0, 0)
    path.write_bytes(_png("blue"))
    with pytest.raises(im.ImageProblem, match="changed since the plan"):
        im.load_image(ref, {}, 2**20)
    path.unlink()
    with pytest.raises(im.ImageProblem, match="gone since the plan"):
        im.load_image(ref, {}, 2**20)
    # a header and an IEND chunk the planner accepts, pixel data that does not decode: the shard says so
    good = _png("red", (64, 64))
    start = good.index(b"IDAT") + 8
    broken = good[:start] + bytes(len(good) - start - 12) + good[-12:]
    path.write_bytes(broken)
    ref = im.ImageChecker(roots=[str(tmp_path)]).check(str(path), "image 1")
    with pytest.raises(im.ImageProblem, match=r"does not decode \(PNG\)"):
        im.load_image(ref, {}, 2**20)


def test_an_engine_without_images_refuses_them_naming_the_engines_that_take_them(tmp_path, corpus):
    src = corpus.parent / "rows.jsonl"
    src.write_text(json.dumps(_row("r1", _url_part("imgs/red.png"))) + "\n" +
                   json.dumps({"id": "r2", "prompt": "text only"}) + "\n")
    _, good, bad = _plan(_cfg(tmp_path, src, engine__kind="sglang"), src, tmp_path)
    assert set(good) == {"r2"}
    assert bad["r1"] == ("the row has 1 image(s): engine sglang takes no images (vllm and transformers can); "
                         "set engine.kind: vllm or transformers")
    with pytest.raises(ConfigError, match=r"input.image_columns: engine lmdeploy takes no images \(vllm and transformers can\)"):
        _cfg(tmp_path, src, engine__kind="lmdeploy", input__image_columns=["photo"])


def test_the_image_keys_are_checked_and_refused_with_a_reason(tmp_path):
    src = tmp_path / "x.jsonl"
    cases = [({"engine__limit_mm_per_prompt": {"video": 1}}, "video: only images are read from rows"),
             ({"engine__limit_mm_per_prompt": {"image": -1}}, "a limit is 0 or more"),
             ({"engine__kind": "lmdeploy", "engine__mm_processor_kwargs": {"max_pixels": 10}},
              r"engine.mm_processor_kwargs: .*engine.kind is 'lmdeploy' \(vllm and transformers can\)"),
             ({"engine__kind": "sglang", "engine__limit_mm_per_prompt": {"image": 2}},
              r"engine.limit_mm_per_prompt: .*'sglang' \(vllm and transformers can\)"),
             ({"input__image_columns": ["a", "a"]}, "name each image column once"),
             ({"input__max_image_bytes": 0}, "greater than 0"),
             ({"engine__task": "embed", "input__image_columns": ["a"]}, "engine.task embed is not tested with images")]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            _cfg(tmp_path, src, **extra)
    cfg = _cfg(tmp_path, src, engine__mm_processor_kwargs={"max_pixels": 1024}, input__image_roots=["./pics"])
    assert cfg.engine.mm_processor_kwargs == {"max_pixels": 1024}
    # in a YAML file, image_roots resolve against its folder, as the other paths do
    from batch_llm.config import load_config

    (tmp_path / "p.yaml").write_text(f"name: p\nmodel: {{ref: a/b}}\ninput: {{path: {src}, image_roots: [./pics]}}\n"
                                     f"output: {{path: {tmp_path}}}\n")
    assert load_config(tmp_path / "p.yaml").input.image_roots == [str(tmp_path / "pics")]


def test_the_processor_settings_a_model_has_are_the_ones_honoured(tmp_path):
    from batch_llm.engines.vllm_engine import tokens_prompt
    from batch_llm.host.probes import processor_kwargs_refusal

    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"size": {"height": 28, "width": 28}, "do_normalize": True,
                             "image_processor_type": "BlipImageProcessor"}, "processor_class": "Blip2Processor"}))
    assert processor_kwargs_refusal(str(tmp_path), {}) is None
    assert processor_kwargs_refusal(str(tmp_path), {"size": {"height": 28, "width": 28}}) is None
    why = processor_kwargs_refusal(str(tmp_path), {"max_pixels": 100})
    assert why.startswith("engine.mm_processor_kwargs.max_pixels: the model's image processor has no such setting "
                          "(it has: do_normalize, size)")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    assert processor_kwargs_refusal(str(tmp_path), {"max_pixels": 100}) is None
    assert "has no image processor settings" in processor_kwargs_refusal(str(tmp_path / "none"), {"size": 1})
    # vLLM's prompt: token ids, and the decoded images as multi_modal_data (one image: the image itself)
    from batch_llm.engines.base import GenRequest

    assert tokens_prompt(dict, GenRequest("k", [1, 2])) == {"prompt_token_ids": [1, 2]}
    assert tokens_prompt(dict, GenRequest("k", [1], images=["A"])) == {"prompt_token_ids": [1],
                                                                      "multi_modal_data": {"image": "A"}}
    assert tokens_prompt(dict, GenRequest("k", [1], images=["A", "B"]))["multi_modal_data"] == {"image": ["A", "B"]}


# ------------------------------------------------------------------------------------------ the shard
IMAGES_TOY = "toy_images"  # an engine kind that takes images, registered by the toy_images fixture


@pytest.fixture
def vl_model(tmp_path, demo_model_dir) -> Path:
    """A model folder a shard can render chats with (the demo model's tokenizer, a template that reads image parts)
    whose config names a vision part; the toy engine never loads weights."""
    import shutil

    d = tmp_path / "vl-model"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(demo_model_dir) / name, d / name)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
        "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    (d / "config.json").write_text(json.dumps({"architectures": ["ToyVL"], "vision_config": {"hidden_size": 8}}))
    return d


def _rss_mb() -> float:
    """This process's resident memory now (not its high-water mark, which earlier tests may have set)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _ToyImages:
    """An engine that takes images, one request at a time (what it holds is all that is decoded), noting for each
    request its images' sizes, how many images were decoded so far and the memory now."""

    seen: list[dict] = []
    decoded = {"n": 0}

    def __init__(self, *a, **k):
        pass

    def start(self):
        from batch_llm.engines.base import EngineInfo

        return EngineInfo(kind=IMAGES_TOY, version="0")

    def generate(self, requests):
        from batch_llm.engines.base import GenResult

        for r in requests:
            self.seen.append({"images": [img.size for img in r.images or []], "decoded_so_far": self.decoded["n"],
                              "rss_mb": _rss_mb(),
                              "red": r.images[0].getpixel((0, 0))[0] if r.images else None})
            yield GenResult(key=r.key, text=f"{len(r.images or [])} images", finish_reason="stop",
                            prompt_tokens=len(r.prompt_token_ids), completion_tokens=1)

    def close(self):
        pass


@pytest.fixture
def toy_images(monkeypatch):
    from batch_llm.config.capabilities import EngineCapabilities, register_capabilities, unregister_capabilities
    from batch_llm.engines import registry
    from batch_llm.engines.base import Engine

    register_capabilities(EngineCapabilities(IMAGES_TOY, __name__, title="toy", images=True))
    engine = type("ToyImagesEngine", (_ToyImages, Engine), {"kind": IMAGES_TOY})
    registry.register_engine(engine)
    real = im.decode_image
    lock = threading.Lock()

    def counting(data, ref, *args):  # input.image_workers threads decode
        with lock:
            _ToyImages.decoded["n"] += 1
        return real(data, ref, *args)

    monkeypatch.setattr(im, "decode_image", counting)
    _ToyImages.seen, _ToyImages.decoded = [], {"n": 0}
    yield _ToyImages
    registry.unregister_engine(IMAGES_TOY)
    unregister_capabilities(IMAGES_TOY)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_shard_decodes_images_as_the_engine_pulls_them(tmp_path, vl_model, toy_images, workers):
    """A shard of 16 rows whose images decode to ~280 MB in all (2400 x 2400 RGB each) through an engine that takes
    images: each image is decoded when its request goes to the engine, or at most 2 x input.image_workers requests
    ahead of it on that many threads, the memory while it generates stays a fraction of the total above where it
    started, a row whose image changed after the plan is the row's error with the reason, and the engine gets PIL
    images in the rows' order."""
    from batch_llm.manifests import ShardSpec
    from batch_llm.stages.infer.request_builder import load_tokenizer
    from batch_llm.stages.infer.runner import run_shard

    imgs = tmp_path / "in"
    imgs.mkdir()
    rows = []
    for i in range(16):
        (imgs / f"big{i}.png").write_bytes(_png((i * 10, 0, 0), (2400, 2400)))  # a few KB each, 17 MB decoded
        rows.append(_row(f"r{i:02d}", _url_part(f"big{i}.png")))
    src = imgs / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # prefix groups off: rows of 16 images would be 16 groups in hash order; the rows' order is checked below
    cfg = _cfg(tmp_path, src, engine__commit_every_rows=4, cache__enabled=False, input__image_workers=workers,
               sharding__group_prefixes=False)
    plan = write_plan(cfg, input_loc=Location(str(src)), plan_dir=Location(str(tmp_path / "plan")))
    (imgs / "big5.png").write_bytes(_png("blue", (2400, 2400)))  # changed after the plan
    cfg = cfg.with_overrides({"engine.kind": IMAGES_TOY})
    load_tokenizer(str(vl_model), None)  # the imports before the baseline: what is measured is the shard's
    before = _rss_mb()
    m = run_shard(cfg, shard=ShardSpec(index=0, rows=plan.shards[0].rows, url=plan.shards[0].url),
                  shard_dir=Location(str(tmp_path / "shard")), model_dir=str(vl_model), model_key="toy",
                  say=lambda s: None)
    rows_out = {r["id"]: r for r in iter_jsonl(Location(m.outputs).path())}
    errors = {r["id"]: r["error"] for r in iter_jsonl(Location(m.errors).path())}
    assert set(rows_out) == {f"r{i:02d}" for i in range(16)} - {"r05"}
    assert "changed since the plan" in errors["r05"]
    assert all(r["output"] == "1 images" for r in rows_out.values())
    seen = toy_images.seen
    assert len(seen) == 15 and all(s["images"] == [(2400, 2400)] for s in seen)
    assert [s["red"] for s in seen] == [i * 10 for i in range(16) if i != 5]  # the rows' order: r00, r01, ...
    decoded = [s["decoded_so_far"] for s in seen]
    growth = max(s["rss_mb"] for s in seen) - before
    if workers == 1:  # when the engine took its k-th request, k + 1 images had been decoded: its own and those before
        assert decoded == list(range(1, 16)), seen
        assert growth < 120, growth  # 16 x 17 MB = 276 MB decoded in all
    else:  # its own, those before it, at most 2 x 2 ahead (the changed image fails its hash check, undecoded)
        assert all(k + 1 <= d <= k + 2 + 2 * workers for k, d in enumerate(decoded)), decoded
        assert decoded[-1] == 15 and max(d - k - 1 for k, d in enumerate(decoded)) > 0, decoded  # some ahead
        assert growth < 200, growth



def _vm_data_bytes() -> int:
    """What RLIMIT_DATA is checked against: the process's private writable memory (VmData), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


def _shard_under_a_memory_limit(args: dict, conn) -> None:
    """In a spawned child: the toy engine registered, the imports done, RLIMIT_DATA set to the memory the process
    holds now plus ``headroom`` bytes; then the shard, then (the control) every image of the shard decoded and held
    at once under the same limit. Sends what each did."""
    import resource

    from batch_llm.config.capabilities import EngineCapabilities, register_capabilities
    from batch_llm.engines import registry
    from batch_llm.engines.base import Engine
    from batch_llm.manifests import ShardSpec
    from batch_llm.stages.infer.request_builder import load_tokenizer
    from batch_llm.stages.infer.runner import run_shard
    from PIL import Image

    register_capabilities(EngineCapabilities(IMAGES_TOY, __name__, title="toy", images=True))
    registry.register_engine(type("ToyImagesEngine", (_ToyImages, Engine), {"kind": IMAGES_TOY}))
    cfg = parse_config(args["cfg"], "vl.yaml")
    load_tokenizer(args["model"], None)
    Image.open(args["images"][0]).convert("RGB")  # PIL's decoders loaded before the limit
    limit = _vm_data_bytes() + args["headroom"]
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    report: dict = {}
    try:
        m = run_shard(cfg, shard=ShardSpec(index=0, rows=args["rows"], url=args["url"]),
                      shard_dir=Location(args["shard_dir"]), model_dir=args["model"], model_key="toy",
                      say=lambda s: None)
        report["shard"] = {"outputs": m.outputs, "errors": m.errors, "requests": len(_ToyImages.seen)}
    except BaseException as e:  # whatever ended the shard goes back to the test, named
        report["shard"] = f"{type(e).__name__}: {e}"
    held = []
    try:
        for path in args["images"]:
            held.append(Image.open(path).convert("RGB"))
        report["control"] = f"held all {len(held)}"
    except MemoryError:
        report["control"] = f"MemoryError after {len(held)} of {len(args['images'])}"
    held.clear()
    conn.send(report)


def test_a_shard_whose_images_exceed_the_memory_limit_runs_under_it(tmp_path, vl_model):
    """A worker's memory limit, for real: a spawned child runs a shard of 96 rows, one 1200 x 1200 image each (~550 MB
    decoded in all) through an engine that takes images, with RLIMIT_DATA set to the memory it held before the shard
    plus 200 MB, at input.image_workers' default (4 threads loading ahead). Every row is generated, none an error;
    the control, decoding and holding the same images at once under the same limit, runs out of memory (the limit
    bites, the images total more than it)."""
    import multiprocessing

    imgs = tmp_path / "in"
    imgs.mkdir()
    rows, paths = [], []
    for i in range(96):
        paths.append(str(imgs / f"img{i}.png"))
        Path(paths[-1]).write_bytes(_png((i, 100, 0), (1200, 1200)))  # 5.8 MB decoded (PIL keeps RGB as 4 bytes)
        rows.append(_row(f"r{i:02d}", _url_part(f"img{i}.png")))
    src = imgs / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"name": "vl", "model": {"ref": "/models/vl"}, "input": {"path": str(src)},
            "output": {"path": str(tmp_path / "out")}, "engine": {"kind": "vllm", "commit_every_rows": 16},
            "cache": {"enabled": False}}
    plan = write_plan(parse_config(data, "vl.yaml"), input_loc=Location(str(src)),
                      plan_dir=Location(str(tmp_path / "plan")))
    assert len(plan.shards) == 1 and plan.shards[0].rows == 96
    data["engine"]["kind"] = IMAGES_TOY
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_shard_under_a_memory_limit, args=(
        {"cfg": data, "model": str(vl_model), "rows": 96, "url": plan.shards[0].url, "images": paths,
         "shard_dir": str(tmp_path / "shard"), "headroom": 200 * 2**20}, theirs))
    child.start()
    deadline = time.monotonic() + 240
    while not ours.poll(1):
        assert child.is_alive(), f"the child ended with exit code {child.exitcode} and sent nothing"
        assert time.monotonic() < deadline, "the child sent nothing in 240 s"
    report = ours.recv()
    child.join(30)
    assert isinstance(report["shard"], dict), report
    assert report["shard"]["requests"] == 96, report
    out = [r["id"] for r in iter_jsonl(Location(report["shard"]["outputs"]).path())]
    assert sorted(out) == [f"r{i:02d}" for i in range(96)]
    assert not list(iter_jsonl(Location(report["shard"]["errors"]).path()))
    assert report["control"].startswith("MemoryError"), report


# ------------------------------------------------------------------------------------------ the review
def test_review_image_settings_are_checked():
    guard = {"ref": "/models/vl"}
    r = ReviewConfig(model=guard, images="agreement", actions={"image_mismatch": "drop"})
    assert r.verdict_categories[-1] == "image_mismatch"
    assert ReviewConfig(model=guard).verdict_categories == ReviewConfig(model=guard).categories  # text: as before
    bad = [({"image_template": "{output}"}, "image_template: a setting of images: agreement"),
           ({"images": "agreement", "image_template": "Does it agree?"}, r"image_template: it never shows the output"),
           ({"actions": {"image_mismatch": "drop"}}, "actions.image_mismatch: not a category"),
           ({"images": "content", "engine": {"task": "classify"}, "labels": {"a": "safe"}},
            "images: content: a classifier reads the output as text")]
    for settings, message in bad:
        with pytest.raises(ValidationError, match=message):
            ReviewConfig(model=guard, **settings)


@pytest.mark.parametrize("mode", ["agreement", "content", "text"])
def test_review_requests_of_rows_with_images(tmp_path, mode):
    from batch_llm.layout import RunLayout
    from batch_llm.manifests import PlanManifest, ShardMetrics, ShardResult, ShardSpec
    from batch_llm.stages import review as rv

    cfg = parse_config({"name": "p", "model": {"ref": "/models/vl"}, "input": {"path": str(tmp_path / "in.jsonl")},
                        "output": {"path": str(tmp_path / "out")},
                        "filter": {"lists": [], "review": {"model": {"ref": "/models/vl"}, "images": mode}}})
    layout = RunLayout.for_run(cfg, run_id="r1", ds="2026-12-05")
    ref = {"url": "/data/cat.png", "sha256": "ab" * 32, "format": "png", "bytes": 10}
    rows = [{"id": "r0", "idx": 0, "messages": [{"role": "user", "content": [
        {"type": "image", "sha256": ref["sha256"]}, {"type": "text", "text": "What animal?"}]}], "images": [ref]},
            {"id": "r1", "idx": 1, "messages": [{"role": "user", "content": "Say hi"}]}]
    shard_file = layout.stage("plan").child("shard-00000.jsonl")
    write_jsonl(shard_file.path(), rows)
    plan = PlanManifest(input="x", format="jsonl", rows_read=2, valid=2, invalid=0, errors="e", records="r",
                        shards=[ShardSpec(index=0, rows=2, url=shard_file.url)], has_references=False)
    sdir = layout.stage("infer").child("shard-00000")
    write_jsonl(sdir.child("outputs.jsonl").path(), [
        {"id": "r0", "idx": 0, "output": "a dog", "error": None}, {"id": "r1", "idx": 1, "output": "hi", "error": None}])
    write_jsonl(sdir.child("errors.jsonl").path(), [])
    shard = ShardResult(shard=0, outputs=sdir.child("outputs.jsonl").url, errors=sdir.child("errors.jsonl").url,
                        metrics=ShardMetrics(rows=2, ok=2))
    reqs = {json.loads(q["id"])[0]: q for q in iter_jsonl(Location(rv.prepare_review(cfg, layout, plan, shard).url).path())}
    image_turn, text_turn = reqs["r0"]["messages"][-1]["content"], reqs["r1"]["messages"][-1]["content"]
    assert isinstance(text_turn, str) and "Say hi" in text_turn and "images" not in reqs["r1"]
    if mode == "text":
        assert isinstance(image_turn, str) and "images" not in reqs["r0"] and "harmful or unsafe" in image_turn
        assert "image_mismatch" not in json.dumps(rv.review_pipeline_config(cfg).sampling.output_schema)
        return
    assert image_turn[0] == {"type": "image", "sha256": ref["sha256"]} and reqs["r0"]["images"] == [ref]
    asked = image_turn[1]["text"]
    assert "What animal?" in asked and "a dog" in asked
    if mode == "agreement":
        assert "agree with the image" in asked and '["image_mismatch"]' in asked
        schema = rv.review_pipeline_config(cfg).sampling.output_schema
        assert schema["properties"]["categories"]["items"]["enum"][-1] == "image_mismatch"
    else:
        assert "harmful or unsafe" in asked


def test_a_text_engine_or_a_text_model_refuses_a_shards_image_rows(tmp_path, demo_model_dir, vl_model):
    """What the review pass meets (its rows keep their images; its engine and model are the review's): a row with
    images on an engine or model that takes none is the row's error, naming the fix, before a template renders it."""
    from batch_llm.manifests import ShardSpec
    from batch_llm.stages.infer.runner import ShardRun

    def refusal(kind: str, model: Path) -> str | None:
        cfg = _cfg(tmp_path, tmp_path / "x.jsonl", engine__kind=kind)
        run = ShardRun(cfg, shard=ShardSpec(index=0, rows=0, url=str(tmp_path / "s.jsonl")),
                       shard_dir=Location(str(tmp_path / kind)), model_dir=str(model), model_key="m")
        return run.requests.image_refusal(2)

    assert refusal("sglang", vl_model).startswith(
        "the row has 2 image(s): engine sglang takes no images (vllm and transformers can); set engine.kind: vllm or "
        "transformers (a review: or filter.review.images: text)")
    assert refusal("transformers", vl_model) is None
    assert refusal("vllm", demo_model_dir).startswith(
        f"the row has 2 image(s): the model at {demo_model_dir} takes no images (its config.json names no vision part)")
    assert refusal("vllm", vl_model) is None


def test_a_pre_tokenized_row_with_images_is_refused(tmp_path, corpus):
    src = corpus.parent / "rows.jsonl"
    src.write_text(json.dumps({"id": "t1", "prompt_token_ids": [1, 2], "photo": "imgs/red.png"}) + "\n" +
                   json.dumps({"id": "t2", "prompt_token_ids": [1, 2], "photo": None}) + "\n")
    _, good, bad = _plan(_cfg(tmp_path, src, input__image_columns=["photo"]), src, tmp_path)
    assert set(good) == {"t2"} and bad["t1"] == "a pre-tokenized row (prompt_token_ids) takes no images, and this " \
                                               "one has photo"


# ------------------------------------------------------------------------------------------ loading ahead
def _slow_load(log: list, delay: float = 0.05):
    def load(ref):
        if ref == "bad":
            raise im.ImageProblem("image bad: does not decode")
        if ref == "boom":
            raise RuntimeError("storage client broke")
        log.append(("start", ref))
        time.sleep(delay)
        return f"img:{ref}"
    return load


def test_load_ahead_keeps_the_order_overlaps_the_loads_and_reports_each_item():
    """Items of images, text items and a bad image through 8 threads: each item once, in order, with its images,
    None or its ImageProblem; 16 loads of 0.1 s overlap (serially 1.6 s)."""
    items = [("t0", [])] + [(f"i{k}", [f"p{k}"]) for k in range(16)] + [("bad", ["p99", "bad"]), ("t1", [])]
    log: list = []
    t0 = time.perf_counter()
    got = list(im.load_ahead(iter(items), lambda it: it[1], _slow_load(log, 0.1), workers=8))
    took = time.perf_counter() - t0
    assert [it[0] for it, _ in got] == [it[0] for it in items]
    res = dict((it[0], r) for it, r in got)
    assert res["t0"] is None and res["t1"] is None
    assert all(res[f"i{k}"] == [f"img:p{k}"] for k in range(16))
    assert isinstance(res["bad"], im.ImageProblem) and "does not decode" in str(res["bad"])
    assert took < 1.0, took


def test_load_ahead_stays_within_its_window_and_one_worker_loads_only_what_is_pulled():
    items = [(f"i{k}", [f"p{k}"]) for k in range(40)]
    for workers in (1, 3):
        log: list = []
        gen = im.load_ahead(iter(items), lambda it: it[1], _slow_load(log, 0.01), workers=workers)
        ahead = []
        for n, _ in enumerate(gen, start=1):
            time.sleep(0.02)  # a slow consumer: the loads would run far ahead without a window
            ahead.append(len(log) - n)
        assert len(log) == 40
        assert max(ahead) <= (0 if workers == 1 else 2 * workers), (workers, ahead)


def test_load_ahead_raises_an_unexpected_error_at_its_item_and_stops_when_the_consumer_does():
    items = [("a", ["p1"]), ("b", ["boom"]), ("c", ["p3"])]
    gen = im.load_ahead(iter(items), lambda it: it[1], _slow_load([]), workers=4)
    assert next(gen)[1] == ["img:p1"]
    with pytest.raises(RuntimeError, match="storage client broke"):
        next(gen)
    log: list = []
    many = [(f"i{k}", [f"p{k}"]) for k in range(1000)]
    gen = im.load_ahead(iter(many), lambda it: it[1], _slow_load(log, 0.01), workers=4)
    next(gen)
    gen.close()  # a stopped shard: loads not started are dropped, the rest of the input is never read
    time.sleep(0.1)
    assert len(log) <= 1 + 2 * 4 + 4, len(log)


# ------------------------------------------------------------------------------------------ where, how big, how fresh
def _bomb_png(width: int, height: int) -> bytes:
    """A one-bit PNG of one colour: a few KB on disk, ``width`` x ``height`` pixels decoded (4 bytes each in RGB)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" + b"\xff" * ((width + 7) // 8)
    z = zlib.compressobj(9)
    data = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)) +
            chunk(b"IDAT", data) + chunk(b"IEND", b""))


@pytest.mark.parametrize("workers", [1, 4])
def test_every_reference_is_checked_under_one_rule_and_fails_only_its_row(tmp_path, corpus, monkeypatch, workers):
    """A reference to another store (gs://, s3:// of a run whose storage is local, hf://, memory://), an fsspec wrapper,
    a NUL byte: each refused by name as its row's error, before any filesystem is made for it (none is made here:
    making one fails loudly); an allowed store whose client fails in any way (credentials refused) fails its row
    alone; the good rows are planned, on one thread or several."""
    from batch_llm.io import storage

    real_as_path = storage.as_path
    made: list[str] = []

    def as_path(url, options=None):
        if "://" in url and not url.startswith(("file://", "/")) and path_policy_kind(url) == "storage":
            made.append(url)
            if url.startswith("s3://lake-images/"):
                raise RuntimeError("Unable to locate credentials")
            raise AssertionError(f"a filesystem was made for {url}")
        return real_as_path(url, options)

    def path_policy_kind(url):
        from batch_llm.host import path_policy

        return path_policy.resolve(url).kind

    monkeypatch.setattr(storage, "as_path", as_path)
    rows = [_row("good", _url_part("imgs/red.png")),
            _row("gs", _url_part("gs://bucket/cat.png")), _row("hf", _url_part("hf://datasets/org/set/cat.png")),
            _row("memory", _url_part("memory://bucket/cat.png")), _row("az", _url_part("az://box/cat.png")),
            _row("wrapped", _url_part("simplecache::file://" + str(corpus / "red.png"))),
            _row("nul", _url_part("imgs/red\x00.png")), _row("nul-abs", _url_part(str(corpus / "red.png\x00"))),
            _row("creds", _url_part("s3://lake-images/cat.png")), _row("good-too", _url_part("imgs/blue.jpg"))]
    src = corpus.parent / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m, good, bad = _plan(_cfg(tmp_path, src, input__image_workers=workers, input__conn_id="lake"), src, tmp_path)
    assert set(good) == {"good", "good-too"} and m.invalid == len(rows) - 2
    for rid in ("gs", "hf", "memory", "az"):
        scheme = rid + "://"
        assert f"image 1 ({scheme}" in bad[rid] and f"{scheme} is refused (not this run's storage)" in bad[rid], bad
        assert "through the input's connection" in bad[rid] and "s3://, s3a://" in bad[rid]
    assert "simplecache:: is refused" in bad["wrapped"]
    assert bad["nul"].endswith("the reference holds a NUL byte") and bad["nul-abs"].endswith("holds a NUL byte")
    assert bad["creds"] == "image 1 (s3://lake-images/cat.png): cannot read s3://lake-images/cat.png: RuntimeError: " \
                           "Unable to locate credentials"
    assert made == ["s3://lake-images/cat.png"]  # the one store the run has (its connection's); no other was made
    # without a connection, a local run reads no store at all
    _, good, bad = _plan(_cfg(tmp_path, src), src, tmp_path / "no-conn")
    assert set(good) == {"good", "good-too"} and "s3:// is refused" in bad["creds"]


def test_an_image_of_huge_dimensions_in_a_small_file_fails_its_row_by_its_header(tmp_path, corpus, vl_model,
                                                                                toy_images):
    """A 1-bit PNG of 8000 x 8000 pixels (a few KB on disk, 256 MB decoded in RGB, under PIL's own limit) and one of
    30000 x 30000 (past PIL's): the planner refuses each as its row's error from the header (input.max_image_pixels),
    the rest planned. A shard planned under a higher limit and run under the default refuses it from the header
    before decoding (decoding is not even started), the rows around it generated."""
    bomb, giant = _bomb_png(8000, 8000), _bomb_png(30000, 30000)
    assert len(bomb) < 20_000 and len(giant) < 400_000
    (corpus / "bomb.png").write_bytes(bomb)
    (corpus / "giant.png").write_bytes(giant)
    rows = [_row("a", _url_part("imgs/red.png")), _row("bomb", _url_part("imgs/bomb.png")),
            _row("giant", _url_part("imgs/giant.png")), _row("b", _url_part("imgs/blue.jpg"))]
    src = corpus.parent / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, good, bad = _plan(_cfg(tmp_path, src), src, tmp_path / "p1")
    assert set(good) == {"a", "b"} and good["a"]["images"][0]["pixels"] == 32 * 24
    assert bad["bomb"] == "image 1 (imgs/bomb.png): 8000 x 8000 pixels (244.1 MiB decoded), over " \
                          "input.max_image_pixels (40,000,000)"
    assert bad["giant"].startswith("image 1 (imgs/giant.png): over input.max_image_pixels (40,000,000)")

    from batch_llm.manifests import ShardSpec
    from batch_llm.stages.infer.runner import run_shard
    from PIL import ImageFile

    cfg = _cfg(tmp_path, src, input__max_image_pixels=100_000_000, cache__enabled=False, engine__max_error_rate=1.0)
    plan = write_plan(cfg, input_loc=Location(str(src)), plan_dir=Location(str(tmp_path / "p2")))
    assert plan.valid == 3
    loads: list = []
    real_load = ImageFile.ImageFile.load

    def noting(img):
        loads.append(img.size)
        return real_load(img)

    from unittest import mock

    with mock.patch.object(ImageFile.ImageFile, "load", noting):
        m = run_shard(cfg.with_overrides({"engine.kind": IMAGES_TOY, "input.max_image_pixels": 40_000_000}),
                      shard=ShardSpec(index=0, rows=plan.shards[0].rows, url=plan.shards[0].url),
                      shard_dir=Location(str(tmp_path / "shard")), model_dir=str(vl_model), model_key="toy",
                      say=lambda s: None)
    assert {r["id"] for r in iter_jsonl(Location(m.outputs).path())} == {"a", "b"}
    errors = {r["id"]: r["error"] for r in iter_jsonl(Location(m.errors).path())}
    assert set(errors) == {"bomb"} and "8000 x 8000 pixels (244.1 MiB decoded), over input.max_image_pixels " \
                                      "(40,000,000)" in errors["bomb"]
    assert loads and (8000, 8000) not in loads


def test_load_ahead_holds_at_most_its_budget_of_decoded_bytes():
    """Items whose images report their decoded sizes (a fake decoder: no image is made), loaded on 4 threads under a
    budget of 1,000 with a slow consumer: whenever a load starts, the items loading or loaded and not yet taken cost
    at most the budget (the count window alone, 8 items, would let 4,000 in); an item over the budget alone loads,
    alone; every item comes once, in order, and the loads still overlap."""
    sizes = {f"i{k}": (900 if k % 5 == 0 else 300) for k in range(40)} | {"huge": 2500}
    names = [*list(sizes)[:20], "huge", *list(sizes)[20:40]]
    lock = threading.Lock()
    state: dict = {"held": 0, "most": 0, "huge_with": None, "together": 0}

    def load(ref):
        with lock:
            state["held"] += sizes[ref]
            if ref == "huge":
                state["huge_with"] = state["held"] - sizes[ref]
            else:
                state["most"] = max(state["most"], state["held"])
        time.sleep(0.005)
        return ref

    got = []
    for item, images in im.load_ahead(iter([(n, [n]) for n in names]), lambda it: it[1], load, workers=4,
                                      cost=lambda it: sizes[it[0]], budget=1000):
        with lock:
            state["together"] = max(state["together"], state["held"] // 300)
            state["held"] -= sizes[item[0]]
        got.append(images[0])
        time.sleep(0.01)  # a slow consumer: without the budget the count window would fill
    assert got == names
    assert 900 <= state["most"] <= 1000, state
    assert state["huge_with"] == 0, state
    assert state["together"] >= 2, state  # more than one item ahead where they fit


def test_an_image_replaced_by_a_fifo_fails_its_row_without_blocking(tmp_path):
    """The shard reads an image again through the same rule: a FIFO put in its place since the plan is refused as
    not a regular file, at once (a blocking open would wait for a writer forever); a link put in its place, pointing
    elsewhere, is refused too (the file read is the one the plan checked under its roots)."""
    path = tmp_path / "a.png"
    path.write_bytes(_png("red"))
    ref = im.ImageChecker(roots=[str(tmp_path)]).check(str(path), "image 1")
    path.unlink()
    os.mkfifo(path)
    outcome: dict = {}

    def load():
        try:
            im.load_image(ref, {}, 2**20)
        except im.ImageProblem as e:
            outcome["error"] = str(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # blocked in open(): a writer releases it, and the test fails
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail("the load blocked on the FIFO")
    assert "is not a regular file (a device, FIFO or socket is never read)" in outcome["error"]
    with pytest.raises(im.ImageProblem, match="not a regular file"):  # and the planner, the same
        im.ImageChecker(roots=[str(tmp_path)]).check(str(path), "image 1")
    path.unlink()
    (tmp_path / "elsewhere.png").write_bytes(_png("red"))
    path.symlink_to(tmp_path / "elsewhere.png")
    with pytest.raises(im.ImageProblem, match="is no longer the file the plan checked"):
        im.load_image(ref, {}, 2**20)


def test_clearing_the_plan_plans_again_when_an_image_its_rows_read_changed(tmp_path, corpus):
    """The plan's key holds the stamps of the images its rows read (size, mtime, inode; an object's ETag): unchanged,
    the committed plan is reused; an image replaced after the plan, or one missing then added, makes a new plan
    (its shards a new plan key, so nothing committed for the old one is resumed), in which the row is good."""
    from batch_llm.api import plan_shards
    from batch_llm.layout import RunLayout

    rows = [_row("a", _url_part("imgs/red.png")), _row("late", _url_part("imgs/late.png")),
            {"id": "t", "prompt": "text only"}]
    src = corpus.parent / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(tmp_path, src)
    layout = RunLayout.for_run(cfg, run_id="scheduled__1", ds="2026-12-05")
    first = plan_shards(cfg, layout)
    assert first.valid == 2 and first.images_read and plan_shards(cfg, layout) == first  # unchanged: reused
    # how a shard holds its images decoded is not what the plan holds: the same plan
    assert plan_shards(cfg.with_overrides({"input.max_decoded_bytes_ahead": 2**20}), layout) == first

    (corpus / "late.png").write_bytes(_png("green"))  # the missing image arrives
    second = plan_shards(cfg, layout)
    assert second.valid == 3 and second.input_key != first.input_key
    assert {s.plan_key for s in second.shards} == {second.input_key[:16]} != {first.input_key[:16]}
    assert plan_shards(cfg, layout) == second

    old = next(r for s in second.shards for r in iter_jsonl(Location(s.url).path()) if r["id"] == "a")["images"][0]
    (corpus / "red.png").write_bytes(_png("blue"))  # replaced after the plan: its shard row would fail
    with pytest.raises(im.ImageProblem, match="changed since the plan"):
        im.load_image(old, {}, 2**20)
    third = plan_shards(cfg, layout)
    assert third.input_key not in (first.input_key, second.input_key) and third.valid == 3
    new = next(r for s in third.shards for r in iter_jsonl(Location(s.url).path()) if r["id"] == "a")["images"][0]
    assert new["sha256"] != old["sha256"] and im.load_image(new, {}, 2**20).getpixel((0, 0)) == (0, 0, 255)
