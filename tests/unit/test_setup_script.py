"""``scripts/setup.sh`` decisions, through its dry run (``SETUP_DRY_RUN=1``): which interpreter, where torch's CPU
build comes from (the local wheel folder or PyTorch's CPU index), the exact uv commands, and the messages when no
usable interpreter is there. Fast and offline: nothing is installed, no index is contacted, no uv command runs (a
fake ``uv`` first on PATH records any call), and the project's own ``.venv`` / ``.venv-quantize`` stay as they are."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INDEX = "https://download.pytorch.org/whl/cpu"
TORCH = next(line.split("==", 1)[1].split()[0] for line in (ROOT / "requirements.lock").read_text().splitlines()
             if line.startswith("torch=="))
BASE_PY = getattr(sys, "_base_executable", "") or sys.executable   # the interpreter .venv was made from
TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
SYNC = "+ uv pip sync -q --compile-bytecode --python"  # how scripts/setup.sh syncs a venv: bytecode at install


@pytest.fixture
def repo(tmp_path) -> Path:
    """A scratch copy of what setup.sh reads: the script, the two lock files, pyproject.toml (no .venv)."""
    r = tmp_path / "repo"
    (r / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "setup.sh", r / "scripts" / "setup.sh")
    for name in ("requirements.lock", "requirements-quantize.lock", "pyproject.toml"):
        shutil.copy2(ROOT / name, r / name)
    return r


@pytest.fixture
def fake_uv(tmp_path) -> Path:
    """A directory with a ``uv`` that records its arguments and fails: a dry run must never call it."""
    d = tmp_path / "fake-uv"
    d.mkdir()
    _script(d / "uv", f'echo "$@" >> {d / "calls"}\nexit 3\n')
    return d


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _fake_python(path: Path, version: str) -> None:
    """A stand-in interpreter answering setup.sh's probe (``X.Y implementation executable``)."""
    _script(path, f'echo "{version} cpython {path}"\n')


def setup(repo: Path, fake_uv: Path | None = None, path: str | None = None, **env: str):
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "TORCH_FIND_LINKS", "TORCH_INDEX_URL", "UV",
                                                           "SETUP_DRY_RUN", "VIRTUAL_ENV")}
    e["PATH"] = path if path is not None else os.pathsep.join([str(fake_uv)] * bool(fake_uv) + [e["PATH"]])
    e.update(SETUP_DRY_RUN="1", **env)
    p = subprocess.run(["/bin/bash", str(repo / "scripts" / "setup.sh")], env=e, capture_output=True, text=True,
                       timeout=60)
    if fake_uv is not None:
        assert not (fake_uv / "calls").exists(), (fake_uv / "calls").read_text()
    return p


def _link_tools(bin_dir: Path, *names: str) -> None:
    for name in names:
        os.symlink(shutil.which(name), bin_dir / name)


def _wheel_folder(tmp_path: Path, tag: str) -> Path:
    d = tmp_path / f"wheels-{tag}"
    d.mkdir()
    (d / f"torch-{TORCH}-{tag}-{tag}-manylinux_2_28_x86_64.whl").write_bytes(b"")   # dry run: never opened
    return d


def test_index_fallback_without_local_wheel_folder(repo, fake_uv):
    p = setup(repo, fake_uv, PYTHON=BASE_PY, TORCH_FIND_LINKS="/nonexistent")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert f"setup: torch {TORCH} from {INDEX} (no local wheel folder)" in lines
    assert "+ export UV_INDEX_STRATEGY=unsafe-best-match UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never" in lines
    for venv, lock in ((".venv", "requirements.lock"), (".venv-quantize", "requirements-quantize.lock")):
        assert f"+ uv venv -q --python {BASE_PY} {venv}" in lines
        assert f"{SYNC} {venv}/bin/python --extra-index-url {INDEX} {lock}" in lines
        assert f"+ uv pip install -q --python {venv}/bin/python --no-deps -e ." in lines
    assert "--find-links" not in p.stdout
    assert lines[-1] == "setup: dry run: nothing changed"
    assert not (repo / ".venv").exists() and not (repo / ".venv-quantize").exists()


def test_index_url_can_be_changed(repo, fake_uv):
    p = setup(repo, fake_uv, PYTHON=BASE_PY, TORCH_FIND_LINKS="/nonexistent", TORCH_INDEX_URL="https://mirror/cpu")
    assert p.returncode == 0, p.stderr
    assert (f"{SYNC} .venv/bin/python --extra-index-url https://mirror/cpu requirements.lock"
            in p.stdout.splitlines())


def test_local_wheel_folder_is_used_when_it_holds_the_wheel(repo, fake_uv, tmp_path):
    wheels = _wheel_folder(tmp_path, TAG)
    p = setup(repo, fake_uv, PYTHON=BASE_PY, TORCH_FIND_LINKS=str(wheels))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert f"setup: torch {TORCH} from {wheels} (local wheel folder)" in lines
    assert f"{SYNC} .venv/bin/python --find-links {wheels} requirements.lock" in lines
    assert f"{SYNC} .venv-quantize/bin/python --find-links {wheels} requirements-quantize.lock" in lines
    assert INDEX not in p.stdout


