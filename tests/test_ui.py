"""The Training stability view: its summary of a run's records (unit), and the view inside the real
Airflow UI (e2e: the API server, scheduler and DAG processor on loopback, Debian's headless Chromium)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ballast.pipeline.context import safe_run_id
from ballast.records import Attempt, AttemptHistory, RecoverySummary
from ballast.storage import FileStorage
from helpers import headless_chromium

RUN = "manual__2026-12-04T10:00:00+00:00"
PREFIX = f"runs/ballast_demo/{safe_run_id(RUN)}"


def _attempt(n: int, **kw) -> Attempt:
    base = dict(try_number=n, outcome="success", host="vm", started=1000.0 * n, ended=1000.0 * n + 100,
                first_step_at=1000.0 * n + 5,
                step_reached=50, settings={"micro_batch_size": 32}, adaptation=[])
    return Attempt(**{**base, **kw})


def _write(root: Path, key: str, data) -> None:
    path = root / PREFIX / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else (json.dumps(data) if not isinstance(data, str) else data).encode())


def _records(root: Path) -> AttemptHistory:
    history = AttemptHistory(task_id="train", attempts=[
        _attempt(1, outcome="failed", failure_class="oom", reason="out of memory at step 30", host="node-3",
                 ended=1090.0, step_reached=30, last_commit_step=20, restart_seconds=0.0, lost_seconds=8.0),
        _attempt(2, started=1100.0, ended=1200.0, first_step_at=1104.0, resumed_step=20, restart_seconds=4.0, lost_seconds=6.5,
                 group_restarts=1, group_restart_lost_seconds=2.5,
                 adaptation=["out of memory in try 1: micro-batch 32 -> 16 (gradient accumulation keeps the global batch)"],
                 settings={"micro_batch_size": 16})])
    _write(root, "attempts/train.json", history.model_dump_json())
    events = [{"event": "first_step", "time": 1001.0, "step": 1, "rank": 0}]
    for step in range(10, 101, 10):
        events.append({"event": "step", "time": 1000.0 + step, "step": step, "rank": 0, "loss": 2.0 / step,
                       "grad_norm": 1.0, "lr": 0.01, "loss_scale": 1.0, "data_s": 0.001, "compute_s": 0.006,
                       "comm_opt_s": 0.003})
    events.append({"event": "anomaly", "time": 1055.0, "step": 55, "rank": 1, "kind": "loss_spike", "loss": 9.0,
                   "zscore": 7.5})
    _write(root, "train/metrics.jsonl", "\n".join(json.dumps(e) for e in events) + "\n")
    for step in (20, 40, 60):
        _write(root, f"checkpoints/step-{step:08d}/COMMITTED", "")
    _write(root, "checkpoints/quarantine/step-00000080/COMMITTED", "")
    _write(root, "train/heartbeat", "100 1200.0\n")
    return history


@pytest.mark.unit
def test_the_run_summary_reads_the_records_and_adds_up_the_time(tmp_path):
    from ballast.ui.summary import run_summary

    history = _records(tmp_path)
    s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)
    expected = RecoverySummary.of([history])
    rec = s["recovery"]
    assert rec["effective_ratio"] == expected.effective_ratio and rec["tries"] == 2
    assert rec["failures_by_class"] == {"oom": 1} and rec["group_restarts"] == 1
    assert rec["lost_by_cause"] == {"restart of a new try": 4.0, "tries that never reached a step": 0.0,
                                    "in-try group restarts": 2.5, "work since the last checkpoint": 8.0,
                                    "waiting for the retry": 10.0}
    assert rec["lost_by_class"] == {"oom": 8.0}
    t1, t2 = s["tries"]
    assert (t1["outcome"], t1["failure_class"], t1["host"]) == ("failed", "oom", "node-3")
    assert t1["adaptation_next"] == [history.attempts[1].adaptation[0]] and t2["resumed_step"] == 20
    assert s["checkpoints"] == {"committed": ["step-00000020", "step-00000040", "step-00000060"], "verified": [],
                                "quarantined": ["step-00000080"]}
    c = s["curves"]
    assert c["step"] == list(range(10, 101, 10)) and c["loss"][0] == pytest.approx(0.2)
    assert c["learning_rate"] == [0.01] * 10 and c["spikes"] == [{"step": 55, "kind": "loss_spike", "loss": 9.0,
                                                                 "zscore": 7.5}]
    assert s["step_time"]["share"] == {"data": 0.1, "compute": 0.6, "communication": 0.3}
    assert s["progress"]["current_try"] == 2 and s["progress"]["steps_per_second"] == 1.0
    # Nothing of the finished stages yet: each record says so; the page is still served.
    assert s["status"] == "running or stopped" and s["model"] is None
    assert s["records"]["states"]["report.json"] == "missing"
    assert s["records"]["states"]["attempts/train.json"] == "ok"


@pytest.mark.unit
def test_resumed_steps_odd_events_and_rounds(tmp_path):
    """A resumed try logs the steps after its checkpoint again: one point per step, in order, and the
    rate from the last resume on. Events that are not objects with a step and a time are bad lines.
    A pipeline that trains in rounds has one attempt history per round: the view joins them."""
    from ballast.ui.summary import run_summary

    history = _records(tmp_path)
    events = [{"event": "step", "time": 1000.0 + s, "step": s, "rank": 0, "loss": 1.0} for s in (10, 20, 30, 40)]
    events += [{"event": "resume", "time": 1100.0, "step": 20, "rank": 0}]
    events += [{"event": "step", "time": 1100.0 + 2 * s, "step": s, "rank": 0, "loss": 0.5} for s in (30, 40, 50)]
    lines = [json.dumps(e) for e in events] + ["5", "[]", '{"event": "step", "step": 60}',
                                               '{"event": "step", "step": 70, "time": 1210.0, "loss": NaN}']
    _write(tmp_path, "train/metrics.jsonl", "\n".join(lines) + "\n")
    s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)
    assert s["curves"]["step"] == [10, 20, 30, 40, 50, 70] and s["curves"]["loss"][2] == 0.5
    assert s["curves"]["loss"][-1] is None  # NaN is no number the page can draw
    assert s["records"]["states"]["train/metrics.jsonl"] == "partial"  # 3 bad lines
    assert s["progress"]["steps_per_second"] is not None and s["progress"]["steps_per_second"] > 0
    json.dumps(s, allow_nan=False)  # what the API's encoder accepts
    round2 = AttemptHistory(task_id="round_2.train", attempts=[_attempt(3, started=3000.0, ended=3100.0)])
    (tmp_path / PREFIX / "attempts" / "train.json").rename(tmp_path / PREFIX / "attempts" / "round_1.train.json")
    _write(tmp_path, "attempts/round_2.train.json", round2.model_dump_json())
    s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=3200.0)
    assert [t["try"] for t in s["tries"]] == [1, 2, 3]
    assert s["recovery"]["tries"] == 3 == RecoverySummary.of([history, round2]).tries


@pytest.mark.unit
def test_a_try_in_progress_counts_up_to_now(tmp_path):
    from ballast.ui.summary import run_summary

    history = _records(tmp_path)
    running = history.model_copy(update={"attempts": [history.attempts[0], history.attempts[1].model_copy(
        update={"ended": None, "outcome": "running"})]})
    _write(tmp_path, "attempts/train.json", running.model_dump_json())
    s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1250.0)
    assert s["tries"][1]["outcome"] == "running"
    assert s["recovery"]["wall_seconds"] == 250.0  # the first try's start to now


@pytest.mark.unit
@pytest.mark.parametrize("damage,state,problem", [
    (b'{"version": 1, "task_id": "train", "attempts": [{"try_number": "one"}]}', "corrupt", "attempts.0"),
    (b"\x00\xffnot json", "corrupt", "(top)"),
])
def test_corrupt_records_show_as_such(tmp_path, damage, state, problem):
    from ballast.ui.summary import run_summary

    _records(tmp_path)
    _write(tmp_path, "attempts/train.json", damage)
    _write(tmp_path, "train/metrics.jsonl", b'{"event": "step", "step": 10, "time": 1.0, "loss": 1.0}\n{"event": "st')
    s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)
    assert s["records"]["states"]["attempts/train.json"] == state
    assert s["records"]["problems"]["attempts/train.json"].startswith(problem)
    assert s["recovery"] is None and s["tries"] == []
    assert s["records"]["states"]["train/metrics.jsonl"] == "partial"  # a line being written
    assert s["curves"]["step"] == [10]


@pytest.mark.unit
def test_records_that_parse_but_hold_odd_values_still_give_a_page(tmp_path):
    """Damage that JSON accepts: NaN or text where a number goes, a list where a name goes, null where
    a spec section goes. The view shows what it can; it never fails with a server error."""
    from ballast.ui.summary import run_summary

    _records(tmp_path)
    events = [{"event": "step", "time": 1.0, "step": 10, "rank": 0, "loss": 1.0, "data_s": float("nan"),
               "compute_s": "slow", "comm_opt_s": None},
              {"event": "anomaly", "time": 2.0, "step": 10, "rank": 0, "kind": ["loss_spike"], "zscore": "high"}]
    _write(tmp_path, "train/metrics.jsonl", "\n".join(json.dumps(e) for e in events) + "\n")
    for training, cache in ((None, None), ([1], "x"), ({"epochs": "many", "global_batch_size": 0}, {"stages": [3]})):
        _write(tmp_path, "spec.json", {"spec_file": "x.yaml", "parameters_given": {}, "parameters_applied": {},
                                       "spec": {"training": training, "cache": cache}})
        s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)
        assert s["progress"]["total"] is None and s["progress"]["samples_per_second"] is None
        assert s["step_time"]["median_seconds"] == {"data": 0.0, "compute": 0.0, "communication": 0.0}
        assert s["curves"]["spikes"] == [{"step": 10, "kind": None, "loss": None, "zscore": None}]


@pytest.mark.unit
def test_a_stage_at_work_shows_its_progress_record_and_a_stage_without_one_is_no_problem(tmp_path):
    from ballast.records import StageProgress
    from ballast.ui.summary import run_summary

    _records(tmp_path)
    s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)
    assert s["stage_progress"] == [] and not any(k.startswith("progress/") for k in s["records"]["states"])
    _write(tmp_path, "progress/convert.json", StageProgress(
        stage="convert", what="convert", unit="rows", done=600, total=1797, rate_per_second=300.0, eta_seconds=4.0,
        started=1290.0, updated=1298.0).model_dump_json())
    s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)
    assert s["stage_progress"] == [{"stage": "convert", "what": "convert", "unit": "rows", "done": 600, "total": 1797,
                                    "rate_per_second": 300.0, "eta_seconds": 4.0, "updated": 1298.0,
                                    "finished": False, "age_seconds": 2.0}]
    _write(tmp_path, "progress/convert.json", b'{"stage": "convert", "done": "many"}')
    s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)
    assert s["stage_progress"] == [] and s["records"]["states"]["progress/convert.json"] == "corrupt"


@pytest.mark.unit
def test_a_run_with_no_records_is_none_and_bounded_reads_say_partial(tmp_path, monkeypatch):
    from ballast.ui import reader, summary

    assert summary.run_summary(FileStorage(tmp_path), "ballast_demo", RUN) is None
    _records(tmp_path)
    monkeypatch.setattr(reader, "MAX_EVENTS_BYTES", 300)
    s = summary.run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)
    assert s["records"]["states"]["train/metrics.jsonl"] == "partial"
    assert "last" in s["records"]["problems"]["train/metrics.jsonl"]
    assert s["curves"]["step"] and s["curves"]["step"][-1] == 100  # the newest lines, the cut one dropped


@pytest.mark.unit
def test_the_pipeline_summary_spans_runs(tmp_path):
    from ballast.ui.summary import pipeline_summary

    history = _records(tmp_path)
    other = tmp_path / "runs/ballast_demo/scheduled__2026-12-05T00_00_00_00_00/attempts"
    other.mkdir(parents=True)
    (other / "train.json").write_text("{broken")
    s = pipeline_summary(FileStorage(tmp_path), "ballast_demo")
    # A run without spec.json is named by its directory; one whose spec.json records its id, by that id
    # (what its link needs: the directory's name is no run id).
    assert [r["run"] for r in s["runs"]] == [safe_run_id(RUN), "scheduled__2026-12-05T00_00_00_00_00"]
    _write(tmp_path, "spec.json", {"spec_file": "x.yaml", "run_id": RUN, "parameters_given": {},
                                   "parameters_applied": {}, "spec": {}, "version": 1})
    s = pipeline_summary(FileStorage(tmp_path), "ballast_demo")
    assert [r["run"] for r in s["runs"]] == [RUN, "scheduled__2026-12-05T00_00_00_00_00"]
    assert s["runs"][0]["ratio"] == RecoverySummary.of([history]).effective_ratio
    assert s["runs"][1]["state"] == "corrupt"
    assert s["failures_by_class"] == {"oom": 1}
    assert s["mtbf_seconds"] == RecoverySummary.of([history]).mtbf_seconds


@pytest.mark.unit
def test_the_plugin_is_what_airflows_api_accepts():
    """Airflow drops a whole plugin whose entry fails its response model: validate ours with it."""
    from airflow.api_fastapi.core_api.datamodels.plugins import ExternalViewResponse, FastAPIAppResponse

    from ballast.ui.plugin import BallastPlugin

    for view in BallastPlugin.external_views:
        ExternalViewResponse.model_validate(view)
    tab = next(v for v in BallastPlugin.external_views if v["destination"] == "dag_run")
    assert "{DAG_ID}" in tab["href"] and "{RUN_ID}" in tab["href"] and tab["url_route"]
    for app in BallastPlugin.fastapi_apps:
        FastAPIAppResponse.model_validate({**app, "app": str(app["app"])})


# --- the view in the real Airflow UI -----------------------------------------------------------------


def _get(url: str, token: str | None = None) -> tuple[int, dict | str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read().decode()
            return resp.status, json.loads(body) if resp.headers.get_content_type() == "application/json" else body
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.e2e
def test_the_stability_view_inside_the_airflow_ui(airflow_db, digits_raw, tmp_path):
    """A finished demo run and a run with injected faults (a loss spike, an out-of-memory on try 1),
    then the real API server: the plugin's tab on each run, in headless Chromium, logged in as a viewer;
    the page's numbers are the records'; no token is 401, a run that does not exist 404. A run id that
    holds a template placeholder and markup (`{{CONFIG}}<svg onload=alert(1)>`) is text on its page: no
    alert, and no script or style the page's Content-Security-Policy had to refuse, on any page."""
    from urllib.parse import quote

    from helpers import free_port, run_spec_dag
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from ballast.dev.stack import LocalStack
    from ballast.recovery import history
    from ballast.ui.summary import run_prefix
    from selenium.common.exceptions import NoAlertPresentException

    def fast(d, faults=()):
        d["dataset"]["location"] = str(digits_raw)
        d["training"].update(epochs=3, checkpoint={"every_steps": 10, "keep_last": 5},
                             rehearsal={"faults": list(faults)}, monitors={"spike_window": 20})
        d["evaluation"].update(threshold=None, patience=10)
        d["recovery"] = {"retry_delay_seconds": 0}
        d["schedule"] = {}

    demo, demo_ctx = run_spec_dag(tmp_path, fast, name="view_demo")
    faults = [{"kind": "spike", "step": 35, "on_try": 1}, {"kind": "oom", "step": 45, "on_try": 1}]
    faulty, faulty_ctx = run_spec_dag(tmp_path, lambda d: fast(d, faults), conf={"rehearsal": True}, name="view_faults")
    assert str(demo.state) == str(faulty.state) == "success"
    tries = history.load(faulty_ctx, "train").attempts
    assert [(a.outcome, a.failure_class) for a in tries] == [("failed", "oom"), ("success", None)]
    expected = {ctx.dag_id: RecoverySummary.of([history.load(ctx, "train")]) for ctx in (demo_ctx, faulty_ctx)}

    port = free_port()
    env = {"AIRFLOW__CORE__DAGS_FOLDER": str(tmp_path / "dags")}
    users = {"viewer": ("viewer", "viewer-pw"), "admin": ("admin", "admin-pw")}
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with LocalStack(port, log_dir=tmp_path / "logs", extra_env=env, users=users, migrate=False) as stack:
        base = stack.base
        plugins = stack.request("GET", "/api/v2/plugins")["plugins"]
        ours = next(p for p in plugins if p["name"] == "ballast")
        assert {v["destination"] for v in ours["external_views"]} == {"dag_run", "nav"}
        token = stack.login("viewer")
        api = f"{base}/ballast/api/runs/{faulty_ctx.dag_id}/{quote(faulty.run_id, safe='')}"
        assert _get(api)[0] == 401  # no credentials
        assert _get(api, "not-a-token")[0] in (401, 403)
        code, data = _get(api, token)
        assert code == 200 and data["recovery"]["effective_ratio"] == expected[faulty_ctx.dag_id].effective_ratio
        assert [s["step"] for s in data["curves"]["spikes"] if s["kind"] == "loss_spike"][:1] == [34], data["curves"]
        assert data["model"]["published"] and data["validation"]["passed"]
        assert all(v is not None for v in data["curves"]["learning_rate"] + data["curves"]["loss_scale"])
        assert _get(f"{base}/ballast/api/runs/{faulty_ctx.dag_id}/no_such_run", token)[0] == 404
        assert _get(f"{base}/ballast/api/runs/{faulty_ctx.dag_id}/%2E%2E", token)[0] == 404  # not a storage error
        assert _get(f"{base}/ballast/api/runs/ballast_nope/{quote(faulty.run_id, safe='')}", token)[0] in (403, 404)
        # Damaged records of a run show as such, never as a server error.
        broken = demo_ctx.storage.local_path(f"runs/{demo_ctx.dag_id}/manual__broken")
        (broken / "attempts").mkdir(parents=True)
        (broken / "attempts" / "train.json").write_text("{broken")
        (broken / "train").mkdir()
        (broken / "train" / "metrics.jsonl").write_text('{"event": "step", "step": 10, "time": 1.0, "loss": 1}\n{"ev')
        code, data = _get(f"{base}/ballast/api/runs/{demo_ctx.dag_id}/manual__broken", token)
        assert code == 200, data
        assert data["records"]["states"]["attempts/train.json"] == "corrupt"
        assert data["records"]["states"]["train/metrics.jsonl"] == "partial" and data["curves"]["step"] == [10]
        assert _get(f"{base}/ballast/runs/{demo_ctx.dag_id}/manual__broken", token)[0] == 200
        # Issue 21, item 1. Airflow's run_id pattern refuses '<' and '{' in a triggered run, but the view
        # takes the id from the URL: records under its key are what a link to it needs.
        crafted = "{{CONFIG}}<svg onload=alert(1)>"
        crafted_dir = demo_ctx.storage.local_path(run_prefix(demo_ctx.storage, demo_ctx.dag_id, crafted))
        (crafted_dir / "attempts").mkdir(parents=True)
        (crafted_dir / "attempts" / "train.json").write_text("{broken")
        code, shell = _get(f"{base}/ballast/runs/{demo_ctx.dag_id}/{quote(crafted, safe='')}", token)
        assert code == 200 and "<svg" not in shell, shell
        assert _get(f"{base}/ballast/static/stability.js")[0] == 401
        assert _get(f"{base}/ballast/static/../app.py", token)[0] == 404

        browser = headless_chromium()
        try:
            browser.get(f"{base}/api/v2/monitor/health")  # the origin, to set the UI's cookie on
            browser.add_cookie({"name": "_token", "value": token, "path": "/"})
            for dr, ctx in ((demo, demo_ctx), (faulty, faulty_ctx)):
                browser.get(f"{base}/dags/{ctx.dag_id}/runs/{quote(dr.run_id, safe='')}/plugin/ballast-run")
                frame = WebDriverWait(browser, 60).until(ec.presence_of_element_located((By.CSS_SELECTOR, "iframe")))
                browser.switch_to.frame(frame)
                WebDriverWait(browser, 60).until(
                    lambda b: b.find_element(By.ID, "app").get_attribute("data-state") in ("rendered", "error"))
                app = browser.find_element(By.ID, "app")
                assert app.get_attribute("data-state") == "rendered", app.text
                WebDriverWait(browser, 30).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#charts canvas")) >= 2)
                want = expected[ctx.dag_id]
                assert browser.find_element(By.ID, "ratio").text == f"{100 * want.effective_ratio:.1f} %"
                assert browser.find_element(By.ID, "tries-count").text == str(want.tries)
                rows = browser.find_elements(By.CSS_SELECTOR, "#tries tbody tr")
                assert len(rows) == want.tries
                committed = ctx.storage.list(f"{ctx.run_key}/checkpoints/")
                n = sum(1 for k in committed if k.endswith("/COMMITTED") and "/quarantine/" not in k)
                assert browser.find_element(By.ID, "committed").get_attribute("data-count") == str(n)
                assert "published" in browser.find_element(By.ID, "model").text
                browser.switch_to.default_content()
                browser.save_screenshot(str(shots / f"{ctx.dag_id}.png"))
                if ctx is faulty_ctx:
                    browser.switch_to.frame(browser.find_element(By.CSS_SELECTOR, "iframe"))
                    first = rows[0].text if rows else ""
                    assert "failed" in first and "oom" in first and "micro-batch" in first, first
                    classes = browser.find_element(By.ID, "failures-by-class").text
                    assert "oom" in classes
                    assert "anomaly" in browser.find_element(By.ID, "charts").find_element(By.XPATH, "..").text
                    browser.switch_to.default_content()
            browser.get(f"{base}/plugin/ballast")  # the navigation entry: pipelines, then one pipeline's runs
            browser.switch_to.frame(WebDriverWait(browser, 60).until(
                ec.presence_of_element_located((By.CSS_SELECTOR, "iframe"))))
            WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "app").get_attribute("data-state") == "rendered")
            assert {faulty_ctx.dag_id, demo_ctx.dag_id} <= set(browser.find_element(By.ID, "pipelines").text.split())
            browser.switch_to.default_content()
            browser.get(f"{base}/ballast/runs/{demo_ctx.dag_id}/manual__broken")  # the page itself, by cookie
            WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "app").get_attribute("data-state") == "rendered")
            notice = browser.find_element(By.ID, "record-states").text
            assert "attempts/train.json corrupt" in notice and "train/metrics.jsonl partial" in notice, notice
            browser.get(f"{base}/ballast/runs/{demo_ctx.dag_id}/{quote(crafted, safe='')}")
            WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "app").get_attribute("data-state") == "rendered")
            with pytest.raises(NoAlertPresentException):
                browser.switch_to.alert  # noqa: B018  (raises unless an alert is open)
            assert browser.find_element(By.TAG_NAME, "h1").text == f"{demo_ctx.dag_id} / {crafted}"
            assert not browser.find_elements(By.TAG_NAME, "svg")
            browser.get(f"{base}/ballast/pipelines/{demo_ctx.dag_id}")  # the pipeline page, bounded
            WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "app").get_attribute("data-state") == "rendered")
            assert browser.find_element(By.ID, "runs-count").text == "3"  # the demo run, the broken, the crafted
            refused = [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
            assert not refused, refused
        finally:
            browser.quit()
    assert (shots / f"{faulty_ctx.dag_id}.png").stat().st_size > 10_000


@pytest.mark.integration
def test_airflow_lists_the_plugin_from_its_entry_point(airflow_db):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "airflow", "plugins", "-o", "json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    plugins = json.loads(out.stdout[out.stdout.index("["):])
    ours = [p for p in plugins if p["name"] == "ballast"]
    assert len(ours) == 1, [p["name"] for p in plugins]
    assert "ballast.ui.plugin" in json.dumps(ours[0])


@pytest.mark.unit
def test_the_validation_curve_is_the_tasks_metric_epoch_by_epoch(tmp_path):
    from ballast.ui.summary import run_summary

    _records(tmp_path)
    epochs = [{"event": "epoch", "time": 1100.0 + k, "step": 10 * (k + 1), "rank": 0, "epoch": k,
               "loss": 3.0 - k, "perplexity": 20.0 - 5 * k, "bits_per_byte": 2.0} for k in range(3)]
    epochs.append({**epochs[1], "perplexity": 14.0})  # epoch 1 again after a resume: the last one stands
    with (tmp_path / PREFIX / "train" / "metrics.jsonl").open("a") as f:
        f.write("\n".join(json.dumps(e) for e in epochs) + "\n")
    spec = {"evaluation": {"metric": "perplexity", "mode": "min"}, "training": {"task": "causal_lm"}}
    _write(tmp_path, "spec.json", {"spec_file": "lm.yaml", "run_id": RUN, "parameters_given": {},
                                   "parameters_applied": {}, "spec": spec})
    s = run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)
    assert s["validation_curve"] == {"metric": "perplexity", "epoch": [1, 2, 3], "values": [20.0, 14.0, 10.0]}
    (tmp_path / PREFIX / "spec.json").unlink()
    assert run_summary(FileStorage(tmp_path), "ballast_demo", RUN, now=1300.0)["validation_curve"] is None
