"""The OpenAI Batch API in Airflow's API server: a FastAPI app that the plugin (``plugin.py``) mounts at ``/openai``,
so an OpenAI client reaches it with ``base_url=<Airflow>/openai/v1`` and an Airflow token as its ``api_key``::

    POST   /openai/v1/files                    upload (multipart, purpose=batch), streamed into the store
    GET    /openai/v1/files[?purpose&limit&order&after]
    GET    /openai/v1/files/{id}               the File object
    GET    /openai/v1/files/{id}/content       the bytes, streamed
    DELETE /openai/v1/files/{id}
    POST   /openai/v1/batches                  a run of the pipeline serving the file's model
    GET    /openai/v1/batches[?after&limit]    newest first
    GET    /openai/v1/batches/{id}
    POST   /openai/v1/batches/{id}/cancel

The logic is ``batch_llm.batch_api`` (no Airflow there); this module is the HTTP, the user and the DAG run.

Who may do what: the user comes from Airflow's ``get_user`` (a ``Bearer`` JWT: the client's api_key, from
``POST /auth/token``; 401 without one, 403 for an invalid one). A file is its uploader's; a batch's output and error
files are also readable by whoever may read the batch. A batch is seen by users who may read its pipeline's DAG
runs (``is_authorized_dag`` GET), created and cancelled by users who may trigger them (POST). Errors are OpenAI's
shape (``{"error": {"message", "type", "param", "code"}}``).

A batch is a DAG run: ``POST /v1/batches`` triggers one with Airflow's own trigger route function (run id = the
batch id, the Param ``openai_batch_id`` = the batch id), and a batch's status is read from that run, its tasks and
the manifests they committed (``batch_api.status``). A cancel is a note in the store that the run's shard tasks
watch: they stop their engines and the run publishes what was answered (``batch_api.stop``).

Nothing heavy is imported at module level (Airflow loads every plugin file in every task process too).
"""
# No ``from __future__ import annotations``: FastAPI reads the route functions' annotations as objects.
import logging
from typing import TYPE_CHECKING, Any, Literal

from batch_llm.batch_api.errors import ApiError

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("batch_llm_airflow.openai_app")

URL_PREFIX = "/openai"
MAX_FIELD_BYTES = 4096  # a form field other than the file (purpose): small


def _user_id(user: Any) -> str:
    return str(user.get_id())


def _dag_access(user: Any, dag_id: str, method: Literal["GET", "POST", "PUT", "DELETE"]) -> bool:
    from batch_llm_airflow.report_app import dag_access

    return dag_access(user, dag_id, method)


def _pipelines():
    from batch_llm.batch_api.runs import serving_pipelines

    from batch_llm_airflow.report_app import pipelines_folder

    found, problems = serving_pipelines(pipelines_folder())
    for p in problems:
        log.warning("OpenAI Batch API: %s", p)
    return found


def _store():
    from batch_llm_airflow.batch_runs import batch_store

    return batch_store()[0]


# ------------------------------------------------------------------------------------------ files
def _file_visible(user: Any, meta: dict) -> bool:
    if meta.get("owner") == _user_id(user):
        return True
    return bool(meta.get("dag_id")) and _dag_access(user, meta["dag_id"], "GET")


def _visible_file(store, user: Any, file_id: str) -> dict:
    from batch_llm.batch_api.errors import not_found

    meta = store.file(file_id)
    if not _file_visible(user, meta):
        raise not_found("file", file_id)
    return meta


