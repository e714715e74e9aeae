"""The Training stability view's app, in process (FastAPI's test client, Airflow's auth dependencies
replaced): pages whose run id, DAG id or title holds markup or template placeholders render it as text,
under a Content-Security-Policy with no inline script; one computation per summary however many
requests miss at once; a storage error is a 503 that names the pipeline, not its storage; the pipeline
page reads its newest runs only and no run's checkpoint shards."""

from __future__ import annotations

import json
import logging
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import pytest
from ballast.errors import StorageError
from ballast.records import AttemptHistory
from ballast.storage import FileStorage

pytestmark = pytest.mark.unit

DAG = "ballast_demo"
CRAFTED = "{{CONFIG}}<svg onload=alert(1)>"


class _Catalog:
    """What the app asks of `ballast.ui.pipelines.Catalog`: dag_id -> storage."""

    directory = Path("/nowhere")

    def __init__(self, storages: dict):
        self._storages = storages

    def storage(self, dag_id: str):
        return self._storages.get(dag_id)

    def pipelines(self) -> dict:
        return {}


def _client(storages: dict):
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.testclient import TestClient

    from ballast.ui import app as ui

    app = ui.create_app(_Catalog(storages))
    app.dependency_overrides[get_user] = lambda: None  # the auth dependencies have tests of their own (test_ui.py)
    app.dependency_overrides[ui.READ_RUNS.dependency] = lambda: None
    return TestClient(app)


def _history(started: float) -> str:
    from ballast.records import Attempt

    a = Attempt(try_number=1, outcome="success", host="vm", started=started, ended=started + 100,
                first_step_at=started + 5, step_reached=50, settings={}, adaptation=[])
    return AttemptHistory(task_id="train", attempts=[a]).model_dump_json()


def _run(storage: FileStorage, run_id: str, *, started: float = 1000.0) -> str:
    from ballast.ui.summary import run_prefix

    prefix = run_prefix(storage, DAG, run_id)
    storage.write_bytes(f"{prefix}/attempts/train.json", _history(started).encode())
    return prefix


class _Tags(HTMLParser):
    """Every element of a page with its attributes, and the text of each h1, title and script."""

    def __init__(self, body: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: dict[str, list[str]] = {}
        self._open: str | None = None
        self.feed(body)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._open = tag if tag in ("h1", "title", "script") else None

    def handle_endtag(self, tag):
        self._open = None

    def handle_data(self, data):
        if self._open:
            self.text.setdefault(self._open, []).append(data)


def _shell_only(page: _Tags) -> None:
    """The page is the shell's elements and nothing else: no element, attribute or script from a value."""
    assert {t for t, _ in page.tags} == {"html", "head", "meta", "title", "link", "body", "main", "h1", "p", "script"}
    scripts = [a for t, a in page.tags if t == "script"]
    assert [a.get("type") for a in scripts] == ["application/json", None, None]
    assert all("src" in a for a in scripts[1:]) and not any(k.startswith("on") for _, a in page.tags for k in a)


def test_a_run_id_with_placeholders_and_markup_is_text_on_the_page(tmp_path):
    """Issue 21, item 1: `{{CONFIG}}` in the run id pulled the raw config JSON (with the run id's
    `<svg onload=...>`) into the page's <h1>."""
    storage = FileStorage(tmp_path)
    _run(storage, CRAFTED)
    resp = _client({DAG: storage}).get(f"/runs/{DAG}/{quote(CRAFTED, safe='')}")
    assert resp.status_code == 200, resp.text
    assert "<svg" not in resp.text
    page = _Tags(resp.text)
    _shell_only(page)
    assert "".join(page.text["h1"]) == f"{DAG} / {CRAFTED}"
    assert "".join(page.text["title"]).startswith(f"{DAG} / {CRAFTED}")
    blob = "".join(page.text["script"])
    assert "<" not in blob and ">" not in blob  # cannot end its element, whatever the values
    config = json.loads(blob)
    assert (config["kind"], config["run_id"], config["dag_id"]) == ("run", CRAFTED, DAG)


def test_a_dag_id_with_markup_is_text_too(tmp_path):
    dag = "x\"><img src=x onerror=alert(1)>{{STATIC}}{{TITLE}}"
    resp = _client({dag: FileStorage(tmp_path)}).get(f"/pipelines/{quote(dag, safe='')}")
    assert resp.status_code == 200, resp.text
    assert "<img" not in resp.text
    page = _Tags(resp.text)
    _shell_only(page)
    assert "".join(page.text["h1"]) == dag
    config = json.loads("".join(page.text["script"]))
    assert config["dag_id"] == dag and config["kind"] == "pipeline"
    assert all(a["href"].startswith("/static/") for t, a in page.tags if t == "link")


def test_a_value_that_would_end_the_config_element_stays_inside_it():
    """What no URL can carry ('/'), a record or a title could: `_page` itself, every value at once."""
    from starlette.requests import Request

    from ballast.ui import app as ui

    request = Request({"type": "http", "app": ui.create_app(_Catalog({})), "path": "/", "root_path": "/ballast",
                       "headers": [], "query_string": b""})
    evil = "</script><script>alert(1)</script><!--{{CONFIG}}{{ config }}"
    body = ui._page(request, "run", evil, run_id=evil, api=evil).body.decode()
    assert "<script>alert" not in body and "<!--" not in body
    page = _Tags(body)
    _shell_only(page)
    assert "".join(page.text["h1"]) == evil
    assert json.loads("".join(page.text["script"])) == {"kind": "run", "run_id": evil, "api": evil}
    assert [a["href"] for t, a in page.tags if t == "link"] == ["/ballast/static/uplot/uPlot.min.css",
                                                              "/ballast/static/stability.css"]


def test_the_pages_carry_a_policy_with_no_inline_script(tmp_path):
    storage = FileStorage(tmp_path)
    _run(storage, "manual_1")
    client = _client({DAG: storage})
    for path in ("/", f"/pipelines/{DAG}", f"/runs/{DAG}/manual_1"):
        resp = client.get(path)
        assert resp.status_code == 200, (path, resp.text)
        csp = {d.split()[0]: d.split()[1:] for d in resp.headers["content-security-policy"].split("; ")}
        # Scripts from the static folder only, not the whole origin (a Data Docs page is served from it too).
        assert csp["script-src"] == ["http://testserver/static/"] and csp["style-src"] == ["'self'"], csp
        assert csp["default-src"] == ["'none'"] and csp["frame-ancestors"] == ["'self'"]
        assert resp.headers["x-content-type-options"] == "nosniff"
    js = client.get("/static/stability.js")
    assert js.status_code == 200 and "ballast-config" in js.text and 'setAttribute(k, v)' in js.text
    assert '.style.cssText' in js.text  # style through the CSSOM: a style attribute is inline style


def test_concurrent_misses_for_one_summary_compute_it_once():
    from ballast.ui.app import _Cache

    cache, calls, release = _Cache(8), [], threading.Event()

    def make():
        calls.append(1)
        release.wait(10)
        return {"status": "running"}

    results: list = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(("run", "d", "r"), make, final=lambda d: False)))
               for _ in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the others arrive while the first computes
    release.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(results) == 8 and all(r is results[0] for r in results)


