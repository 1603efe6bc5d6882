"""Small helpers shared by the tests."""
from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from batch_llm.config import PipelineConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO_YAML = ROOT / "dags" / "pipelines" / "demo.yaml"
FAULT_INJECTION = ROOT / "tests" / "fault_injection"


def fault_env(fault: str) -> dict[str, str]:
    """Environment for a worker that kills itself at a shard checkpoint: ``"after_commit:3"`` is the 3rd
    commit (tests/fault_injection/sitecustomize.py listens to the checkpoints)."""
    path = os.pathsep.join(p for p in (str(FAULT_INJECTION), os.environ.get("PYTHONPATH")) if p)
    return {"BATCH_LLM_FAULT": fault, "PYTHONPATH": path}


def vllm_cpu_env() -> dict[str, str]:
    """The environment of a child process that runs vLLM's CPU engine in a test: a 1 GiB KV cache, no usage
    report, no hub."""
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1")


def demo_config(tmp: Path, **overrides) -> PipelineConfig:
    """The demo pipeline writing under ``tmp``; overrides are dotted keys with '__' for '.'."""
    cfg = load_config(DEMO_YAML)
    return cfg.with_overrides({"output.path": str(tmp / "out"), **{k.replace("__", "."): v
                                                                   for k, v in overrides.items()}})


def run_demo_cli(src: Path, out: Path, *, ds: str, run_id: str, sets: list[str]) -> tuple[dict, dict, str]:
    """``batch-llm run`` of the demo pipeline over ``src`` into ``out``, as a user runs it (a process of its
    own, ``--set`` overrides); the test fails with the run's output when it fails. Returns the partition's
    ``_CURRENT.json``, the published ``summary.json`` and the run's stdout."""
    import subprocess
    import sys

    from batch_llm.io.storage import Location, read_json

    args = [sys.executable, "-m", "batch_llm", "run", str(DEMO_YAML), "--input", str(src), "--output", str(out),
            "--ds", ds, "--run-id", run_id, "--plain"]
    for s in sets:
        args += ["--set", s]
    run = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    current = read_json(Location(str(out)).child("batch_llm_demo", f"dt={ds}", "_CURRENT.json").path())
    return current, read_json(Location(current["version"]).child("summary.json").path()), run.stdout


def cache_namespace(tmp: Path, **overrides) -> str:
    """The result-cache namespace a shard of the demo pipeline (with ``overrides``) reads and writes."""
    from batch_llm.io.storage import Location
    from batch_llm.manifests import ShardSpec
    from batch_llm.stages.infer.runner import ShardRun

    shard = tmp / "rows.jsonl"
    shard.write_text("")
    run = ShardRun(demo_config(tmp, **overrides), shard=ShardSpec(index=0, rows=0, url=str(shard)),
                   shard_dir=Location(str(tmp / "shard")), model_dir=str(tmp), model_key="m@main#abc",
                   cache_root=Location(str(tmp / "cache")))
    return run.cache.dir.url.rsplit("/", 1)[-1]