class _MultipartUpload:
    """python-multipart's streaming parser's callbacks: the ``file`` part's bytes gathered per body chunk
    (``take``), the other fields (``purpose``) kept small."""

    def __init__(self, store, owner: str) -> None:
        self.store, self.owner = store, owner
        self.fields: dict[str, str] = {}
        self.headers: dict[bytes, bytes] = {}
        self.upload: Any = None
        self.name: str | None = None
        self._header, self._value, self._field = b"", b"", bytearray()
        self.pending = bytearray()

    def callbacks(self) -> Any:  # python-multipart's MultipartCallbacks (a TypedDict)
        return {"on_header_field": self.on_header_field, "on_header_value": self.on_header_value,
                "on_header_end": self.on_header_end, "on_headers_finished": self.on_headers_finished,
                "on_part_data": self.on_part_data, "on_part_end": self.on_part_end}

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def on_header_end(self) -> None:
        self.headers[self._header.lower()] = self._value
        self._header, self._value = b"", b""

    def on_headers_finished(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, disp = parse_options_header(self.headers.get(b"content-disposition", b""))
        self.name = disp.get(b"name", b"").decode("utf-8", "replace")
        self._field = bytearray()
        if self.name != "file":
            return
        if self.upload is not None:
            raise ApiError(400, "Only one 'file' part.", param="file", code="invalid_request")
        filename = disp.get(b"filename", b"").decode("utf-8", "replace") or "upload.jsonl"
        self.upload = self.store.begin_upload(owner=self.owner, filename=filename, purpose="batch")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.name == "file":
            self.pending.extend(data[start:end])
            return
        self._field += data[start:end]
        if len(self._field) > MAX_FIELD_BYTES:
            raise ApiError(400, f"Form field {self.name!r} is too long.", param=self.name, code="invalid_request")

    def on_part_end(self) -> None:
        if self.name != "file" and self.name is not None:
            self.fields[self.name] = self._field.decode("utf-8", "replace")
        self.headers = {}

    def take(self) -> bytes:
        data = bytes(self.pending)
        self.pending.clear()
        return data

    def check_fields(self) -> None:
        if self.upload is None:
            raise ApiError(400, "Missing the 'file' part.", param="file", code="missing_required_parameter")
        unknown = sorted(k for k in self.fields if k != "purpose")
        if unknown:
            raise ApiError(400, f"{unknown[0]} is not supported here (files are kept until deleted)" if
                           unknown[0].startswith("expires_after") else f"Unrecognized field {unknown[0]!r}.",
                           param=unknown[0], code="unsupported_value")
        if self.fields.get("purpose") != "batch":
            raise ApiError(400, f"Invalid purpose {self.fields.get('purpose')!r}: this server takes files for "
                                "batches only ('batch').", param="purpose", code="invalid_value")


async def _upload(request: Any, user: Any) -> dict:
    """The multipart body parsed as it arrives: the file part's bytes go to the store chunk by chunk, never
    whole in memory or on the API server's disk (FastAPI's UploadFile would spool them to a temporary file)."""
    from python_multipart.multipart import MultipartParser, parse_options_header
    from starlette.concurrency import run_in_threadpool

    ctype, opts = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not opts.get(b"boundary"):
        raise ApiError(400, "Expected a multipart/form-data body with a 'file' part and a 'purpose' field.",
                       param="file", code="invalid_request")
    form = _MultipartUpload(_store(), _user_id(user))
    parser = MultipartParser(opts[b"boundary"], form.callbacks())
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            if form.pending:
                await run_in_threadpool(form.upload.write, form.take())
        parser.finalize()
        form.check_fields()
        return await run_in_threadpool(form.upload.commit)
    except BaseException:
        if form.upload is not None:
            await run_in_threadpool(form.upload.abort)
        raise


# ------------------------------------------------------------------------------------------ batches
def _run_view(record: dict):
    """The DAG run of a batch and its task instances, from Airflow's database."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from batch_llm.batch_api.status import RunView, TaskView

    def ts(t: Any) -> int | None:
        return int(t.timestamp()) if t is not None else None

    with create_session() as session:  # the Session's query(): no SQLAlchemy import of our own
        dr = session.query(DagRun).filter(DagRun.dag_id == record["pipeline"],
                                          DagRun.run_id == record["id"]).one_or_none()
        if dr is None:
            return None
        tasks: dict[str, list] = {}
        for ti in session.query(TaskInstance).filter(TaskInstance.dag_id == record["pipeline"],
                                                     TaskInstance.run_id == record["id"]):
            tasks.setdefault(ti.task_id.rsplit(".", 1)[-1], []).append(
                TaskView(str(ti.state) if ti.state else None, ts(ti.start_date), ts(ti.end_date)))
        state = str(dr.state.value if hasattr(dr.state, "value") else dr.state)
        return RunView(state, ts(dr.end_date) if state in ("success", "failed") else None, tasks)


def _layout(record: dict, pipelines: list):
    from batch_llm.io.storage import Location
    from batch_llm.layout import RunLayout

    from batch_llm_airflow.hooks import BatchLlmStorageHook
    from batch_llm_airflow.storage_bridge import split_conn

    p = next((p for p in pipelines if p.dag_id == record["pipeline"]), None)
    if p is None:
        return None
    url, conn = split_conn(p.output_path)
    root = BatchLlmStorageHook(p.output_conn_id or conn).location(url)
    return RunLayout(output_root=root, pipeline=p.dag_id, partition=record["id"], run_id=record["id"],
                     input=Location(""))


def _batch_object(store, record: dict, pipelines: list | None = None) -> dict:
    from batch_llm.batch_api.status import batch_object

    pipelines = _pipelines() if pipelines is None else pipelines
    return batch_object(record, _run_view(record), store, _layout(record, pipelines))


def _visible_batch(store, user: Any, batch_id: str, method: Literal["GET", "POST"] = "GET") -> dict:
    from batch_llm.batch_api.errors import not_found

    record = store.batch(batch_id)
    if not _dag_access(user, record["pipeline"], "GET"):
        raise not_found("batch", batch_id)
    if method != "GET" and not _dag_access(user, record["pipeline"], method):
        raise ApiError(403, f"You may not change runs of pipeline {record['pipeline']!r}.", type="permission_error")
    return record


def _trigger(record: dict, user: Any, request: Any) -> None:
    """A run of the batch's pipeline through Airflow's own trigger route function (its checks: the DAG exists,
    has no import errors, allows manual runs; the Params validated)."""
    from airflow.api_fastapi.core_api.datamodels.dag_run import TriggerDAGRunPostBody
    from airflow.api_fastapi.core_api.routes.public.dag_run import trigger_dag_run
    from airflow.models.dag import DagModel
    from airflow.models.dagbag import DBDagBag
    from airflow.utils.session import create_session
    from batch_llm.batch_api.runs import PARAM
    from fastapi import HTTPException

    dag_id = record["pipeline"]
    with create_session() as session:
        dm = session.query(DagModel).filter(DagModel.dag_id == dag_id).one_or_none()
        if dm is not None and dm.is_paused:
            raise ApiError(400, f"The pipeline {dag_id!r} serving model {record['model']!r} is paused: unpause its "
                                "DAG to run batches.", param="model", code="model_not_available")
        try:
            trigger_dag_run(dag_id=dag_id, body=TriggerDAGRunPostBody(dag_run_id=record["id"], logical_date=None,
                                                                      conf={PARAM: record["id"]},
                                                                      note=f"OpenAI batch {record['id']}"),
                            dag_bag=DBDagBag(), user=user, session=session, request=request)
        except HTTPException as e:
            raise ApiError(e.status_code if e.status_code < 500 else 503,
                           f"The pipeline {dag_id!r} cannot run the batch: {e.detail}", param="model",
                           code="model_not_available") from None


def create_batch(store, user: Any, body: Any, request: Any) -> dict:
    from batch_llm.batch_api.runs import create_batch as create_record
    from batch_llm.io.storage import remove_tree

    pipelines = _pipelines()
    record, serving = create_record(store, pipelines, owner=_user_id(user), body=body)
    try:
        if not _dag_access(user, serving.dag_id, "POST"):
            raise ApiError(403, f"You may not run batches of model {record['model']!r} (pipeline "
                                f"{serving.dag_id!r}).", type="permission_error")
        _trigger(record, user, request)
    except BaseException:
        remove_tree(store.batch_dir(record["id"]).path())
        raise
    return _batch_object(store, record, pipelines)


def cancel_batch(store, user: Any, batch_id: str) -> dict:
    from batch_llm.batch_api.runs import request_cancel

    record = _visible_batch(store, user, batch_id, "POST")
    now = _batch_object(store, record)
    if now["status"] in ("completed", "failed", "expired", "cancelled"):
        raise ApiError(409, f"Cannot cancel a batch with status '{now['status']}'.", code="batch_not_cancellable")
    request_cancel(store, batch_id)
    return _batch_object(store, record)


def _limit(value: Any, most: int, default: int) -> int:
    if value is None:
        return default
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if not 1 <= n <= most:
        raise ApiError(400, f"Invalid limit {value!r}: between 1 and {most}.", param="limit", code="invalid_value")
    return n


# ------------------------------------------------------------------------------------------ the app
def _error_handlers(app: Any) -> None:
    """Every refusal in OpenAI's error shape: ours, Airflow's authentication's (401/403), FastAPI's validation."""
    from fastapi import HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        # Airflow's get_user: 401 without a token, 403 for an invalid one; OpenAI answers both 401 invalid_api_key
        # (this app's own refusals are ApiError, never an HTTPException)
        if exc.status_code in (401, 403):
            return JSONResponse(ApiError(401, f"Incorrect API key provided (an Airflow token): {exc.detail}",
                                         type="invalid_request_error", code="invalid_api_key").body(),
                                status_code=401)
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(ApiError(400, str(first.get("msg", "invalid request")), param=param).body(),
                            status_code=400)


def _file_routes(app: Any, user_dep: Any) -> None:
    from batch_llm.batch_api.store import MAX_FILE_PAGE, iter_chunks, public_file
    from fastapi import Depends, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    @app.post("/v1/files")
    async def upload_file(request: Request, user: Any = Depends(user_dep)) -> JSONResponse:
        return JSONResponse(public_file(await _upload(request, user)))

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int | None = None, order: str = "desc",
                         after: str | None = None, user: Any = Depends(user_dep)) -> JSONResponse:
        n = _limit(limit, MAX_FILE_PAGE, MAX_FILE_PAGE)
        store = _store()
        data, more = await run_in_threadpool(store.files, lambda m: _file_visible(user, m), purpose=purpose,
                                             after=after, limit=n, order=order)
        return JSONResponse(_list([public_file(m) for m in data], more))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, user: Any = Depends(user_dep)) -> JSONResponse:
        return JSONResponse(public_file(await run_in_threadpool(_visible_file, _store(), user, file_id)))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, user: Any = Depends(user_dep)) -> StreamingResponse:
        store = _store()
        meta = await run_in_threadpool(_visible_file, store, user, file_id)
        f = await run_in_threadpool(store.open_content, file_id)
        return StreamingResponse(iter_chunks(f), media_type="application/octet-stream",
                                 headers={"Content-Length": str(meta["bytes"])})

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, user: Any = Depends(user_dep)) -> JSONResponse:
        store = _store()
        meta = await run_in_threadpool(_visible_file, store, user, file_id)
        if meta.get("owner") != _user_id(user):
            raise ApiError(403, "Only the file's owner may delete it.", type="permission_error")
        return JSONResponse(await run_in_threadpool(store.delete_file, file_id))


def _list(data: list[dict], more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _batch_routes(app: Any, user_dep: Any) -> None:
    from batch_llm.batch_api.store import MAX_BATCH_PAGE
    from fastapi import Depends, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    @app.post("/v1/batches")
    async def create(request: Request, user: Any = Depends(user_dep)) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "The body is not JSON.") from None
        return JSONResponse(await run_in_threadpool(create_batch, _store(), user, body, request))

    @app.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int | None = None,
                           user: Any = Depends(user_dep)) -> JSONResponse:
        n = _limit(limit, MAX_BATCH_PAGE, 20)

        def page() -> dict:
            store, pipelines = _store(), _pipelines()
            records, more = store.batches(lambda r: _dag_access(user, r["pipeline"], "GET"), after=after, limit=n)
            return _list([_batch_object(store, r, pipelines) for r in records], more)

        return JSONResponse(await run_in_threadpool(page))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, user: Any = Depends(user_dep)) -> JSONResponse:
        def get() -> dict:
            store = _store()
            return _batch_object(store, _visible_batch(store, user, batch_id))

        return JSONResponse(await run_in_threadpool(get))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, user: Any = Depends(user_dep)) -> JSONResponse:
        return JSONResponse(await run_in_threadpool(cancel_batch, _store(), user, batch_id))


def create_app() -> "FastAPI":
    from fastapi import FastAPI, Request

    from batch_llm_airflow.report_app import current_user

    app = FastAPI(title="batch-llm OpenAI Batch API", docs_url=None, redoc_url=None, openapi_url=None)

    async def user_dep(request: Request) -> Any:
        return await current_user(request)

    _error_handlers(app)
    _file_routes(app, user_dep)
    _batch_routes(app, user_dep)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app
