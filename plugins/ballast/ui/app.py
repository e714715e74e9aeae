"""The "Training stability" view: a FastAPI app the Airflow API server mounts (`ballast.ui.plugin`).

Airflow does not protect a plugin's app, so every route here asks the API server's own security
dependencies: `get_user` (the viewer's token from the Authorization header or the UI's `_token` cookie:
none is 401, a bad one 401/403) and, for anything of one pipeline, `requires_access_dag` (read access to
that DAG's runs, per request: 403). Static files included.

Pages are HTML shells that fetch the JSON routes and draw with uPlot, vendored under `static/uplot/`
(no CDN: the UI works with no internet access). A run id, a DAG id or a record is never markup: the
shell is one Jinja template step with autoescape (the config as a JSON data element, `tojson`), the
static script sets text only as text, and the shell's Content-Security-Policy allows no inline script
and no script from anywhere but the app's static folder (`_page_csp`). Summaries come from the run
records in the pipeline's storage (`ballast.ui.summary`), cached: a finished run's for good (its records
no longer change), a running one's for `LIVE_SECONDS`. Routes are plain `def`s: FastAPI runs them in its thread pool, so a
slow storage read never blocks the API server's event loop. Concurrent requests for one summary
compute it once (`_Cache`). A storage error is a 503 naming the pipeline; its cause (URIs, endpoints)
goes to the API server's log only.
"""

from __future__ import annotations

import logging
import mimetypes
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.core_api.security import GetUserDep, get_user, requires_access_dag
from ballast.errors import StorageError
from ballast.ui import summary
from ballast.ui.pipelines import Catalog

STATIC = Path(__file__).parent / "static"
LIVE_SECONDS = 5.0
PIPELINE_SECONDS = 30.0  # the pipeline page reads every run's attempt history: kept longer
CACHED_RUNS = 256
MAX_DOCS_BYTES = 32 << 20  # one Data Docs page or asset: GX writes kilobytes
PIPELINE_RUNS, MAX_PIPELINE_RUNS = 50, 500  # the pipeline page's newest runs: by default, and at most
READ_RUNS = Depends(requires_access_dag("GET", DagAccessEntity.RUN))
# The view's own pages: scripts from this app's static folder only (none inline; `{scripts}`, see
# `_page_csp`), styles from this app, data from its routes.
PAGE_CSP = ("default-src 'none'; script-src {scripts}; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'self'")
_HOST = re.compile(r"(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
"""A Host header that is a CSP host-part and port: anything else (no host) gets no script source."""
log = logging.getLogger(__name__)


class _Cache:
    """Summaries by key, least recently used out first. Single flight: a miss computes while requests
    for the same key wait for that result (or its error) instead of reading storage again each."""

    def __init__(self, size: int):
        self._items: OrderedDict[tuple, tuple[float | None, Any]] = OrderedDict()
        self._flights: dict[tuple, Future] = {}
        self._size, self._lock = size, threading.Lock()

    def get(self, key: tuple, make, *, final, ttl: float = LIVE_SECONDS) -> Any:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and (hit[0] is None or hit[0] > time.monotonic()):
                self._items.move_to_end(key)
                return hit[1]
            flight = self._flights.get(key)
            if flight is None:
                flight = self._flights[key] = Future()
                leader = True
            else:
                leader = False
        if not leader:
            return flight.result()
        try:
            value = make()
            expires = None if final(value) else time.monotonic() + ttl
        except BaseException as exc:
            with self._lock:
                del self._flights[key]
            flight.set_exception(exc)  # the waiters' answer too; the next request tries again
            raise
        with self._lock:
            self._items[key] = (expires, value)
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
            del self._flights[key]
        flight.set_result(value)
        return value


def create_app(catalog: Catalog | None = None) -> FastAPI:
    catalog = catalog or Catalog()
    cache = _Cache(CACHED_RUNS)
    app = FastAPI(title="Ballast training stability", dependencies=[Depends(get_user)],
                  docs_url=None, redoc_url=None, openapi_url=None)

    def storage_of(dag_id: str):
        storage = catalog.storage(dag_id)
        if storage is None:
            raise HTTPException(404, f"{dag_id} is not a Ballast pipeline (no spec of it in the view's spec folder)")
        return storage

    def run_data(dag_id: str, run_id: str) -> dict:
        storage = storage_of(dag_id)
        _no_dots(run_id)
        data = cache.get(("run", dag_id, run_id), lambda: summary.run_summary(storage, dag_id, run_id),
                         final=lambda d: d is not None and d["status"] == "finished")
        if data is None:
            raise HTTPException(404, f"run {run_id!r} of {dag_id} has no records in the pipeline's storage")
        return data

    @app.get("/api/pipelines")
    def pipelines(user: GetUserDep) -> dict:
        from airflow.api_fastapi.app import get_auth_manager

        known = catalog.pipelines()
        allowed = get_auth_manager().filter_authorized_dag_ids(dag_ids=set(known), user=user)
        return {"pipelines": [{"dag_id": p.dag_id, "name": p.name, "storage": p.storage_uri}
                              for d, p in sorted(known.items()) if d in allowed]}

    @app.get("/api/pipelines/{dag_id}", dependencies=[READ_RUNS])
    def pipeline_json(dag_id: str, limit: int = Query(PIPELINE_RUNS, ge=1, le=MAX_PIPELINE_RUNS)) -> dict:
        storage = storage_of(dag_id)
        return cache.get(("pipeline", dag_id, limit), lambda: summary.pipeline_summary(storage, dag_id, limit=limit),
                         final=lambda d: False, ttl=PIPELINE_SECONDS)

    @app.get("/api/runs/{dag_id}/{run_id}", dependencies=[READ_RUNS])
    def run_json(dag_id: str, run_id: str) -> dict:
        return run_data(dag_id, run_id)

    @app.get("/runs/{dag_id}/{run_id}/data_docs/{path:path}", dependencies=[READ_RUNS])
    def data_docs(dag_id: str, run_id: str, path: str) -> Response:
        storage = storage_of(dag_id)
        _no_dots(run_id)
        rel = PurePosixPath(path)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or "\\" in path:
            raise HTTPException(404, "no such Data Docs page")
        key = f"{summary.run_prefix(storage, dag_id, run_id)}/data_docs/{rel}"
        if not storage.exists(key):
            raise HTTPException(404, f"no Data Docs page {path!r} for this run")
        if storage.size(key) > MAX_DOCS_BYTES:  # a bounded read, like every record the view reads
            raise HTTPException(413, f"Data Docs page {path!r} is over {MAX_DOCS_BYTES >> 20} MiB; open it from storage")
        kind = mimetypes.guess_type(rel.name)[0] or "application/octet-stream"
        # Rendered from data: its scripts run in a sandbox of their own origin, never as the viewer.
        with storage.open_read(key) as f:
            body = f.read(MAX_DOCS_BYTES + 1)[:MAX_DOCS_BYTES]
        return Response(body, media_type=kind,
                        headers={"Content-Security-Policy": "sandbox allow-scripts", "X-Content-Type-Options": "nosniff"})

    @app.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse, dependencies=[READ_RUNS])
    def run_page(request: Request, dag_id: str, run_id: str) -> HTMLResponse:
        run_data(dag_id, run_id)  # 404 here, not as an empty page
        return _page(request, "run", f"{dag_id} / {run_id}",
                     api=_url(request, "run_json", dag_id=dag_id, run_id=run_id),
                     docs=_url(request, "data_docs", dag_id=dag_id, run_id=run_id, path="index.html"),
                     dag_id=dag_id, run_id=run_id)

    @app.get("/pipelines/{dag_id}", response_class=HTMLResponse, dependencies=[READ_RUNS])
    def pipeline_page(request: Request, dag_id: str) -> HTMLResponse:
        storage_of(dag_id)
        return _page(request, "pipeline", dag_id, api=_url(request, "pipeline_json", dag_id=dag_id),
                     runs=_url(request, "run_page", dag_id=dag_id, run_id="~RUN~"), dag_id=dag_id)

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request) -> HTMLResponse:
        return _page(request, "overview", "Ballast pipelines", api=_url(request, "pipelines"),
                     pipeline=_url(request, "pipeline_page", dag_id="~DAG~"))

    @app.get("/static/{name:path}")
    def static(name: str) -> Response:
        path = (STATIC / name).resolve()
        if not path.is_file() or STATIC.resolve() not in path.parents:
            raise HTTPException(404, "no such file")
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return Response(path.read_bytes(), media_type=kind, headers={"Cache-Control": "private, max-age=3600",
                                                                     "X-Content-Type-Options": "nosniff"})

    @app.exception_handler(StorageError)
    def _storage_error(request: Request, exc: StorageError) -> Response:
        # The cause names buckets, prefixes and endpoints: for the operator's log, not for every viewer.
        dag_id = request.path_params.get("dag_id", "?")
        log.warning("Training stability view: %s: the storage of %s could not be read: %s", request.url.path,
                    dag_id, exc)
        return JSONResponse({"detail": f"the storage of pipeline {dag_id} could not be read (the API server's log "
                                       "has the cause)"}, status_code=503)

    return app