def custom_code_model(demo_dir: Path, dest: Path) -> Path:
    """A copy of the demo model whose config, model class and tokenizer are code shipped in the folder
    (``auto_map``), as a ``trust_remote_code`` checkpoint has them: transformers and vLLM refuse to load it
    unless told to run that code. The classes subclass Llama's, so the weights load as they are (linked)."""
    import json
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for f in demo_dir.iterdir():
        if f.name == "model.safetensors":
            (dest / f.name).symlink_to(f)
        elif f.name not in ("config.json", "tokenizer_config.json"):
            shutil.copy2(f, dest / f.name)
    config = json.loads((demo_dir / "config.json").read_text())
    config.update(model_type="smol_custom", auto_map={"AutoConfig": "custom_config.SmolCustomConfig",
                                                      "AutoModelForCausalLM": "custom_model.SmolCustomForCausalLM"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    tok = json.loads((demo_dir / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="SmolCustomTokenizer",
               auto_map={"AutoTokenizer": [None, "custom_tokenizer.SmolCustomTokenizer"]})
    (dest / "tokenizer_config.json").write_text(json.dumps(tok, indent=1))
    (dest / "custom_config.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass SmolCustomConfig(LlamaConfig):\n"
        "    model_type = \"smol_custom\"\n")
    (dest / "custom_model.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .custom_config import SmolCustomConfig\n\n\n"
        "class SmolCustomForCausalLM(LlamaForCausalLM):\n    config_class = SmolCustomConfig\n")
    (dest / "custom_tokenizer.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass SmolCustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    return dest


class EchoEngine:
    """Stands in for the engine where the shard runner's paths (cache, identity) do not depend on it: echoes each
    prompt's size and counts the requests it was asked."""

    requests = 0

    def generate(self, reqs):
        from batch_llm.engines.base import GenResult

        for r in reqs:
            EchoEngine.requests += 1
            n = len(r.prompt_token_ids)
            yield GenResult(key=r.key, text=f"echo {n}", finish_reason="stop", prompt_tokens=n, completion_tokens=2)

    def close(self):
        pass


def use_echo_engine(monkeypatch) -> type[EchoEngine]:
    """The inference stage starts an EchoEngine (its request count reset) instead of a real engine."""
    from batch_llm.engines.base import EngineInfo
    from batch_llm.stages.infer import runner

    monkeypatch.setattr(runner, "start_engine", lambda *a, **k: (EchoEngine(), EngineInfo(kind="echo", version="0")))
    EchoEngine.requests = 0
    return EchoEngine


def run_in_group(cmd: Sequence[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) in a session of its own: at the timeout the whole process
    group is ended (the workers' GroupLeader). subprocess.run kills only the child, and vLLM's engine-core and
    worker processes (~3 GB each) outlived it and slowed every later test."""
    from batch_llm.host.procgroup import GroupLeader

    with subprocess.Popen(list(cmd), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            GroupLeader(proc).stop()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_in_pty(cmd: Sequence[str], *, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Runs ``cmd`` with a pseudo-terminal (120 columns) as its stdin, stdout and stderr, in a session of its own,
    as a person at a terminal would; returns its exit code and everything the terminal received (stdout and
    stderr together, as a terminal shows them). At the timeout the whole process group is ended."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    from batch_llm.host.procgroup import GroupLeader

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(list(cmd), stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env=env)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    exited_at = None
    try:
        while True:
            if time.monotonic() > deadline:
                GroupLeader(proc).stop()
                raise subprocess.TimeoutExpired(list(cmd), timeout, b"".join(chunks))
            if exited_at is None and proc.poll() is not None:
                exited_at = time.monotonic()
            if exited_at is not None and time.monotonic() - exited_at > 5:  # a child still holds the terminal
                break
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal is gone
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return proc.wait(), b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


def plan_lines(tmp_path: Path, lines: list, **overrides) -> tuple:
    """The demo pipeline's one-task plan of ``lines`` (objects or raw strings) written as one JSONL file: the
    manifest, the shard rows by id and the row errors' reasons by id."""
    import json

    from batch_llm.io.storage import Location, iter_jsonl
    from batch_llm.stages import plan as plan_mod

    p = tmp_path / "batch.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = demo_config(tmp_path, input__path=str(p), **overrides)
    m = plan_mod.write_plan(cfg, input_loc=Location(str(p)), plan_dir=Location(str(tmp_path / "plan")))
    rows = {r["id"]: r for s in m.shards for r in iter_jsonl(Location(s.url).path())}
    errors = {e["id"]: e["reason"] for e in iter_jsonl(Location(m.errors).path())}
    return m, rows, errors


def race(writer, writers: int, reader) -> None:
    """``writer(k)`` for k in range(``writers``) on threads of their own at once, beside ``reader(stop)`` on
    another, which runs until every writer is done and ``stop`` (a threading.Event) is set."""
    import threading

    stop = threading.Event()
    r = threading.Thread(target=reader, args=(stop,))
    r.start()
    ws = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
    for t in ws:
        t.start()
    for t in ws:
        t.join()
    stop.set()
    r.join()
