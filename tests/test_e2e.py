"""End to end through Airflow: dag.test() of the example DAG, and a real trigger through the REST API
of a running API server, scheduler and DAG processor."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
from urllib.parse import quote

import pytest
from ballast.pipeline.context import RunContext
from ballast.spec import load_spec
from helpers import EXAMPLE_SPEC, STACK_TEST_ENV

pytestmark = pytest.mark.e2e

# The example model must beat this on the held-out test split (273 digits never seen in training).
MIN_TEST_ACCURACY = 0.90


def report_for(run_id: str) -> dict:
    spec = load_spec(EXAMPLE_SPEC)
    ctx = RunContext(spec=spec, dag_id=spec.dag_id, run_id=run_id)
    return json.loads(ctx.storage.read_bytes(f"{ctx.run_key}/report.json"))


def effective_record(run_id: str) -> dict:
    spec = load_spec(EXAMPLE_SPEC)
    ctx = RunContext(spec=spec, dag_id=spec.dag_id, run_id=run_id)
    return json.loads(ctx.storage.read_bytes(f"{ctx.run_key}/spec.json"))


def effective_spec(run_id: str) -> dict:
    return effective_record(run_id)["spec"]


def test_example_dag_runs_end_to_end_with_dag_test(airflow_db, digits_raw):
    from ballast.dev.dag_run import run_dag

    dr = run_dag("ballast_digits", {"epochs": 15})
    assert str(dr.state) == "success"
    report = report_for(dr.run_id)
    assert report["test"]["metric"] == "accuracy"
    assert report["test"]["value"] >= MIN_TEST_ACCURACY
    assert report["test"]["test_rows"] == 273
    assert report["training"]["epochs"] <= 15
    assert effective_spec(dr.run_id)["training"]["epochs"] == 15
    record = effective_record(dr.run_id)
    assert record["parameters_given"] == {"epochs": 15}
    assert record["parameters_applied"] == {"epochs": {"path": "training.epochs", "spec_value": 30, "value": 15}}
    stages = report["stages"]
    assert stages["validate"]["failures"] == [] and stages["validate"]["rows"] == 1797
    assert stages["verify_checkpoint"]["best"]["parameters"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trigger_through_rest_api_with_changed_parameter(airflow_db, digits_raw, tmp_path):
    from ballast.dev.stack import LocalStack

    with LocalStack(_free_port(), log_dir=tmp_path / "logs", extra_env=STACK_TEST_ENV, migrate=False) as stack:
        dag = stack.wait_for_dag("ballast_digits", timeout=180)
        assert dag["is_paused"] in (True, False)
        # Out of the Param's bounds: refused before any run exists.
        with pytest.raises(urllib.error.HTTPError) as refused:
            stack.trigger("ballast_digits", {"epochs": 0})
        assert refused.value.code == 400
        assert "epochs" in refused.value.read().decode()
        # An unknown name (a typo for learning_rate): Airflow's Params accept extra conf keys, so the run's
        # first task refuses it within seconds, without a retry, naming the closest parameter.
        typo = stack.trigger("ballast_digits", {"lr": 0.1})
        run = stack.trigger("ballast_digits", {"epochs": 3, "learning_rate": 0.005})  # queued behind the typo's
        failed = stack.wait_for_run("ballast_digits", typo["dag_run_id"], timeout=300)
        assert failed["state"] == "failed"
        tis = stack.task_instances("ballast_digits", typo["dag_run_id"])
        assert (tis["validate"]["state"], tis["validate"]["try_number"]) == ("failed", 1)
        assert tis["convert"]["state"] != "success"
        log = stack.task_log("ballast_digits", typo["dag_run_id"], "validate", 1)
        assert "unknown parameter(s) lr" in log and "closest: lr -> learning_rate?" in log, log[-3000:]
        done = stack.wait_for_run("ballast_digits", run["dag_run_id"], timeout=600)
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / "logs").glob("*.log"))
        assert done["state"] == "success", logs
    spec = effective_spec(run["dag_run_id"])
    assert spec["training"]["epochs"] == 3 and spec["training"]["learning_rate"] == 0.005
    report = report_for(run["dag_run_id"])
    assert report["training"]["epochs"] <= 3


def _wait(what: str, check, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


def test_on_the_real_scheduler_a_killed_task_and_a_cancelled_run_leave_no_trainer(airflow_db, digits_raw, tmp_path):
    """The issue's own trial, on the LocalExecutor: SIGKILL the task process that runs `train`; its
    torchrun group must end with it (not at its next log line), the next try must start clean; then
    mark the run failed from the REST API: the cancel is recorded and nothing of the try is left."""
    from ballast.dev.stack import LocalStack
    from ballast.recovery import history
    from ballast.launch.driver import CANCELLED
    from ballast.launch.process import group_members, read_lease

    spec = load_spec(EXAMPLE_SPEC)
    with LocalStack(_free_port(), log_dir=tmp_path / "logs", extra_env=STACK_TEST_ENV, migrate=False) as stack:
        stack.wait_for_dag("ballast_digits", timeout=180)
        run = stack.trigger("ballast_digits", {"epochs": 400, "patience": 1000})  # minutes of training
        ctx = RunContext(spec=spec, dag_id=spec.dag_id, run_id=run["dag_run_id"])
        out = ctx.storage.local_path(f"{ctx.run_key}/train")

        def training(try_number: int):
            lease = read_lease(out)
            beat = out / "heartbeat"
            if lease and lease["try_number"] == try_number and beat.exists() and beat.stat().st_mtime > lease["started"]:
                return lease
            return None

        first = _wait("try 1 training", lambda: training(1), timeout=300)
        assert group_members(first["pgid"], first["token"])
        os.kill(first["task_pid"], signal.SIGKILL)  # the task runner, as an OOM killer or an operator would
        _wait("try 1's torchrun group gone", lambda: not group_members(first["pgid"], first["token"]), timeout=15)
        second = _wait("try 2 training", lambda: training(2), timeout=120)
        assert not group_members(first["pgid"], first["token"])
        stack.request("PATCH", f"/api/v2/dags/ballast_digits/dagRuns/{quote(run['dag_run_id'], safe='')}",
                      {"state": "failed"})
        _wait("try 2's torchrun group gone after the cancel",
              lambda: not group_members(second["pgid"], second["token"]), timeout=30)
        cancel = json.loads((out / CANCELLED).read_text())
        assert cancel["try_number"] == 2, cancel
        assert not (out / "failure.json").exists() or json.loads((out / "failure.json").read_text())["time"] < cancel["time"]
        stack.wait_for_run("ballast_digits", run["dag_run_id"], timeout=60)
        # The run's own state is Airflow's: on SQLite (no row locks) a scheduler loop that loaded the run
        # before the PATCH committed re-evaluates it after, finds every leaf "skipped" and marks it
        # success. What Ballast owns: train failed on its second try and nothing after it ran.
        tis = stack.task_instances("ballast_digits", run["dag_run_id"])
        assert (tis["train"]["state"], tis["train"]["try_number"]) == ("failed", 2), tis["train"]
        after = {k: ti["state"] for k, ti in tis.items() if k not in ("validate", "convert", "warm_cache", "train")}
        assert after and set(after.values()) <= {"skipped", None}, after
    tries = history.load(ctx, "train").attempts
    # Ended by their parent-death signal, the ranks wrote no record: not a "communication" failure of a
    # broken log pipe, which is what the next try read before, but a try lost without a word.
    assert (tries[0].outcome, tries[0].failure_class) == ("failed", "lost"), tries[0]
    assert tries[1].outcome == "cancelled", tries[1]
