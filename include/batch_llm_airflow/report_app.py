"""The run reports in the Airflow UI: a FastAPI app that the plugin (``plugin.py``) mounts at ``/batch-llm``.

    GET /batch-llm/report?path=<url of a report.html>[&conn_id=<connection>]   the report page
    GET /batch-llm/                                                            recent reports, newest first

Who may read what:

- Only signed-in users: the user comes from Airflow's own ``get_user`` dependency
  (``airflow.api_fastapi.core_api.security``): a ``Authorization: Bearer`` JWT, else the ``_token`` cookie the
  UI's login sets (httponly, sent with every same-origin request, also to plugin apps). No token: 401, an
  invalid one: 403.
- Only files under an allowed root: ``<output.path>/<name>`` of every pipeline YAML the DAGs are built from
  (``$BATCH_LLM_PIPELINES_DIR`` or ``<dags_folder>/pipelines``), plus the prefixes in
  ``$BATCH_LLM_REPORT_ROOTS`` (comma separated output roots, ``s3://conn@bucket/prefix`` names a connection).
  Local paths (plain, ``file://``, ``local://``: ``batch_llm.host.path_policy`` decides) are compared after ``realpath``
  (no ``..`` or symlink escapes), object-store URLs segment by segment; wrapped (``simplecache::``) and other URLs
  are refused; only ``*.html`` files are served. Anything else: 403.
- Only reports of DAGs the user may read: the path's pipeline (``<root>/<pipeline>/...``, the pipeline name
  is the DAG id) is checked with the auth manager's ``is_authorized_dag(GET, RUN)``; no access: 403.

``s3://`` reports are read with the credentials of the root's own connection (``output.conn_id`` or the
``conn@`` of its URL) and no other: a ``conn_id`` query parameter other than it is refused, also where the root
names none (such a root is read with the API server's default credentials), or a caller could point any
connection at any bucket.

No pipeline code runs here: the roots come from each pipeline YAML's ``name`` and ``output`` keys, read as
plain YAML. Validating the whole config would import the authors' Python (an output schema given as
``module:Class``) in the API server on every refresh of the roots, where Airflow 3 keeps DAG authors' code out.

The page is served with a Content-Security-Policy that allows no scripts and no requests (inline CSS and
``data:`` images only): a report shows user data, and it is served from Airflow's own origin.

Nothing heavy is imported at module level (Airflow loads every plugin file in every task process too).
"""
# No ``from __future__ import annotations``: the route functions are defined inside create_app() with
# FastAPI's types imported there, and FastAPI reads their annotations as evaluated objects.
import html
import logging
import os
import posixpath
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote, urlencode

from batch_llm.host import path_policy

from batch_llm_airflow.storage_bridge import split_conn

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("batch_llm_airflow.report_app")

URL_PREFIX = "/batch-llm"
ROOTS_ENV = "BATCH_LLM_REPORT_ROOTS"
MAX_REPORT_BYTES = 64 * 2**20
ROOTS_TTL_SECONDS = 30.0
INDEX_MAX = 50
CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; frame-ancestors 'self'; "
       "base-uri 'none'; form-action 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "same-origin", "Cache-Control": "private, no-store"}


class ReportError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


# ------------------------------------------------------------------------------------------ allowed roots
@dataclass(frozen=True)
class Root:
    """A prefix reports may be read from. ``dag_id`` set: everything below belongs to that DAG (a pipeline's
    ``<output.path>/<name>``); unset: the first segment below the prefix is the DAG id (an output root)."""

    url: str
    conn_id: str | None = None
    dag_id: str | None = None
    source: str = ""

    @property
    def local(self) -> bool:
        return _is_local(self.url)


def _is_local(url: str) -> bool:
    """A local path opened directly (plain, file:// or local://), as the path policy classifies it."""
    return path_policy.is_local(url)


def _norm_local(url: str) -> str:
    return os.path.realpath(path_policy.local_path(url) or url)


def pipelines_folder() -> Path:
    if env := os.environ.get("BATCH_LLM_PIPELINES_DIR"):
        return Path(env)
    from airflow.configuration import conf

    return Path(conf.get("core", "dags_folder")) / "pipelines"


_DAG_ID = re.compile(r"[A-Za-z0-9_.-]+")


