"""Real Airflow services for a test, as subprocesses on 127.0.0.1 (no `airflow standalone`, no Docker).

    svc = AirflowServices(tmp_path, pipelines_dir=tmp_path / "pipelines")
    svc.start()                                  # db migrate, pool `gpu`, api-server, scheduler, dag-processor
    svc.wait_dag_parsed("my_pipeline"); svc.unpause("my_pipeline")
    run = svc.trigger("my_pipeline", logical_date=None)
    svc.wait_run("my_pipeline", run["dag_run_id"], timeout=600)
    svc.stop()                                   # SIGTERM every process group, then SIGKILL; no orphans

Every process gets a fresh ``AIRFLOW_HOME`` in the test's tmp dir, its own SQLite DB (or the given
``sql_alchemy_conn``), the simple auth manager with a passwords file (user ``admin``), a shared JWT secret,
this checkout's ``dags/`` and ``plugins/`` (no PYTHONPATH: the packages come from the install) and
``BATCH_LLM_PIPELINES_DIR`` pointing at the test's pipeline YAML files. Each service's stdout/stderr go to
``<tmp>/service-logs/<name>.log``; ``log_tails()`` prints their ends (and the failed tasks' logs), which the
wait helpers put into their failure messages.

Nothing listens on anything but 127.0.0.1: the api-server gets ``-H 127.0.0.1``; the log servers that
Airflow starts beside the scheduler, the triggerer and Celery workers bind every interface (``host=""`` in
``airflow.utils.serve_logs``, with no setting to change it), so they are all started with
``--skip-serve-logs`` (task logs are read from the shared local log folder instead); the scheduler's health
check server stays off (``[scheduler] enable_health_check`` False). Redis and PostgreSQL (CeleryExecutor
test) get ``bind 127.0.0.1`` / ``listen_addresses=127.0.0.1``. ``assert_loopback_only()`` checks it
(/proc/net/tcp{,6} against the sockets of every process under the services); ``start()`` calls it.

Clean-up: each service runs in a session (process group) of its own; ``stop()`` sends SIGTERM to every
group (Airflow first, then PostgreSQL/Redis), waits, then SIGKILLs what is left. Processes that left their
group are ended too: the ones under a service when stop() begins (Airflow's task processes and the batch
inference engine worker start sessions of their own), found by walking /proc's parent links, and any that
carries ``BATCH_LLM_TEST_SERVICES=<uuid>`` in its environment (an orphan reparented to init; processes that
set their title, as Airflow's and Redis do, overwrite that environment block, hence the walk).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batch_llm.host.procgroup import process_group_alive

ROOT = Path(__file__).resolve().parents[1]
MARKER = "BATCH_LLM_TEST_SERVICES"
TERMINAL = {"success", "failed"}


def worker_hostname() -> str:
    """``[core] hostname_callable`` for the Celery test: each worker process tells the task instance its own
    name (``BATCH_LLM_TEST_WORKER_NAME``), as separate hosts or pods would. Falls back to the FQDN."""
    name = os.environ.get("BATCH_LLM_TEST_WORKER_NAME")
    return f"{name}@{socket.getfqdn()}" if name else socket.getfqdn()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200 * lines))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError as e:
        return f"<{e}>"


def _wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on 127.0.0.1:{port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{what} not listening on 127.0.0.1:{port} after {timeout:.0f}s")


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log: Path
    tier: int = 1                        # stop() ends higher tiers first (Airflow before its DB and broker)
    stop_signal: int = signal.SIGTERM


@dataclass
class CeleryWorker:
    """One ``airflow celery worker``: ``queues`` it serves, ``concurrency`` and its Celery node name."""

    name: str                    # also the task instances' hostname prefix (see worker_hostname)
    queues: str
    concurrency: int


class ProcessGroup:
    """Subprocesses started in sessions of their own, logs to files; stop() ends every group and every
    process that carries this group's marker in its environment."""

    def __init__(self, log_dir: Path, env: dict[str, str]):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.marker = uuid.uuid4().hex
        self.env = {**env, MARKER: self.marker}
        self.services: list[Service] = []

    def spawn(self, name: str, argv: list[str], *, env: dict | None = None, preexec_user: str | None = None,
              cwd: Path | None = None, tier: int = 1, stop_signal: int = signal.SIGTERM) -> Service:
        log = self.log_dir / f"{name}.log"
        f = open(log, "ab")
        full_env = {**self.env, **(env or {})}
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=full_env, cwd=str(cwd or ROOT), start_new_session=True, user=preexec_user)
        f.close()
        svc = Service(name, proc, log, tier, stop_signal)
        self.services.append(svc)
        return svc

    def run(self, name: str, argv: list[str], *, timeout: float = 300, env: dict | None = None,
            user: str | None = None, cwd: Path | None = None) -> None:
        """Runs a one-off command to completion (output appended to <name>.log); raises with its tail."""
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as f:
            p = subprocess.run(argv, check=False, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**self.env, **(env or {})}, cwd=str(cwd or ROOT), timeout=timeout, user=user)
        if p.returncode:
            raise RuntimeError(f"{' '.join(argv)} exited with {p.returncode}:\n{_tail(log, 40)}")

    def marked_pids(self) -> list[int]:
        """Live processes (other than this one) whose environment carries this group's marker."""
        needle = f"{MARKER}={self.marker}".encode()
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                continue
        return out

    def listeners(self) -> list[tuple[int, str, str]]:
        """TCP sockets in LISTEN state held by this group's processes: (pid, command, "address:port")."""
        inodes: dict[str, int] = {}
        for pid, _ in self.tree():
            try:
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
            except OSError:
                continue
        out = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                if f[3] != "0A" or f[9] not in inodes:   # 0A: LISTEN
                    continue
                pid = inodes[f[9]]
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
                except OSError:
                    cmd = "?"
                out.append((pid, cmd, _decode_addr(f[1])))
        return out

    def non_loopback_listeners(self) -> list[tuple[int, str, str]]:
        return [x for x in self.listeners() if not x[2].startswith(("127.", "[::1]:"))]

    def tree(self) -> set[tuple[int, int]]:
        """(pid, start time) of every live process under the services (whatever session or group it moved
        to, and whether or not a changed process title wiped its environment) plus every marked one."""
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = [s.proc.pid for s in self.services] + self.marked_pids()
        found: set[tuple[int, int]] = set()
        while todo:
            pid = todo.pop()
            if pid in table and (pid, table[pid][1]) not in found:
                found.add((pid, table[pid][1]))
                todo.extend(children.get(pid, []))
        return found

    def crash(self, name: str) -> list[int]:
        """What a host's power loss does to one service: SIGKILL to it and every process under it (whatever
        session it moved to), at once, no grace. The service leaves the list (nothing to stop at the end).
        Returns the pids killed."""
        svc = next(s for s in self.services if s.name == name)
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo, found = [svc.proc.pid], []
        while todo:
            pid = todo.pop()
            if pid in table and pid not in found:
                found.append(pid)
                todo.extend(children.get(pid, []))
        _killpg(svc.proc.pid, signal.SIGKILL)
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        svc.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(p in _proc_table() and _proc_table()[p][2] != "Z" for p in found) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.services.remove(svc)
        return found

    def stop(self, grace: float = 20.0) -> list[int]:  # noqa: C901
        """Ends the services tier by tier (highest first): each group gets its stop signal (SIGTERM; SIGINT,
        fast shutdown, for PostgreSQL), up to ``grace`` seconds, then SIGKILL. Every process that was under
        the services when stop() began, or carries the marker, and is still alive then gets SIGKILL too.
        Returns the pids that needed SIGKILL."""
        self._snapshot = self.tree()
        killed: list[int] = []
        for tier in sorted({s.tier for s in self.services}, reverse=True):
            group = [s for s in self.services if s.tier == tier]
            for s in group:
                if s.proc.poll() is None or process_group_alive(s.proc.pid):
                    _killpg(s.proc.pid, s.stop_signal)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                for s in group:
                    s.proc.poll()
                if not any(process_group_alive(s.proc.pid) for s in group):
                    break
                time.sleep(0.3)
            for s in group:
                if process_group_alive(s.proc.pid):
                    killed.append(s.proc.pid)
                    _killpg(s.proc.pid, signal.SIGKILL)
                try:
                    s.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        t = time.monotonic() + 5
        while self.leftovers() and time.monotonic() < t:
            time.sleep(0.3)
        for pid in self.leftovers():
            killed.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t = time.monotonic() + 10
        while self.leftovers() and time.monotonic() < t:
            time.sleep(0.2)
        return killed

    def leftovers(self) -> list[int]:
        """Live (non-zombie) processes of the services after stop(): the ones snapshotted when it began,
        still alive with the same start time, plus any marked one."""
        table = _proc_table()
        alive = {pid for pid, st in getattr(self, "_snapshot", set())
                 if pid in table and table[pid][1] == st and table[pid][2] != "Z"}
        return sorted(alive | set(self.marked_pids()))


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, start time in clock ticks, state) for every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(d.name)] = (int(fields[1]), int(fields[19]), fields[0])
    return out