def test_a_failed_computation_fails_its_waiters_and_the_next_request_tries_again():
    from ballast.ui.app import _Cache

    cache, started, release, calls = _Cache(8), threading.Event(), threading.Event(), []

    def broken():
        calls.append(1)
        started.set()
        release.wait(10)
        raise StorageError("s3://b/runs: list failed: access denied")

    errors: list = []

    def ask():
        try:
            cache.get(("k",), broken, final=lambda d: True)
        except StorageError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(10)
    time.sleep(0.3)
    release.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(errors) == 4
    assert cache.get(("k",), lambda: "ok", final=lambda d: True) == "ok"


class _Unreadable(FileStorage):
    """Storage whose every read fails as S3 would say it: bucket, prefix and endpoint in the message."""

    CAUSE = "s3://secret-bucket/pipelines/runs: list failed: Could not connect to http://minio.internal:9000/"

    def exists(self, key):
        raise StorageError(self.CAUSE)

    def list(self, prefix, *args, **kwargs):
        raise StorageError(self.CAUSE)

    list_dir = list


def test_a_storage_error_is_a_503_naming_the_pipeline_and_not_its_storage(tmp_path, caplog):
    client = _client({DAG: _Unreadable(tmp_path)})
    with caplog.at_level(logging.WARNING, logger="ballast.ui.app"):
        for path in (f"/api/runs/{DAG}/manual_1", f"/api/pipelines/{DAG}"):
            resp = client.get(path)
            assert resp.status_code == 503, resp.text
            detail = resp.json()["detail"]
            assert DAG in detail and "could not be read" in detail
            assert "secret-bucket" not in resp.text and "minio.internal" not in resp.text and "s3://" not in resp.text
    assert any("minio.internal" in r.getMessage() for r in caplog.records)  # the operator's log has it


def test_a_record_that_cannot_be_read_does_not_show_its_storage_either(tmp_path, caplog):
    from ballast.ui.summary import run_summary

    class _Flaky(FileStorage):
        def open_read(self, key, start=0):
            raise StorageError(_Unreadable.CAUSE)

    _run(FileStorage(tmp_path), "manual_1")
    with caplog.at_level(logging.WARNING, logger="ballast.ui.reader"):
        s = run_summary(_Flaky(tmp_path), DAG, "manual_1")
    assert s["records"]["states"]["attempts/train.json"] == "corrupt"
    assert "minio.internal" not in json.dumps(s) and "could not be read" in s["records"]["problems"]["attempts/train.json"]
    assert any("minio.internal" in r.getMessage() for r in caplog.records)


