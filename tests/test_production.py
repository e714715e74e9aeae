"""The production path on this machine: the REST trigger test on PostgreSQL as the metadata database and
the CeleryExecutor with a Redis broker and two Celery workers (tests/prod_services.py), with the
scheduler SIGKILLed while `train` runs and started again: the run finishes, its train task is adopted
(one try), and at no moment do two training groups run."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error

import pytest
from ballast.pipeline.context import RunContext
from ballast.spec import load_spec
from helpers import EXAMPLE_SPEC, STACK_TEST_ENV, free_port
from prod_services import Postgres, Redis, missing

pytestmark = pytest.mark.e2e

LEASE = b"BALLAST_LEASE="


def training_groups() -> set[str]:
    """The lease tokens of every live supervised training process of this test session (one per try's
    group): those on this machine whose environment names the session's BALLAST_HOME (another pytest-xdist
    worker's trainers have their own)."""
    home = f"BALLAST_HOME={os.environ['BALLAST_HOME']}".encode()
    tokens = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if home in env:
            tokens.update(e[len(LEASE):].decode() for e in env if e.startswith(LEASE))
    return tokens


def production_env(pg: Postgres, redis: Redis) -> dict[str, str]:
    return {
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": pg.url,
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CELERY__BROKER_URL": redis.url,
        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + pg.url,
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": "1",
        # A dead scheduler's job is declared failed after 10 s without a heartbeat, and the new one looks
        # for its orphaned tasks every 2 s (defaults 30 s and 300 s: a test cannot wait five minutes).
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "10",
        "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "2",
        **STACK_TEST_ENV,
    }


def test_trigger_on_postgres_and_celery_survives_a_scheduler_restart_without_duplicate_training(
        airflow_db, digits_raw, tmp_path):
    from ballast.dev.stack import LocalStack
    from ballast.recovery import history
    from ballast.launch.process import read_lease

    if why := missing():
        pytest.fail(why)
    spec = load_spec(EXAMPLE_SPEC)
    with Postgres() as pg, Redis() as redis, LocalStack(free_port(), log_dir=tmp_path / "logs", celery_workers=2,
                                                        extra_env=production_env(pg, redis)) as stack:
        stack.wait_for_dag("ballast_digits", timeout=180)
        with pytest.raises(urllib.error.HTTPError) as refused:
            stack.trigger("ballast_digits", {"epochs": 0})
        assert refused.value.code == 400 and "epochs" in refused.value.read().decode()
        typo = stack.trigger("ballast_digits", {"lr": 0.1})
        # Queued behind the typo's run (max_active_runs=1). Long enough to be adopted: the new scheduler
        # adopts ~12 s after the kill (10 s to declare the old one dead, a 2 s check), training ~35 s.
        run = stack.trigger("ballast_digits", {"epochs": 100, "patience": 1000, "learning_rate": 0.005})
        assert stack.wait_for_run("ballast_digits", typo["dag_run_id"], timeout=300)["state"] == "failed"
        tis = stack.task_instances("ballast_digits", typo["dag_run_id"])
        assert (tis["validate"]["state"], tis["validate"]["try_number"]) == ("failed", 1)
        assert "closest: lr -> learning_rate?" in stack.task_log("ballast_digits", typo["dag_run_id"], "validate", 1)

        ctx = RunContext(spec=spec, dag_id=spec.dag_id, run_id=run["dag_run_id"])
        out = ctx.storage.local_path(f"{ctx.run_key}/train")
        deadline = time.monotonic() + 400
        while not ((lease := read_lease(out)) and (out / "heartbeat").exists()):
            assert time.monotonic() < deadline, "train did not start within 400 s"
            time.sleep(0.2)
        stack.restart("scheduler")  # SIGKILL mid-run, then a new scheduler, as a process manager would
        seen, most = set(), 0
        while (state := stack.request("GET", f"/api/v2/dags/ballast_digits/dagRuns/{run['dag_run_id']}")["state"]) \
                not in ("success", "failed"):
            groups = training_groups()
            seen |= groups
            most = max(most, len(groups))
            assert time.monotonic() < deadline + 600, "the run did not finish within 10 minutes of training"
            time.sleep(0.2)
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / "logs").glob("*.log"))
        assert state == "success", logs
        tis = stack.task_instances("ballast_digits", run["dag_run_id"])
        assert tis["train"]["try_number"] == 1, tis["train"]  # adopted by the new scheduler, not run again
        scheduler_log = (tmp_path / "logs" / "scheduler.log").read_text(errors="replace")
        ran = {i: (tmp_path / "logs" / f"celery-worker-{i}.log").read_text(errors="replace")
               .count("Executing workload in Celery") for i in (1, 2)}
    assert all(ran.values()), f"each Celery worker ran tasks: {ran}"
    assert most == 1 and seen == {lease["token"]}, (most, seen, lease)
    # The new scheduler declared the killed one's job dead and adopted its running train task from Celery.
    restarted = scheduler_log[scheduler_log.rindex("Starting the scheduler"):]
    assert re.search(r"Adopted the following \d+ tasks from a dead executor\s+<TaskInstance: ballast_digits\.train ",
                     restarted), "no adoption: did train end before the new scheduler looked? " + restarted[-3000:]
    attempts = history.load(ctx, "train").attempts
    assert [a.outcome for a in attempts] == ["success"], attempts
    effective = json.loads(ctx.storage.read_bytes(f"{ctx.run_key}/spec.json"))["spec"]["training"]
    assert (effective["epochs"], effective["learning_rate"]) == (100, 0.005)
    assert json.loads(ctx.storage.read_bytes(f"{ctx.run_key}/report.json"))["test"]["value"] >= 0.90
