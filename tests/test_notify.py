"""Failure and retry notifications: the spec section, the message, and a real webhook on loopback
receiving them from real task callbacks (dag.test), with one clear log line when a connection is bad."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import example_data


@pytest.mark.unit
@pytest.mark.parametrize("section,message", [
    ({"webhook": {}}, r"notifications\.webhook\.conn_id: required"),
    ({"webhook": {"conn_id": "hook", "endpoint": "https://evil.example/x"}}, r"notifications\.webhook\.endpoint: "),
    ({"email": {"to": ["not-an-address"]}}, r"notifications\.email\.to: 'not-an-address' is not an email address"),
    ({"email": {"to": []}}, r"notifications\.email\.to"),
    ({"on": ["sometimes"], "webhook": {"conn_id": "hook"}}, r"notifications\.on\[0\]: must be one of 'failure' or 'retry'"),
])
def test_bad_notification_sections_get_one_line(section, message):
    from ballast.errors import SpecError
    from ballast.spec import parse_spec

    with pytest.raises(SpecError, match=message) as err:
        parse_spec({**example_data(), "notifications": section})
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_a_notification_that_cannot_be_composed_is_one_log_line_and_no_exception(logged):
    from ballast.airflow.notify import StageNotifier

    data = {**example_data(), "notifications": {"webhook": {"conn_id": "hook"}}}
    StageNotifier(event="failure", stage="train", spec_data=data, spec_file="x.yaml").notify({})  # no task instance
    StageNotifier(event="failure", stage="train", spec_data={"nonsense": 1}, spec_file="x.yaml").notify({})
    assert [level for level, _ in logged.lines] == ["ERROR", "ERROR"], logged.lines
    assert all("not composed" in msg and "\n" not in msg for _, msg in logged.lines), logged.lines


@pytest.mark.unit
def test_the_email_escapes_what_the_failure_says():
    from ballast.airflow.notify import html_body, subject

    msg = {"event": "failure", "pipeline": "digits", "dag_id": "ballast_digits", "run_id": "r1", "task_id": "train",
           "stage": "train", "try_number": 3, "max_tries": 3, "failure_class": "oom", "reason": "<script>x</script>",
           "adaptation": ["micro-batch 32 -> 16"], "view": "http://h/dags/ballast_digits/runs/r1/plugin/ballast-run"}
    assert subject(msg) == "[Ballast] digits: train try 3 failed (oom)"
    body = html_body(msg)
    assert "<script>" not in body and "&lt;script&gt;" in body and "micro-batch 32 -&gt; 16" in body


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


class _Hook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.path, json.loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def logged():
    """What ballast.airflow.notify logs (Airflow's own log set-up writes past pytest's capture)."""
    handler = _Lines()
    logging.getLogger("ballast.airflow.notify").addHandler(handler)
    yield handler
    logging.getLogger("ballast.airflow.notify").removeHandler(handler)


@pytest.fixture
def webhook(monkeypatch):
    _Hook.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AIRFLOW_CONN_BALLAST_HOOK", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("AIRFLOW_CONN_BALLAST_BROKEN", "not a connection uri")
    yield _Hook.received
    server.shutdown()


@pytest.mark.e2e
def test_a_webhook_hears_of_a_retried_try_and_of_a_failed_task(airflow_db, digits_raw, tmp_path, webhook, logged):
    from helpers import run_spec_dag

    def edit(d, conn="ballast_hook"):
        d["dataset"]["location"] = str(digits_raw)
        d["training"].update(epochs=2, checkpoint={"every_steps": 10, "keep_last": 5},
                             rehearsal={"faults": [{"kind": "oom", "step": 25, "on_try": 1}]})
        d["evaluation"].update(threshold=None, patience=10)
        d["recovery"] = {"retry_delay_seconds": 0}
        d["schedule"] = {}
        d["notifications"] = {"webhook": {"conn_id": conn, "endpoint": "/hooks/ballast"},
                              "email": {"to": ["team@example.com"], "conn_id": "ballast_no_smtp"}}

    dr, ctx = run_spec_dag(tmp_path / "a", edit, conf={"rehearsal": True}, name="notify_retry")
    assert str(dr.state) == "success"
    retries = [m for path, m in webhook if m["event"] == "retry"]
    assert len(retries) == 1, webhook
    msg = retries[0]
    assert webhook[0][0] == "/hooks/ballast"
    assert (msg["task_id"], msg["try_number"], msg["failure_class"]) == ("train", 1, "oom")
    assert any("micro-batch 32 -> 16" in a for a in msg["adaptation"]), msg
    assert msg["view"].endswith(f"/dags/{ctx.dag_id}/runs/{dr.run_id.replace(':', '%3A').replace('+', '%2B')}"
                                f"/plugin/ballast-run")
    # The email's SMTP connection does not exist: one line naming it, and the run went on.
    bad = [(lvl, m) for lvl, m in logged.lines if "notification by email through connection 'ballast_no_smtp'" in m]
    assert len(bad) == 1 and bad[0][0] == "ERROR" and "outcome is unchanged" in bad[0][1], logged.lines

    webhook.clear()
    dr, ctx = run_spec_dag(tmp_path / "b", edit, conf={"lr": 0.1}, name="notify_failure")  # a typo: no retry
    assert str(dr.state) == "failed"
    failures = [m for path, m in webhook if m["event"] == "failure"]
    assert [(m["task_id"], m["failure_class"]) for m in failures] == [("validate", "config")], webhook
    assert "closest: lr -> learning_rate" in failures[0]["reason"]

    logged.lines.clear()
    dr, ctx = run_spec_dag(tmp_path / "c", lambda d: edit(d, conn="ballast_broken"), conf={"lr": 0.1},
                           name="notify_broken")
    assert str(dr.state) == "failed"  # failed by its own error, not by the notification's
    lines = [(lvl, m) for lvl, m in logged.lines if "notification by webhook through connection 'ballast_broken'" in m]
    assert len(lines) == 1 and lines[0][0] == "ERROR" and "task's outcome is unchanged" in lines[0][1], logged.lines