def test_python_312_with_a_cp311_only_folder_takes_the_index(repo, fake_uv, tmp_path):
    """As on the lab machine: /opt/wheels holds only the cp311 wheel, so Python 3.12 needs PyTorch's index."""
    wheels = _wheel_folder(tmp_path, "cp311")
    py = tmp_path / "bin" / "python3.12"
    py.parent.mkdir()
    _fake_python(py, "3.12")
    p = setup(repo, fake_uv, PYTHON=str(py), TORCH_FIND_LINKS=str(wheels))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == f"setup: python 3.12 {py} (PYTHON)"
    assert f"setup: torch {TORCH} from {INDEX} ({wheels} has no cp312 wheel)" in lines
    assert f"+ uv venv -q --python {py} .venv" in lines
    assert f"{SYNC} .venv/bin/python --extra-index-url {INDEX} requirements.lock" in lines


def test_search_order_skips_unusable_interpreters(repo, fake_uv, tmp_path):
    """No python3.11; a python3.12 that does not run (like a pyenv shim of a version not selected); python3 is 3.12."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "python3.12", "exit 127\n")
    _fake_python(bin_dir / "python3", "3.12")
    _link_tools(bin_dir, "dirname", "sed", "head", "sha256sum", "cut", "cat", "uname", "grep")
    p = setup(repo, path=f"{fake_uv}:{bin_dir}", TORCH_FIND_LINKS="/nonexistent")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == f"setup: python 3.12 {bin_dir / 'python3'} (found on PATH)"
    assert not (fake_uv / "calls").exists()


def test_a_venv_whose_interpreter_is_gone_is_recreated_with_clear(repo, fake_uv):
    (repo / ".venv" / "bin").mkdir(parents=True)
    os.symlink("/nonexistent/python", repo / ".venv" / "bin" / "python")
    p = setup(repo, fake_uv, PYTHON=BASE_PY, TORCH_FIND_LINKS="/nonexistent")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert f"+ uv venv -q --clear --python {BASE_PY} .venv" in lines
    assert f"+ uv venv -q --python {BASE_PY} .venv-quantize" in lines


def test_libnuma_warning(repo, fake_uv):
    """vLLM's CPU extension links libnuma.so.1: a machine without it gets a warning naming the Debian package."""
    _script(fake_uv / "ldconfig", 'echo "\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6"\n')
    p = setup(repo, fake_uv, PYTHON=BASE_PY, TORCH_FIND_LINKS="/nonexistent")
    assert p.returncode == 0, p.stderr
    assert "setup: warning: libnuma.so.1 missing; vLLM's CPU engine needs it (Debian: apt-get install libnuma1)" \
        in p.stderr.splitlines()
    _script(fake_uv / "ldconfig", 'echo "\tlibnuma.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libnuma.so.1"\n')
    assert "libnuma" not in setup(repo, fake_uv, PYTHON=BASE_PY, TORCH_FIND_LINKS="/nonexistent").stderr


def test_python_env_naming_nothing(repo, fake_uv):
    p = setup(repo, fake_uv, PYTHON="/nonexistent/python")
    assert p.returncode == 1
    assert p.stderr.strip() == "setup: error: PYTHON=/nonexistent/python not found; it must name CPython 3.11 or 3.12"
    assert "uv" not in p.stdout


def test_python_env_of_an_unsupported_version(repo, fake_uv, tmp_path):
    py = tmp_path / "python3.9"
    _fake_python(py, "3.9")
    p = setup(repo, fake_uv, PYTHON=str(py))
    assert p.returncode == 1
    assert f"PYTHON={py} is CPython 3.9 ({py}); it must name CPython 3.11 or 3.12" in p.stderr


def test_no_acceptable_interpreter_on_path(repo, tmp_path):
    """PATH holds only a python3 of version 3.9 (and dirname, which the script's first line needs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_python(bin_dir / "python3", "3.9")
    _link_tools(bin_dir, "dirname")
    p = setup(repo, path=str(bin_dir))
    assert p.returncode == 1
    assert p.stdout == ""
    msg = p.stderr.strip()
    assert msg.startswith("setup: error: no CPython 3.11 or 3.12 found (tried python3.11 not found; "
                          f"python3.12 not found; python3 is CPython 3.9 ({bin_dir / 'python3'})): ")
    assert "set PYTHON=" in msg


def test_dry_run_on_the_project_changes_nothing(fake_uv):
    """The real checkout: its environments are in use, so compare their stamps and top-level entries around the run."""
    def snapshot():
        out = {}
        for venv in (".venv", ".venv-quantize"):
            d = ROOT / venv
            if d.exists():
                out[venv] = (d.stat().st_mtime_ns, sorted(x.name for x in d.iterdir()),
                             (d / ".lock.sha").read_text() if (d / ".lock.sha").exists() else None)
        return out

    before = snapshot()
    p = setup(ROOT, fake_uv, TORCH_FIND_LINKS="/nonexistent")
    assert p.returncode == 0, p.stderr
    assert f"setup: torch {TORCH} from {INDEX} (no local wheel folder)" in p.stdout.splitlines()
    assert p.stdout.splitlines()[-1] == "setup: dry run: nothing changed"
    assert snapshot() == before
