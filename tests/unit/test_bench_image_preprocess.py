"""The image-preprocess probe without an engine: it times PNG decoding per thread count, and the model's image
processor where it loads (here the Qwen2.5-VL-7B shape's; without torchvision transformers refuses it, and the probe
says so in its results rather than failing)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import image_preprocess  # noqa: E402


def test_each_step_and_thread_count_gets_a_timing_or_its_reason(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    shape = ROOT / "bench" / "shapes" / "qwen2.5-vl-7b"
    assert image_preprocess.main(["--processor", str(shape), "--n", "6", "--size", "64", "--threads", "1,2",
                                  "--out", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    decode = [r for r in rows if r["step"] == "decode"]
    assert [r["threads"] for r in decode] == [1, 2] and all(r["ms_per_image"] > 0 for r in decode)
    procs = [r for r in rows if r["step"] == "processor"]
    assert {r["fast"] for r in procs} == {False, True}
    for r in procs:
        assert ("error" in r and r["error"]) or (r["ms_per_image"] > 0 and r["threads"] in (1, 2)), r
    assert all(r["n"] == 6 and r["size"] == 64 for r in rows)
    assert capsys.readouterr().out.count("RESULT ") == len(rows)