def _decode_addr(hexaddr: str) -> str:
    """/proc/net/tcp{,6} local_address ("0100007F:1F90") as "127.0.0.1:8080" / "[::1]:8080"."""
    import ipaddress

    ip_hex, port_hex = hexaddr.split(":")
    raw = bytes.fromhex(ip_hex)
    # the kernel prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port_hex, 16)}" if ip.version == 4 else f"[{ip}]:{int(port_hex, 16)}"


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------- Redis, PostgreSQL
def ensure_system_services() -> None:
    """``scripts/services.sh ensure``: apt-installs redis-server / postgresql when missing (root)."""
    p = subprocess.run(["bash", str(ROOT / "scripts" / "services.sh"), "ensure"], check=False,
                       capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(f"scripts/services.sh ensure failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")


def pg_bin_dir() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if not found:
        raise RuntimeError("PostgreSQL not installed: run scripts/services.sh ensure")
    return found[-1].parent


class Redis:
    def __init__(self, procs: ProcessGroup, workdir: Path):
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.svc = procs.spawn("redis", [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                         "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "yes",
                                         "--daemonize", "no"], tier=0)
        _wait_port(self.port, 30, self.svc.proc, "redis-server")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class Postgres:
    """A throwaway cluster on 127.0.0.1:<free port>. PostgreSQL refuses to run as root: as root the data dir
    belongs to the ``postgres`` user and initdb/postgres run as that user. The data dir is outside pytest's
    tmp dir (/tmp/pytest-of-root is 0700: the postgres user could not reach it)."""

    def __init__(self, procs: ProcessGroup, db: str = "airflow"):
        import tempfile

        self.port = free_port()
        self.user_name = "airflow"
        self.password = secrets.token_hex(12)
        self.db = db
        self.dir = Path(tempfile.mkdtemp(prefix="batch_llm_pg_"))
        run_as = "postgres" if os.geteuid() == 0 else None
        if run_as:
            shutil.chown(self.dir, run_as, run_as)
        data = self.dir / "data"
        pwfile = self.dir / "pw"
        pwfile.write_text(self.password + "\n")
        if run_as:
            shutil.chown(pwfile, run_as, run_as)
        bin_dir = pg_bin_dir()
        procs.run("postgres-initdb", [str(bin_dir / "initdb"), "-D", str(data), "-U", self.user_name,
                                      f"--pwfile={pwfile}", "--auth-host=scram-sha-256", "--auth-local=peer",
                                      "-E", "UTF8", "--no-sync"], user=run_as, cwd=self.dir, timeout=120)
        self.svc = procs.spawn("postgres", [str(bin_dir / "postgres"), "-D", str(data), "-c",
                                            "listen_addresses=127.0.0.1", "-c", f"port={self.port}", "-c",
                                            f"unix_socket_directories={self.dir}", "-c", "fsync=off", "-c",
                                            "max_connections=200", "-c", "shared_buffers=64MB"],
                               preexec_user=run_as, cwd=self.dir, tier=0, stop_signal=signal.SIGINT)
        _wait_port(self.port, 60, self.svc.proc, "postgres")
        import psycopg2

        for _ in range(50):
            try:
                conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user_name,
                                        password=self.password, dbname="postgres")
                break
            except psycopg2.OperationalError:  # still starting up
                time.sleep(0.3)
        else:
            raise RuntimeError(f"cannot connect to postgres:\n{_tail(self.svc.log, 30)}")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{db}"')
        conn.close()

    def url(self, driver: str = "postgresql+psycopg2") -> str:
        return f"{driver}://{self.user_name}:{self.password}@127.0.0.1:{self.port}/{self.db}"

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ Airflow
class AirflowServices:
    """api-server, scheduler, dag-processor (and optionally triggerer, Celery workers) for one test."""

    def __init__(self, tmp: Path, *, pipelines_dir: Path, executor: str = "LocalExecutor",
                 sql_alchemy_conn: str | None = None, triggerer: bool = False,
                 celery_workers: Iterable[CeleryWorker] = (), extra_env: dict[str, str] | None = None,
                 pools: dict[str, int] | None = None, procs: ProcessGroup | None = None):
        self.tmp = Path(tmp)
        self.home = self.tmp / "airflow_home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(16)
        self.executor = executor
        self.triggerer = triggerer
        self.celery_workers = list(celery_workers)
        self.pools = {"gpu": 2} if pools is None else pools
        self._token: str | None = None
        pwfile = self.home / "simple_auth_manager_passwords.json"
        pwfile.write_text(json.dumps({"admin": self.password}))
        (self.tmp / "tmpdir").mkdir(exist_ok=True)
        # No PYTHONPATH: the services import batch_llm / batch_llm_airflow from the installed distribution and
        # find the provider and the plugin through its entry points, as a deployment that installed the wheel.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW") and k != "PYTHONPATH"}
        env.update({
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": executor,
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(pwfile),
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sql_alchemy_conn or f"sqlite:///{self.home / 'airflow.db'}",
            "AIRFLOW__API__BASE_URL": f"{self.base_url}/",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),   # one secret for every component
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            # never started (--skip-serve-logs), but should one be, it gets a port nobody else uses
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "BATCH_LLM_PIPELINES_DIR": str(pipelines_dir),
            "TMPDIR": str(self.tmp / "tmpdir"),
            "PYTHONUNBUFFERED": "1",
        })
        env.update(extra_env or {})
        self.env = env
        self.procs = procs or ProcessGroup(self.tmp / "service-logs", env)
        self.procs.env.update(env)
        self.airflow = [sys.executable, "-m", "airflow"]
        self.timings: dict[str, float] = {}

    # ----------------------------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 240) -> "AirflowServices":
        t0 = time.monotonic()
        self.procs.run("db-migrate", [*self.airflow, "db", "migrate"], timeout=600)
        self.timings["db_migrate"] = time.monotonic() - t0
        # the pool through the CLI, while the services start (it only has to exist before tasks queue)
        pools = [self.procs.spawn(f"pool-{name}", [*self.airflow, "pools", "set", name, str(slots),
                                                   f"{slots} slot(s) for {name} tasks (test)"])
                 for name, slots in self.pools.items()]
        self.procs.spawn("api-server", [*self.airflow, "api-server", "-H", "127.0.0.1", "-p", str(self.port),
                                        "-w", "1"])
        self.spawn_scheduler()
        self.procs.spawn("dag-processor", [*self.airflow, "dag-processor"])
        if self.triggerer:
            self.procs.spawn("triggerer", [*self.airflow, "triggerer", "--skip-serve-logs"])
        for w in self.celery_workers:
            self.spawn_celery_worker(w)
        self._wait_healthy(timeout - (time.monotonic() - t0))
        self.assert_loopback_only()
        for p in pools:
            rc = p.proc.wait(timeout=max(30.0, timeout - (time.monotonic() - t0)))
            if rc:
                raise RuntimeError(f"`airflow pools set` exited with {rc}:\n{_tail(p.log, 30)}")
        self.timings["start"] = time.monotonic() - t0
        return self

    def spawn_scheduler(self, name: str = "scheduler") -> Service:
        return self.procs.spawn(name, [*self.airflow, "scheduler", "--skip-serve-logs"])

    def spawn_celery_worker(self, w: CeleryWorker, name: str | None = None) -> Service:
        """``airflow celery worker`` for ``w`` (service name ``celery-<w.name>`` unless ``name`` is given)."""
        return self.procs.spawn(name or f"celery-{w.name}", [
            *self.airflow, "celery", "worker", "--queues", w.queues, "--concurrency", str(w.concurrency),
            "-H", f"{w.name}@%h", "--skip-serve-logs", "--without-gossip", "--without-mingle"],
            # PYTHONPATH here names only this test harness (its hostname callable), never the project's
            # packages, which come from the install.
            env={"BATCH_LLM_TEST_WORKER_NAME": w.name, "PYTHONPATH": str(Path(__file__).resolve().parent),
                 "AIRFLOW__CORE__HOSTNAME_CALLABLE": "airflow_services.worker_hostname"})

    def _wait_healthy(self, timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                r = requests.get(f"{self.base_url}/api/v2/monitor/health", timeout=5)
                last = r.json() if r.ok else r.text
                if r.ok and last["metadatabase"]["status"] == "healthy" \
                        and last["scheduler"]["status"] == "healthy" \
                        and (last.get("dag_processor") or {}).get("status") == "healthy" \
                        and (not self.triggerer or last["triggerer"]["status"] == "healthy"):
                    return
            except (requests.RequestException, ValueError, KeyError):
                pass
            time.sleep(1)
        raise TimeoutError(f"services not healthy after {timeout:.0f}s (last /health: {last})\n"
                           + self.log_tails())

    def _check_alive(self) -> None:
        for s in self.procs.services:
            if not s.name.startswith("pool-") and s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited with {s.proc.returncode}\n" + self.log_tails())

    def assert_loopback_only(self) -> None:
        """No process of these services listens on anything but loopback."""
        bad = self.procs.non_loopback_listeners()
        assert not bad, f"listening beyond 127.0.0.1: {bad}"

    def stop(self) -> list[int]:
        killed = self.procs.stop()
        (self.procs.log_dir / "stop.txt").write_text(f"needed SIGKILL: {killed}\n")
        return killed

    # ------------------------------------------------------------------------------------------- API
    def token(self) -> str:
        import requests

        if self._token is None:
            r = requests.post(f"{self.base_url}/auth/token", json={"username": "admin",
                                                                   "password": self.password}, timeout=30)
            r.raise_for_status()
            self._token = r.json()["access_token"]
        return self._token

    def api(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
            ok: Iterable[int] = (200, 201), timeout: float = 60) -> Any:
        """``/api/v2/<path>`` with the admin's Bearer token; returns the JSON body, raises on another status."""
        import requests

        url = f"{self.base_url}/api/v2/{path.lstrip('/')}" if not path.startswith("/") else \
            f"{self.base_url}{path}"
        for attempt in range(1, 11):
            r = requests.request(method, url, json=json, params=params, timeout=timeout,
                                 headers={"Authorization": f"Bearer {self.token()}"})
            if r.status_code == 401 and attempt == 1:
                self._token = None
                continue
            # On SQLite Airflow answers 503 "Database is locked" while the scheduler holds the database (more
            # often on a busy machine, as with make test's two workers): a client asks again
            if r.status_code == 503 and "Database is locked" in r.text:
                time.sleep(3)
                continue
            break
        if r.status_code not in set(ok):
            raise AssertionError(f"{method} {url} -> {r.status_code}: {r.text[:2000]}")
        return r.json() if r.content else None

    def wait_dag_parsed(self, dag_id: str, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                return self.api("GET", f"dags/{dag_id}")
            except AssertionError as e:
                if "-> 404" not in str(e):
                    raise
            time.sleep(1)
        errors = self.api("GET", "importErrors")
        raise TimeoutError(f"DAG {dag_id} not parsed after {timeout:.0f}s; import errors: {errors}\n"
                           + self.log_tails())

    def unpause(self, dag_id: str) -> dict:
        return self.api("PATCH", f"dags/{dag_id}", json={"is_paused": False})

    def trigger(self, dag_id: str, conf: dict | None = None, logical_date: str | None = None, **body) -> dict:
        """POST a DAG run. ``logical_date=None`` is sent as JSON null (a run without a logical date)."""
        return self.api("POST", f"dags/{dag_id}/dagRuns", json={"logical_date": logical_date,
                                                                "conf": conf or {}, **body})

    def dag_runs(self, dag_id: str, **params: Any) -> list[dict]:
        return self.api("GET", f"dags/{dag_id}/dagRuns", params={"limit": 100, **params})["dag_runs"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 900) -> dict:
        """Waits for a terminal state; a failed run (or a timeout) raises with task states and log tails."""
        deadline = time.monotonic() + timeout
        run: dict = {}
        while time.monotonic() < deadline:
            self._check_alive()
            run = self.api("GET", f"dags/{dag_id}/dagRuns/{run_id}")
            if run["state"] in TERMINAL:
                break
            time.sleep(2)
        if run.get("state") != "success":
            raise AssertionError(f"run {dag_id}/{run_id} is {run.get('state')!r} (timeout {timeout:.0f}s)\n"
                                 + self.describe_run(dag_id, run_id) + "\n" + self.log_tails())
        return run

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        """Every task instance of a run (mapped ones once per map index): task_id, map_index, state,
        hostname, queue, pool, try_number, executor, ..."""
        got: list[dict] = []
        while True:  # the API answers a page at a time (at most 100 here)
            page = self.api("GET", f"dags/{dag_id}/dagRuns/{run_id}/taskInstances",
                            params={"limit": 100, "offset": len(got)})
            got += page["task_instances"]
            if not page["task_instances"] or len(got) >= page["total_entries"]:
                return got

    def describe_run(self, dag_id: str, run_id: str) -> str:
        try:
            tis = self.task_instances(dag_id, run_id)
        except Exception as e:  # noqa: BLE001 - diagnostics only
            return f"<task instances unavailable: {e}>"
        lines = [f"  {t['task_id']}[{t['map_index']}] {t['state']} try={t['try_number']} host={t['hostname']} "
                 f"queue={t['queue']}" for t in tis]
        for t in tis:
            if t["state"] in ("failed", "up_for_retry", "upstream_failed") or t["state"] is None:
                for log in self.task_log_files(dag_id, run_id, t["task_id"], t["map_index"]):
                    lines.append(f"--- {log.relative_to(self.home)} (tail)\n{_tail(log, 60)}")
        return "\n".join(lines)

    def task_log_files(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> list[Path]:
        base = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        if map_index >= 0:
            base = base / f"map_index={map_index}"
        return sorted(base.glob("attempt=*.log"))

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(f"===== {s.name} ({s.log}) =====\n{_tail(s.log, lines)}" for s in self.procs.services)


# ----------------------------------------------------------------------------------- test pipelines
def valid_sample_rows() -> list[dict]:
    """The demo sample's valid rows only (the planted bad rows are other tests' business)."""
    rows, seen = [], set()
    for line in (ROOT / "include" / "sample_data" / "demo_prompts.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        ok = isinstance(r.get("id"), str) and r["id"] not in seen and (
            isinstance(r.get("prompt"), str) or (r.get("messages") and r["messages"][-1]["role"] == "user"))
        if ok:
            seen.add(r["id"])
            rows.append(r)
    return rows


def write_test_pipeline(tmp: Path, *, name: str, days: list, rows_per_day: int, num_shards: int,
                        schedule: str | None, start_date, evaluate: bool = True, batch_size: int = 8,
                        commit_every_rows: int = 8) -> tuple[Path, Path, dict[str, list[str]]]:
    """dags/pipelines/demo.yaml adjusted for a services test: daily input partitions
    <tmp>/in/dt=<ds>/prompts.jsonl (``rows_per_day`` valid sample rows each, no row in two days), output
    under <tmp>/out, the transformers engine. Returns (pipelines dir, output dir, input ids per day)."""
    import yaml

    demo_dir = ROOT / "dags" / "pipelines"
    cfg = yaml.safe_load((demo_dir / "demo.yaml").read_text())
    rows = valid_sample_rows()
    assert len(rows) >= rows_per_day * len(days), "not enough valid sample rows"
    ids: dict[str, list[str]] = {}
    for i, day in enumerate(days):
        part = tmp / "in" / f"dt={day.isoformat()}"
        part.mkdir(parents=True, exist_ok=True)
        chunk = rows[i * rows_per_day:(i + 1) * rows_per_day]
        (part / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))
        ids[day.isoformat()] = [r["id"] for r in chunk]
    out = tmp / "out"
    cfg["name"] = name
    cfg["description"] = f"services test: {cfg['description']}"
    cfg["input"]["path"] = str(tmp / "in" / "dt={ds}" / "prompts.jsonl")
    cfg["output"]["path"] = str(out)
    cfg["sharding"] = {"num_shards": num_shards}
    # transformers: the engine starts in seconds, where vLLM's CPU engine takes a minute or more per task.
    # The vLLM path is covered end to end by tests/system/test_pipeline_e2e.py (dag.test on the demo pipeline).
    cfg["engine"] = {"kind": "transformers", "max_model_len": 1024, "batch_size": batch_size,
                     "commit_every_rows": commit_every_rows,
                     "max_error_rate": 0.2}
    cfg["sampling"]["max_tokens"] = 32
    cfg["evaluate"]["enabled"] = evaluate
    for wl in cfg["filter"]["lists"]:
        if wl["path"].startswith(("./", "../")):
            wl["path"] = str((demo_dir / wl["path"]).resolve())
    cfg["airflow"] = {"schedule": schedule, "start_date": start_date.isoformat(), "catchup": False,
                      "retries": 1, "retry_delay_seconds": 5, "tags": ["test"]}
    pipelines = tmp / "pipelines"
    pipelines.mkdir(parents=True, exist_ok=True)
    header = ("# Written by a services test (tests/airflow_services.py): dags/pipelines/demo.yaml adjusted.\n"
              "# engine.kind transformers starts fast; the vLLM path is covered by the dag.test e2e test\n"
              "# (tests/system/test_pipeline_e2e.py).\n")
    (pipelines / f"{name}.yaml").write_text(header + yaml.safe_dump(cfg, sort_keys=False))
    return pipelines, out, ids


def print_on_failure(request, svc: AirflowServices, failed_before: int) -> None:
    """From a fixture's teardown: when a test of the module failed, print the services' log tails past
    pytest's capture (a failed wait_run already carries them in its message)."""
    if request.session.testsfailed > failed_before:
        capman = request.config.pluginmanager.getplugin("capturemanager")
        with capman.global_and_fixture_disabled():
            print(f"\n===== service logs ({svc.procs.log_dir}) =====\n{svc.log_tails(60)}")