class _Counting(FileStorage):
    """Local storage that notes every key it is asked about."""

    def __init__(self, root):
        super().__init__(root)
        self.asked: list[tuple[str, str]] = []
        self.listed: list[tuple[str, int | None]] = []  # full listings (every file below): directory, limit

    def list(self, prefix, *args, **kwargs):
        self.asked.append(("list", prefix))
        self.listed.append((prefix.rstrip("/") + "/", kwargs.get("limit")))
        return super().list(prefix, *args, **kwargs)

    def list_dir(self, prefix, *args, **kwargs):
        self.asked.append(("list_dir", prefix))
        return super().list_dir(prefix, *args, **kwargs)

    def exists(self, key):
        self.asked.append(("exists", key))
        return super().exists(key)

    def open_read(self, key, start=0):
        self.asked.append(("read", key))
        return super().open_read(key, start)


def test_the_pipeline_page_reads_only_its_newest_runs(tmp_path):
    storage = _Counting(tmp_path)
    runs = [f"scheduled__2026-12-0{d}T00:00:00+00:00" for d in range(1, 6)]
    prefixes = [_run(storage, r, started=1000.0 * d) for d, r in enumerate(runs, 1)]
    _run(storage, "manual__2026-11-30T23:00:00+00:00", started=1.0)  # older than all, whatever its name's order
    for p in prefixes:  # checkpoint shards: never listed by the view
        for i in range(3):
            storage.write_bytes(f"{p}/checkpoints/step-0000001{i}/shard-{i}.distcp", b"x")
    client = _client({DAG: storage})
    storage.asked.clear()
    resp = client.get(f"/api/pipelines/{DAG}", params={"limit": 2})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["total_runs"] == 6 and len(data["runs"]) == 2
    assert [r["started"] for r in data["runs"]] == [4000.0, 5000.0]
    touched = {key for _, key in storage.asked}
    older = [p for p in prefixes[:3]]
    assert not any(k.startswith(p) for k in touched for p in older), sorted(touched)
    assert not any("/checkpoints" in k for k in touched)
    assert not any(d == f"runs/{DAG}/" or (d.count("/") == 3 and limit != 1) for d, limit in storage.listed), storage.listed
    assert client.get(f"/api/pipelines/{DAG}", params={"limit": 0}).status_code == 422
    assert client.get(f"/api/pipelines/{DAG}", params={"limit": 10**6}).status_code == 422
    assert len(client.get(f"/api/pipelines/{DAG}").json()["runs"]) == 6  # the default shows them all here


def test_a_run_page_lists_no_checkpoint_shards_and_finds_round_records(tmp_path):
    """Listing by partial name (`stages/round_`) found nothing in local storage: a rounds pipeline's
    train record looked missing. The view lists the stages/ directory; checkpoints are one marker
    lookup per checkpoint directory, never a listing of their shards."""
    from ballast.ui.summary import run_summary

    storage = _Counting(tmp_path)
    prefix = _run(storage, "manual_1")
    storage.write_bytes(f"{prefix}/stages/round_1.train.json", b"{}")
    storage.write_bytes(f"{prefix}/stages/round_2.train.json", b"{}")
    for step in (10, 20):
        for i in range(3):
            storage.write_bytes(f"{prefix}/checkpoints/step-{step:08d}/shard-{i}.distcp", b"x")
        storage.write_bytes(f"{prefix}/checkpoints/step-{step:08d}/COMMITTED", b"")
    storage.write_bytes(f"{prefix}/checkpoints/step-00000030/shard-0.distcp", b"x")  # not committed
    storage.write_bytes(f"{prefix}/checkpoints/quarantine/step-00000040/COMMITTED", b"")
    storage.asked.clear()
    s = run_summary(storage, DAG, "manual_1")
    assert s["checkpoints"]["committed"] == ["step-00000010", "step-00000020"]
    assert s["checkpoints"]["quarantined"] == ["step-00000040"]
    assert s["records"]["states"]["stages/round_2.train.json"] == "corrupt"  # read: the last round's
    assert "stages/train.json" not in s["records"]["states"]
    assert not any("checkpoints" in d for d, _ in storage.listed), storage.listed
    assert all(limit == 1 for d, limit in storage.listed if d == f"{prefix}/"), storage.listed  # whether it exists


@pytest.mark.unit
def test_a_spec_that_fails_unexpectedly_leaves_the_other_pipelines_listed(tmp_path, monkeypatch, caplog):
    """The pipeline catalogue parses specs on the API server's threads: any error in one spec is that spec's
    alone (as in the DAG processor), never the catalogue's."""
    import shutil

    from ballast.spec import loading
    from ballast.ui.pipelines import Catalog
    from helpers import ROOT

    shutil.copy(ROOT / "dags/specs/digits.yaml", tmp_path / "digits.yaml")
    (tmp_path / "odd.yaml").write_text("name: odd\n")
    real = loading.load_spec

    def load_spec(path):
        if path.name == "odd.yaml":
            raise RecursionError("maximum recursion depth exceeded")  # what no SpecError covers
        return real(path)

    monkeypatch.setattr("ballast.spec.load_spec", load_spec)
    from ballast.ui import pipelines

    monkeypatch.setattr(pipelines.log, "handlers", [caplog.handler])  # (Airflow's logging may not propagate it)
    assert list(Catalog(tmp_path).pipelines()) == ["ballast_digits"]
    assert "odd.yaml: cannot be read as a Ballast spec" in caplog.text
