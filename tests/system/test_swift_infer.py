"""``batch-llm infer`` with ms-swift's ``swift infer`` flags, as a user runs it: a process of its
own over swift rows, on the transformers engine (``--infer_backend pt``) and on the CPU vLLM engine; the result file
has swift's result shape (response, labels, logprobs, messages), one line per input row, in input order."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import run_in_group, vllm_cpu_env

QUESTIONS = ["What is 2 plus 2?", "Name a colour.", "What is the capital of France?", "Say hello.", "Count to three."]


def _rows(path: Path, n: int) -> Path:
    rows = [{"id": i, "messages": [{"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS[:n])]
    rows[1]["messages"].append({"role": "assistant", "content": "Blue."})  # a label, as swift's rows carry it
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _infer(tmp: Path, *flags: str, env: dict | None = None) -> tuple[list[dict], subprocess.CompletedProcess]:
    run = run_in_group([sys.executable, "-m", "batch_llm", "infer", *flags, "--result_path", str(tmp / "out.jsonl"),
                        "--plain"], timeout=600, cwd=tmp, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [json.loads(x) for x in (tmp / "out.jsonl").read_text(encoding="utf-8").splitlines()], run


def _check(lines: list[dict], n: int) -> None:
    assert len(lines) == n
    for q, line in zip(QUESTIONS, lines):
        assert list(line)[:4] == ["response", "labels", "logprobs", "messages"] and "id" not in line
        assert isinstance(line["response"], str) and line["response"].strip()
        assert line["messages"] == [{"role": "user", "content": q}, {"role": "assistant", "content": line["response"]}]
    assert lines[1]["labels"] == "Blue." and lines[0]["labels"] is None


def test_swift_flags_on_the_transformers_engine(tmp_path, demo_model_dir):
    lines, run = _infer(tmp_path, "--model", str(demo_model_dir), "--model_type", "llama", "--infer_backend", "pt",
                        "--val_dataset", str(_rows(tmp_path / "rows.jsonl", 5)), "--max_new_tokens", "16",
                        "--temperature", "0", "--max_batch_size", "4", "--stream", "false")
    _check(lines, 5)
    assert all(line["logprobs"] is None for line in lines)
    assert "5 lines appended" in run.stdout and "note: --model_type" in run.stderr
    assert not list(tmp_path.glob("batch-llm-infer-*"))  # the temporary run folder is gone


def test_swift_flags_on_the_vllm_engine(tmp_path, demo_model_dir):
    lines, _ = _infer(tmp_path, "--model", str(demo_model_dir), "--infer_backend", "vllm", "--val_dataset",
                      str(_rows(tmp_path / "rows.jsonl", 3)), "--max_new_tokens", "16", "--temperature", "0",
                      "--vllm_enforce_eager", "true", "--vllm_max_model_len", "1024", "--logprobs", "true",
                      "--work-dir", str(tmp_path / "work"), env=vllm_cpu_env())
    _check(lines, 3)
    lp = lines[0]["logprobs"]["content"]
    assert lp and {"token", "logprob", "bytes"} <= set(lp[0]) and "top_logprobs" not in lp[0]
    assert (tmp_path / "work" / "pipeline.yaml").is_file()  # --work-dir keeps the run