def _no_dots(run_id: str) -> None:
    """'.' and '..' name no run (Airflow refuses such run ids); as a key part they would leave the prefix."""
    if not run_id.strip("."):
        raise HTTPException(404, f"no run {run_id!r}")


def _url(request: Request, route: str, /, **params: str) -> str:
    """A path of this app as the browser sees it. Mounted under Airflow's API server, the request's
    router is the root app's (`request.url_for` cannot find our routes): our own router, after the
    mount's root path."""
    from urllib.parse import quote

    path = request.app.url_path_for(route, **{k: quote(v, safe="") for k, v in params.items()})
    return request.scope.get("root_path", "").rstrip("/") + str(path)


@lru_cache(maxsize=1)
def _template():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(STATIC), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    return env.get_template("page.html")


def _page_csp(request: Request, static: str) -> str:
    """PAGE_CSP with scripts allowed from `static` (this app's static folder, as the browser sees it) and
    nowhere else on the origin: 'self' would allow any same-origin URL, a Data Docs page served by this
    app (from data) or another app's file included. A path restricts only a source that names a host
    (CSP3, host-source with a path-part; a path ending in '/' matches the files under it), so the source
    is the request's scheme, host and port plus the path. An http source matches the page served over
    https too (CSP3 upgrades the scheme), for a server behind a TLS proxy."""
    from urllib.parse import quote

    url = request.url
    if url.scheme not in ("http", "https") or not _HOST.fullmatch(url.netloc):
        return PAGE_CSP.format(scripts="'none'")
    # ';' and ',' end a source or a policy: percent-encoded, as CSP paths are matched.
    return PAGE_CSP.format(scripts=f"{url.scheme}://{url.netloc}{quote(static, safe='/-._~%')}")


def _page(request: Request, kind: str, title: str, **config: str) -> HTMLResponse:
    """The page shell: one template step, every value escaped for where it goes (text and attributes:
    HTML-escaped; the config: JSON whose '<', '>', '&' and quotes are escapes, so it cannot end its element)."""
    static = _url(request, "static", name="")
    body = _template().render(title=title, static=static, config={"kind": kind, **config})
    return HTMLResponse(body, headers={"Cache-Control": "no-store",
                                       "Content-Security-Policy": _page_csp(request, static),
                                       "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"})


app = create_app()
