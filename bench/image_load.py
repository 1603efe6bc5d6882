"""The shard's image loading, one image at a time against ``input.image_workers`` threads: the stage's own code
(``io.images.load_ahead`` over ``load_image``: read, SHA-256 compared with the plan's, decoded in full) over N
distinct PNGs checked by the planner's ``ImageChecker``, from a local folder or from SeaweedFS on loopback
(``--s3``, tests/s3_server.py), the worker counts alternating, REPEATS passes each. ``--plan``: the planner's
checks instead (``stages.plan.write_plan`` over a JSONL of N rows naming one image each, beside the images: each image
read whole and hashed, none decoded).

    python -m bench image-load [--n 300] [--size 448] [--workers 1,4] [--repeats 3] [--s3] [--plan] [--out FILE]

What it measures is the loading alone, with a consumer that takes each request at once; how much of it the engine
hides depends on the engine (on a GPU vLLM prepares each image after this, in the same thread).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.inference import product_image
from bench.runners import ROOT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench image-load", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--workers", default="1,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--s3", action="store_true", help="the images in SeaweedFS on loopback")
    p.add_argument("--plan", action="store_true", help="time the planner's image checks, not the shard's load")
    p.add_argument("--out", default=None, help="append the results as JSON lines")
    a = p.parse_args(argv)
    from batch_llm.io.storage import as_path

    tmp = Path(tempfile.mkdtemp(prefix="image_load_"))
    server = None
    if a.s3:
        sys.path.insert(0, str(ROOT / "tests"))  # s3_server (batch_llm itself: the installed package)
        from s3_server import S3Server

        server = S3Server(tmp / "s3", bucket="images").start()
        options, base = server.storage_options(), f"s3://{server.bucket}/img"
    else:
        options, base = {}, str(tmp / "img")
        Path(base).mkdir()
    try:
        for k in range(a.n):
            with as_path(f"{base}/p{k:05d}.png", options).open("wb") as f:
                f.write(product_image(k, a.size))
        workers = [int(w) for w in a.workers.split(",")]
        runs: dict[int, list[float]] = {w: [] for w in workers}
        once = _planner(a, base, options, tmp) if a.plan else _shard_load(a, base, options)
        for rep in range(a.repeats):
            for w in workers if rep % 2 == 0 else workers[::-1]:  # alternating, both orders
                t0 = time.perf_counter()
                once(w)
                runs[w].append(time.perf_counter() - t0)
        out = []
        for w, xs in runs.items():
            med = statistics.median(xs)
            out.append({"what": "plan checks" if a.plan else "shard load",
                        "storage": "s3 (SeaweedFS, loopback)" if a.s3 else "local disk", "workers": w, "n": a.n,
                        "size": a.size, "s": [round(x, 3) for x in xs], "median_s": round(med, 3),
                        "ms_per_image": round(1000 * med / a.n, 2),
                        "speedup_vs_first": round(statistics.median(runs[workers[0]]) / med, 2)})
        for r in out:
            print("RESULT", json.dumps(r), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in out)
    finally:
        if server is not None:
            server.stop()
    return 0


def _shard_load(a, base: str, options: dict):
    from batch_llm.host import path_policy
    from batch_llm.io import images as im

    stores = path_policy.input_stores(base, None)  # the images' store is the run's own, as an input there
    checker = im.ImageChecker(options=options, roots=[] if a.s3 else [base], stores=stores, memo=0)
    refs = [checker.check(f"{base}/p{k:05d}.png", "image 1") for k in range(a.n)]
    max_bytes = im.DEFAULT_MAX_IMAGE_BYTES

    def once(workers: int) -> None:
        n = 0
        for _, loaded in im.load_ahead(iter(refs), lambda r: [r],
                                       lambda r: im.load_image(r, options, max_bytes, stores=stores), workers):
            assert isinstance(loaded, list), loaded
            n += 1
        assert n == a.n
    return once


def _planner(a, base: str, options: dict, tmp: Path):
    from batch_llm.config import parse_config
    from batch_llm.io.storage import Location, as_path
    from batch_llm.stages.plan import write_plan

    rows = "".join(json.dumps({"id": f"r{k}", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"p{k:05d}.png"}}, {"type": "text", "text": "What is it?"}]}]}) + "\n"
        for k in range(a.n))
    with as_path(f"{base}/rows.jsonl", options).open("w") as f:
        f.write(rows)
    runs = iter(range(10**6))

    def once(workers: int) -> None:
        cfg = parse_config({"name": "plan_images", "model": {"ref": "/models/vl"}, "engine": {"kind": "vllm"},
                            "input": {"path": f"{base}/rows.jsonl", "image_workers": workers},
                            "output": {"path": str(tmp / "out")}}, "bench.yaml")
        m = write_plan(cfg, input_loc=Location(f"{base}/rows.jsonl", options),
                       plan_dir=Location(str(tmp / f"plan{next(runs)}")))
        assert m.valid == a.n, (m.valid, m.invalid)
    return once


if __name__ == "__main__":
    raise SystemExit(main())