def pipeline_root(path: Path) -> Root:
    """``<output.path>/<name>`` of one pipeline YAML, from those keys alone (ValueError when they are not
    usable): the full config is not validated here, as that imports an output schema's ``module:Class``."""
    import yaml
    from batch_llm.io.storage import join_url

    try:  # bounded as every pipeline file is read: an alias bomb must not stall the API server
        data = path_policy.load_yaml(path_policy.read_local_bounded(str(path), path_policy.MAX_PIPELINE_FILE_BYTES)
                                     .decode("utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML: {e}") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    name = data.get("name") if isinstance(data, dict) else None
    output = data.get("output") if isinstance(data, dict) else None
    if not isinstance(name, str) or not _DAG_ID.fullmatch(name):
        raise ValueError("no usable 'name' (the DAG id)")
    if not isinstance(output, dict) or not isinstance(output.get("path"), str) or not output["path"]:
        raise ValueError("no output.path")
    conn_id = output.get("conn_id")
    if conn_id is not None and not isinstance(conn_id, str):
        raise ValueError("output.conn_id is not a string")
    out = output["path"]
    if out.startswith(("./", "../")):  # relative to the YAML's folder, as load_config resolves it
        out = str((path.parent / out).resolve())
    url, conn = split_conn(out)
    return Root(join_url(url, name), conn_id or conn, name, path.name)


def configured_roots() -> list[Root]:
    """Every pipeline's ``<output.path>/<name>``, then the ``$BATCH_LLM_REPORT_ROOTS`` prefixes."""
    roots: list[Root] = []
    folder = pipelines_folder()
    for path in sorted(folder.glob("*.y*ml")) if folder.is_dir() else []:
        try:
            roots.append(pipeline_root(path))
        except (ValueError, OSError) as e:
            log.warning("report roots: skipping %s: %s", path, str(e).splitlines()[0])
    for item in filter(None, (s.strip() for s in os.environ.get(ROOTS_ENV, "").split(","))):
        url, conn = split_conn(item)
        roots.append(Root(url.rstrip("/") or "/", conn, None, ROOTS_ENV))
    return roots


_roots_lock = threading.Lock()
_roots_cache: tuple[float, list[Root]] = (0.0, [])


def allowed_roots() -> list[Root]:
    """``configured_roots()``, re-read at most every ``ROOTS_TTL_SECONDS`` (new pipeline files show up)."""
    global _roots_cache
    with _roots_lock:
        at, roots = _roots_cache
        if time.monotonic() - at > ROOTS_TTL_SECONDS or not at:
            roots = configured_roots()
            _roots_cache = (time.monotonic(), roots)
        return roots


@dataclass(frozen=True)
class Resolved:
    url: str            # normalized: a realpath for local files
    root: Root
    dag_id: str


def resolve(path: str, roots: list[Root] | None = None) -> Resolved:  # noqa: C901
    """The root that ``path`` lies under and the DAG it belongs to; ReportError(403) when there is none."""
    if not path:
        raise ReportError(400, "query parameter 'path' is required")
    if "\x00" in path or "\\" in path:
        raise ReportError(400, "invalid path")
    url, conn = split_conn(path)
    if conn:
        raise ReportError(400, "name the connection with the conn_id parameter, not inside the path")
    if not url.lower().endswith(".html"):
        raise ReportError(403, "only HTML reports are served")
    roots = allowed_roots() if roots is None else roots
    resolved = path_policy.resolve(url)
    if resolved.is_local:
        target = _norm_local(url)
        for root in roots:
            if not root.local:
                continue
            base = _norm_local(root.url)
            if target != base and os.path.commonpath([target, base]) == base:
                return Resolved(target, root, root.dag_id or Path(os.path.relpath(target, base)).parts[0])
    elif resolved.kind == "storage" and not resolved.wrapped:  # anything else (http, zip::, simplecache::) is refused
        scheme, rest = url.split("://", 1)
        parts = rest.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ReportError(403, "path not allowed")
        for root in roots:
            if root.local:
                continue
            rscheme, rrest = root.url.split("://", 1)
            rparts = [p for p in rrest.split("/") if p]
            if rscheme == scheme and len(parts) > len(rparts) and parts[:len(rparts)] == rparts:
                return Resolved(url, root, root.dag_id or parts[len(rparts)])
    raise ReportError(403, "path is not under an allowed report root (a pipeline's output path or "
                           f"${ROOTS_ENV})")


# ------------------------------------------------------------------------------------------ auth
async def current_user(request: Any) -> Any:
    """Airflow's own ``get_user``: Bearer token first, else the UI's ``_token`` cookie (or the user the
    JWT refresh middleware already resolved from it). Raises 401 without a token, 403 for an invalid one."""
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.security import HTTPBearer

    bearer = await HTTPBearer(auto_error=False)(request)
    return await get_user(request=request, _oauth_token=None, bearer_credentials=bearer)


def can_read_dag(user: Any, dag_id: str) -> bool:
    return dag_access(user, dag_id, "GET")


def dag_access(user: Any, dag_id: str, method: Literal["GET", "POST", "PUT", "DELETE"]) -> bool:
    """Whether the auth manager lets ``user`` do ``method`` (GET: read, POST: trigger) on the DAG's runs."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
    from airflow.models.dag import DagModel

    try:
        team = DagModel.get_team_name(dag_id)
    except Exception:  # noqa: BLE001 - no such DAG (yet): authorize without a team
        team = None
    return get_auth_manager().is_authorized_dag(method=method, access_entity=DagAccessEntity.RUN,
                                                details=DagDetails(id=dag_id, team_name=team), user=user)


# ------------------------------------------------------------------------------------------ reading
def _location(r: Resolved, conn_id: str | None):
    from batch_llm.io.storage import Location

    if r.root.local:
        return Location(r.url)
    # The root's own connection only: a caller's conn_id would lend its credentials to any bucket a root
    # without one covers.
    if conn_id and conn_id != r.root.conn_id:
        raise ReportError(403, f"connection {conn_id!r} is not the one configured for this path")
    from batch_llm_airflow.hooks import BatchLlmStorageHook

    return BatchLlmStorageHook(r.root.conn_id).location(r.url)


def read_report(path: str, conn_id: str | None, user: Any) -> bytes:
    r = resolve(path)
    if not can_read_dag(user, r.dag_id):
        raise ReportError(403, f"no read access to DAG {r.dag_id!r}")
    loc = _location(r, conn_id)
    p = loc.path()
    try:
        size = p.stat().st_size if r.root.local else p.fs.size(p.path)
        if size is not None and size > MAX_REPORT_BYTES:
            raise ReportError(413, "report too large")
        return p.read_bytes()
    except FileNotFoundError:
        raise ReportError(404, "no report at this path") from None
    except ReportError:
        raise
    except OSError as e:
        raise ReportError(502, f"cannot read the report: {type(e).__name__}") from None


def recent_reports(user: Any, limit: int = INDEX_MAX) -> list[dict]:
    """``report.html`` of published versions (``<root>/[<pipeline>/]<partition>/v-*/report.html``) under
    the roots of DAGs the user may read, newest version name first."""
    from batch_llm.io.storage import Location

    from batch_llm_airflow.hooks import BatchLlmStorageHook

    out: list[dict] = []
    for root in allowed_roots():
        pattern = "*/v-*/report.html" if root.dag_id else "*/*/v-*/report.html"
        if root.dag_id and not can_read_dag(user, root.dag_id):
            continue
        try:
            base = Location(root.url) if root.local else BatchLlmStorageHook(root.conn_id).location(root.url)
            found = list(base.path().glob(pattern))
        except Exception as e:  # noqa: BLE001 - one unreachable store must not hide the others
            log.warning("listing reports under %s failed: %s", root.url, e)
            continue
        for f in found:
            url = _norm_local(str(f)) if root.local else f"{f.protocol}://{f.path}"
            rel = posixpath.relpath(url, root.url if not root.local else _norm_local(root.url)).split("/")
            dag_id = root.dag_id or rel[0]
            if not root.dag_id and not can_read_dag(user, dag_id):
                continue
            out.append({"dag_id": dag_id, "partition": rel[-3], "version": rel[-2], "url": url,
                        "conn_id": root.conn_id})
    out.sort(key=lambda d: d["version"].split("-")[1] if "-" in d["version"] else "", reverse=True)
    return out[:limit]


def report_href(url: str, conn_id: str | None = None) -> str:
    """The link to a report through this app (what the "Run report" button of the publish task opens)."""
    q = {"path": url, **({"conn_id": conn_id} if conn_id else {})}
    return f"{URL_PREFIX}/report?{urlencode(q, quote_via=quote)}"


def render_index(reports: list[dict]) -> str:
    """The list page. Its links open in place: inside the UI it is an iframe sandboxed without popups."""
    from batch_llm.analysis.templates import render

    rows = [{"dag_id": r["dag_id"], "partition": r["partition"], "version": r["version"],
             "href": report_href(r["url"], r["conn_id"])} for r in reports]
    return render("report_index.html.j2", reports=rows)


# ------------------------------------------------------------------------------------------ the app
def create_app() -> "FastAPI":
    from fastapi import Depends, FastAPI, HTTPException, Query, Request
    from fastapi.responses import HTMLResponse, JSONResponse
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="batch-llm reports", docs_url=None, redoc_url=None, openapi_url=None)

    async def user_dep(request: Request) -> Any:
        return await current_user(request)

    @app.exception_handler(ReportError)
    async def _report_error(request: Request, exc: ReportError):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers={"Cache-Control": "no-store"})

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        """401/403 from authentication: JSON for API clients, a short page with a login link for browsers."""
        if exc.status_code == 401 and "text/html" in request.headers.get("accept", ""):
            try:
                from airflow.api_fastapi.app import get_auth_manager

                login = get_auth_manager().get_url_login(next_url=str(request.url))
            except Exception:  # noqa: BLE001
                login = "/"
            body = (f'<!doctype html><meta charset="utf-8"><title>Sign in</title><p>Sign in to Airflow to see '
                    f'this report: <a href="{html.escape(login)}">log in</a>.</p>')
            return HTMLResponse(body, status_code=401, headers={**SECURITY_HEADERS, **(exc.headers or {})})
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.get("/report", response_class=HTMLResponse)
    async def report(path: str = Query("", description="URL of a report.html in object storage"),
                     conn_id: str | None = Query(None, description="Airflow connection for s3:// paths"),
                     user: Any = Depends(user_dep)) -> HTMLResponse:
        data = await run_in_threadpool(read_report, path, conn_id, user)
        return HTMLResponse(data, headers=SECURITY_HEADERS)

    @app.get("/", response_class=HTMLResponse)
    async def index(user: Any = Depends(user_dep)) -> HTMLResponse:
        reports = await run_in_threadpool(recent_reports, user)
        return HTMLResponse(render_index(reports), headers=SECURITY_HEADERS)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app
