"""The Slurm backend on a real Slurm cluster (tests/slurm_cluster.py: slurmctld and three node daemons on
this machine, Debian's slurm-wlm): real sbatch/srun jobs of the example pipeline, a node's failure
excluded from the next try, a kill recovered from the committed checkpoint, a cancel that scancels.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ballast.launch import Launch
from ballast.launch.slurm import script as slurm_script, status as slurm_status
from ballast.errors import Cancelled, ConfigError
from ballast.recovery import history
from ballast.training.outputs import read_heartbeat
from helpers import example_data, make_ctx, run_chain, run_spec_dag
from slurm_cluster import SlurmCluster, available, running_cluster


@pytest.fixture(scope="module")
def cluster():
    why = available()
    if why:
        pytest.fail(why)
    with running_cluster() as c:
        yield c


def slurm_section(**extra) -> dict:
    return {"partition": "spot", "on_demand_partition": "ondemand", "python": sys.executable, "cpus_per_node": 2,
            "memory": "4000M", "poll_seconds": 0.5, **extra}


def on_slurm(d: dict, **extra) -> None:
    d["execution"] = {"backend": "slurm", "slurm": slurm_section(**extra)}


# --- the batch script and the job's states, as data --------------------------------------------------


def spec_on_slurm(**extra):
    from ballast.spec import parse_spec

    d = example_data()
    on_slurm(d, **extra)
    return parse_spec(d)


@pytest.mark.integration
def test_the_batch_script_quotes_every_value_and_the_options_are_arguments(tmp_path):
    spec = spec_on_slurm()
    launch = Launch(name="ballast-digits-0a1b2c3d-t2", try_number=2, nodes=2,
                    command=(sys.executable, "-m", "ballast.node", "--job", "/data/it's here; rm -rf ~/job.json"),
                    env={"WEIRD": "a b $(id) `id` \"q\""}, capacity="on-demand", avoid_hosts=("n2",))
    argv = slurm_script.sbatch_argv(spec, launch, tmp_path / "job.sh", log=tmp_path / "job.log", export=["PATH"])
    assert "--partition=ondemand" in argv and "--exclude=n2" in argv and "--nodes=2" in argv
    assert "--signal=TERM@60" in argv and "--no-requeue" in argv  # the notice: preempt_grace_seconds
    script = slurm_script.batch_script(spec, launch, export=["PATH"])
    # bash itself reads the script back: each value arrives as one word, unexpanded.
    probe = re.sub(r"exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 --export=[A-Z_,]+ ",
                   lambda _: "printf '%s\\n' ", script)
    probe = probe.replace('"$(hostname):$((20000 + SLURM_JOB_ID % 10000))"', "x")
    out = subprocess.run(["bash", "-c", probe + '\nprintf "%s\\n" "$WEIRD"'], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    words = out.stdout.splitlines()
    assert words[:5] == list(launch.command) and words[-1] == "a b $(id) `id` \"q\""
    with pytest.raises(ConfigError, match="not a host name Slurm can exclude"):
        slurm_script.sbatch_argv(spec, Launch(name="x", try_number=1, nodes=1, command=("p",),
                                              avoid_hosts=("n1,n2 --uid=0",)), tmp_path / "j.sh", log=tmp_path / "l",
                                 export=["PATH"])


@pytest.mark.unit
@pytest.mark.parametrize("fields,cls", [
    ("JobId=7 JobState=OUT_OF_MEMORY Reason=OutOfMemory ExitCode=0:125 NodeList=n1 BatchHost=n1", "oom"),
    ("JobId=7 JobState=PREEMPTED Reason=None ExitCode=0:15 NodeList=n[1-2] BatchHost=n1", "preempted"),
    ("JobId=7 JobState=NODE_FAIL Reason=NodeDown ExitCode=0:0 NodeList=n3 BatchHost=n1", "lost"),
    ("JobId=7 JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15 NodeList=n1 BatchHost=n1", "preempted"),
    ("JobId=7 JobState=FAILED Reason=NonZeroExitCode ExitCode=74:0 NodeList=n1 BatchHost=n1", None),
])
def test_job_states_map_to_recovery_classes(fields, cls):
    end = slurm_status.ending(slurm_status.parse_show_job(fields))
    assert end.failure_class == cls and not end.ok
    assert end.host == ("n3" if "NODE_FAIL" in fields else "n1")
    assert slurm_status.ending(slurm_status.parse_show_job("JobId=7 JobState=RUNNING Reason=None")) is None


# --- on the real cluster ------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_partition_that_does_not_exist_fails_the_first_try_naming_it(cluster, tmp_path):
    import logging

    from ballast.launch.slurm import SlurmBackend

    spec = spec_on_slurm(partition="gpu-spot")
    backend = SlurmBackend(spec, tmp_path, logging.getLogger("test"))
    with pytest.raises(ConfigError, match=r"execution\.slurm\.partition: Slurm has no partition 'gpu-spot'"):
        backend.start(Launch(name="ballast-x-t1", try_number=1, nodes=1, command=("true",)))


@pytest.mark.integration
def test_a_cancelled_train_task_scancels_its_job_and_leaves_nothing(cluster, tmp_path, digits_raw):
    from ballast.stages import convert, train, validate, warm_cache
    from ballast.launch.driver import stop_all as stop_running

    ctx = make_ctx(tmp_path, digits_raw, lambda d: (on_slurm(d), d["training"].update(epochs=200)))
    run_chain(ctx, validate, convert, warm_cache)
    ctx.task_id = "train"
    outcome: dict = {}

    def train_it():
        try:
            train.run(ctx)
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc

    t = threading.Thread(target=train_it)
    t.start()
    heartbeat = ctx.work_dir / "train" / "heartbeat"
    deadline = time.monotonic() + 180
    while not heartbeat.exists() and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.5)
    assert heartbeat.exists(), f"training never started: {outcome}"
    assert cluster.jobs(), "no Slurm job while training"
    stop_running("the test cancelled the task")
    t.join(timeout=90)
    assert isinstance(outcome.get("error"), Cancelled), outcome
    deadline = time.monotonic() + 30
    while (cluster.jobs() or cluster.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.jobs() == [] and cluster.leftovers() == []
    tries = history.load(ctx, "train").attempts
    assert [a.outcome for a in tries] == ["cancelled"]


def _fast(d: dict, faults=(), **recovery) -> None:
    d["training"].update(epochs=3, checkpoint={"every_steps": 10, "keep_last": 5}, rehearsal={"faults": list(faults)})
    d["evaluation"].update(threshold=None, patience=10)
    d["recovery"] = {"retry_delay_seconds": 0, **recovery}
    d["schedule"] = {}


@pytest.mark.e2e
def test_the_same_spec_trains_to_the_same_accuracy_on_local_and_slurm(cluster, airflow_db, digits_raw, tmp_path):
    runs = {}
    for backend in ("local", "slurm"):
        def edit(d, backend=backend):
            d["dataset"]["location"] = str(digits_raw)
            _fast(d)
            if backend == "slurm":
                on_slurm(d)
        dr, ctx = run_spec_dag(tmp_path / backend, edit, name=f"same_{backend}")
        assert str(dr.state) == "success", backend
        runs[backend] = ctx.result("train")
    local, slurm = runs["local"], runs["slurm"]
    assert slurm.steps == local.steps and slurm.best.step == local.best.step
    assert slurm.best.value == pytest.approx(local.best.value, abs=1e-9)  # the same world, seed and order


@pytest.mark.e2e
def test_a_failed_node_is_excluded_next_try_and_a_killed_rank_resumes_from_storage(cluster, airflow_db, digits_raw,
                                                                                   tmp_path):
    faults = [{"kind": "ecc", "step": 15, "rank": 1, "on_try": 1},     # hardware, on rank 1's node
              {"kind": "crash", "step": 35, "rank": 1, "on_try": 2}]   # SIGKILL: torchrun restarts the group

    def edit(d):
        d["dataset"]["location"] = str(digits_raw)
        _fast(d, faults, max_restarts=1)
        d["training"].update(nodes=2, processes_per_node=1, global_batch_size=64)
        on_slurm(d)

    dr, ctx = run_spec_dag(tmp_path, edit, conf={"rehearsal": True}, name="slurm_recovery")
    assert str(dr.state) == "success"
    tries = history.load(ctx, "train").attempts
    assert [(a.outcome, a.failure_class) for a in tries] == [("failed", "hardware"), ("success", None)], \
        [a.reason for a in tries]
    bad = tries[0].host
    assert re.fullmatch(r"n[1-3]", bad), bad  # the Slurm node the failing rank ran on
    assert tries[1].settings["avoid_hosts"] == [bad]
    logs = sorted((ctx.work_dir / "train" / "jobs").glob("*-t2.log"))
    assert logs, "try 2 left no job log"
    log = logs[0].read_text()
    ran_on = set(re.findall(r"node \d of 2 on (n\d)", log))
    assert len(ran_on) == 2 and bad not in ran_on, log[-3000:]  # sbatch --exclude kept it off that node
    assert "resumed from" in log and tries[1].resumed_step is not None and tries[1].resumed_step >= 10
    assert tries[1].group_restarts >= 1  # the crash in try 2 was recovered inside the try
    assert cluster.jobs() == [] and cluster.leftovers() == []


@pytest.fixture
def s3_bucket(monkeypatch):
    """A real S3 server over HTTP on loopback (moto), reachable from the Slurm job's processes through
    the environment sbatch exports."""
    import boto3
    from helpers import free_port
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="ballast-slurm")
    yield "ballast-slurm"
    server.stop()


@pytest.mark.e2e
def test_with_s3_storage_a_node_pulls_and_pushes_checkpoints_and_its_record_comes_back(cluster, airflow_db, digits_raw,
                                                                                      tmp_path, s3_bucket):
    faults = [{"kind": "oom", "step": 25, "rank": 0, "on_try": 1}]

    def edit(d):
        d["dataset"]["location"] = str(digits_raw)
        d["storage"] = {"uri": f"s3://{s3_bucket}/pipelines"}
        _fast(d, faults)
        on_slurm(d)

    dr, ctx = run_spec_dag(tmp_path, edit, conf={"rehearsal": True}, name="slurm_s3")
    assert str(dr.state) == "success"
    tries = history.load(ctx, "train").attempts
    # try 1's failure record reached the task through storage: its class, its step, the Slurm node
    assert [(a.outcome, a.failure_class) for a in tries] == [("failed", "oom"), ("success", None)]
    assert re.fullmatch(r"n[1-3]", tries[0].host) and tries[0].step_reached >= 20
    assert tries[1].settings["micro_batch_size"] == 16  # the adaptation reached the node
    from ballast.node import outputs_prefix

    ran = json.loads(ctx.storage.read_bytes(outputs_prefix(ctx.run_key, 2, node=0) + "run-node0.json"))
    assert ran["batch"]["micro_batch_size"] == 16  # in the run config its trainer read (no env variable)
    keys = set(ctx.storage.list(f"{ctx.run_key}/checkpoints/"))
    committed = sorted(k.split("/")[-2] for k in keys if k.endswith("/COMMITTED"))
    assert committed, "no checkpoint reached storage"
    log = next((ctx.work_dir / "train" / "jobs").glob("*-t2.log")).read_text()
    assert re.search(r"checkpoints from storage: step-\d+", log), log[-3000:]  # pulled before training
    assert "resumed from" in log
    trained = ctx.result("train")
    assert trained.uploaded_checkpoints and Path(trained.last_checkpoint).name in committed
    # The stability view reads only storage: the event log came back there, and it draws the curves.
    from ballast.ui.summary import run_summary

    view = run_summary(ctx.storage, ctx.dag_id, ctx.run_id)
    assert view["records"]["states"]["train/metrics.jsonl"] == "ok" and view["curves"]["step"], view["records"]
    assert view["recovery"]["failures_by_class"] == {"oom": 1}
    assert cluster.jobs() == [] and cluster.leftovers() == []


@pytest.mark.e2e
def test_a_preempted_job_checkpoints_and_the_next_try_asks_for_the_on_demand_partition(cluster, airflow_db,
                                                                                       digits_raw, tmp_path):
    """A job of the higher-tier partition takes every node from the training job: Slurm preempts it
    (SIGTERM, grace, then the end), the try is recorded preempted, and the next try's sbatch asks for
    the on-demand partition (recovery.on_demand_after_preemptions: 1)."""
    import subprocess as sp

    def edit(d):
        d["dataset"]["location"] = str(digits_raw)
        _fast(d, on_demand_after_preemptions=1)
        d["training"].update(epochs=400)  # longer than the test: each try ends at max_seconds or preempted
        d["evaluation"].update(patience=1000)
        d["training"]["rehearsal"] = {"max_seconds": 14}
        on_slurm(d)

    done = threading.Event()

    def preempt():
        # Once try 1's job is running and its trainers have taken a few steps, take all nodes.
        deadline = time.monotonic() + 240
        runs = Path(os.environ["BALLAST_HOME"]) / "storage" / "runs" / "ballast_slurm_preempt"
        while time.monotonic() < deadline and not done.is_set():
            beats = [read_heartbeat(p.parent) for p in runs.glob("*/train/heartbeat")]
            if any(b and b.step >= 3 for b in beats) and any(j.endswith("RUNNING") for j in cluster.jobs()):
                sp.run(["sbatch", "-p", "ondemand", "-N3", "--exclusive", "-J", "preemptor", "--output=/dev/null",
                        "--wrap", "sleep 1"],
                       capture_output=True, text=True, env=cluster.env)
                return
            time.sleep(0.2)

    t = threading.Thread(target=preempt, daemon=True)
    t.start()
    try:
        dr, ctx = run_spec_dag(tmp_path, edit, name="slurm_preempt")
    finally:
        done.set()
        t.join(timeout=10)
    tries = history.load(ctx, "train").attempts
    assert tries[0].outcome == "failed" and tries[0].failure_class == "preempted", tries[0]
    assert tries[1].settings["capacity"] == "on-demand"
    jobs = sp.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True, env=cluster.env).stdout
    fields = [slurm_status.parse_show_job(line) for line in jobs.splitlines()]
    mine = {f["JobName"].rsplit("-", 1)[-1]: f for f in fields if f.get("JobName", "").startswith("ballast-slurm-preempt")}
    t1 = mine["t1"]
    # Slurm sends SIGTERM to the job; the trainer commits its checkpoint inside the grace time and the
    # job ends before Slurm has to end it (FAILED, 143: the batch shell's SIGTERM); had it not, PREEMPTED.
    assert t1["Partition"] == "spot" and (t1["JobState"] == "PREEMPTED" or t1["ExitCode"] in ("75:0", "143:0")), t1
    assert mine["t2"]["Partition"] == "ondemand"
    assert str(dr.state) == "success"
    assert tries[1].resumed_step is not None  # try 1 committed a checkpoint before it was ended


@pytest.mark.e2e
def test_a_job_at_its_time_limit_gets_the_notice_first_and_the_next_try_resumes(cluster, airflow_db, digits_raw,
                                                                               tmp_path):
    """A two-minute job whose training stalls at step 25 (a hang fault in try 1, the watchdogs set past
    the limit): Slurm's `--signal=TERM@10` reaches the trainers before the time limit (up to 30 s
    early, Slurm says: its timer checks limits every 30 s), their grace runs out with no step to
    checkpoint at, and they leave a `preempted` record: the job ends inside its limit. The next try
    resumes from the last committed checkpoint and finishes. Once the stall has begun, the test brings
    the job's end to 45 s away (`scontrol update EndTime`, which Slurm allows a user on a running job,
    shortening only): the same limit, checked by the same timer, a minute less of waiting."""
    import subprocess as sp

    faults = [{"kind": "hang", "step": 25, "on_try": 1}]

    def edit(d):
        d["dataset"]["location"] = str(digits_raw)
        _fast(d, faults, preempt_grace_seconds=10)
        on_slurm(d, time_limit_minutes=2)
        d["execution"]["hang_timeout_seconds"] = 600  # neither watchdog: the time limit ends try 1

    done, moved = threading.Event(), {}

    def shorten():
        runs = Path(os.environ["BALLAST_HOME"]) / "storage" / "runs" / "ballast_slurm_timelimit"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not done.is_set():
            if list(runs.glob("*/train/.fault-hang-*-try1-rank0.fired")):  # written as the stall begins
                queue = sp.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, env=cluster.env)
                job = next((ln.split()[0] for ln in queue.stdout.splitlines() if ln.endswith("-t1")), None)
                if job:
                    show = sp.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                                  env=cluster.env).stdout
                    moved["limit"] = slurm_status.parse_show_job(show.strip())["TimeLimit"]
                    moved["update"] = sp.run(["scontrol", "update", f"JobId={job}", "EndTime=now+45"],
                                             capture_output=True, text=True, env=cluster.env)
                    return
            time.sleep(0.5)

    t = threading.Thread(target=shorten, daemon=True)
    t.start()
    started = time.monotonic()
    try:
        dr, ctx = run_spec_dag(tmp_path, edit, conf={"rehearsal": True}, name="slurm_timelimit")
    finally:
        done.set()
        t.join(timeout=10)
    assert moved.get("limit") == "00:02:00", moved  # the spec's limit, as sbatch gave it
    assert moved["update"].returncode == 0, moved["update"].stderr
    assert str(dr.state) == "success"
    tries = history.load(ctx, "train").attempts
    assert [(a.outcome, a.failure_class) for a in tries] == [("failed", "preempted"), ("success", None)], tries
    assert tries[1].resumed_step is not None and tries[1].resumed_step >= 10, tries[1]
    jobs = sp.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True, env=cluster.env).stdout
    fields = [slurm_status.parse_show_job(line) for line in jobs.splitlines()]
    t1 = next(f for f in fields if f.get("JobName", "").startswith("ballast-slurm-timelimit") and
              f["JobName"].endswith("-t1"))
    # Ended inside the limit by the trainers' preempted exit (75; 143 where srun reports the notice's
    # SIGTERM), not by Slurm at it (TIMEOUT).
    assert t1["JobState"] == "FAILED" and t1["ExitCode"] in ("75:0", "143:0"), t1
    assert _seconds(t1["RunTime"]) < 120, t1
    # The notice came first: at the limit itself Slurm's SIGTERM is followed by SIGKILL after KillWait
    # (5 s), before a 10 s grace could run out and write this record.
    assert "grace period of 10s expired" in tries[0].reason, tries[0]
    assert time.monotonic() - started < 360
    assert cluster.jobs() == [] and cluster.leftovers() == []


def _seconds(hms: str) -> int:
    parts = [int(p) for p in hms.replace("-", ":").split(":")]
    return sum(p * 60 ** i for i, p in enumerate(reversed(parts[-3:]))) + (parts[0] * 86400 if len(parts) == 4 else 0)


# --- what reaches a node, and a stop that did not end the job ----------------------------------------

CANARIES = {"AIRFLOW__API_AUTH__JWT_SECRET": "canary-jwt", "AIRFLOW__CORE__FERNET_KEY": "canary-fernet",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:canary-db@h/a",
            "AIRFLOW_CONN_FOO": "aws://canary-login:canary-password@", "AWS_SECRET_ACCESS_KEY": "canary-aws"}


class FakeSlurm:
    """A stand-in for Slurm's clients (sbatch, scontrol, scancel), in place of `slurm._run`: records what
    each was given; the job runs until a scancel that works ends it."""

    def __init__(self, *, scancel_works: bool = True):
        self.calls: list[list[str]] = []
        self.sbatch_env: dict | None = None
        self.state, self.scancel_works = "RUNNING", scancel_works

    def __call__(self, argv, env=None):
        self.calls.append(list(argv))
        if argv[0] == "sbatch":
            self.sbatch_env = dict(os.environ if env is None else env)  # None: the real _run passes the worker's
            return subprocess.CompletedProcess(argv, 0, "4242\n", "")
        if argv[0] == "scancel":
            if not self.scancel_works:
                return subprocess.CompletedProcess(argv, 1, "", "scancel: error: Kill job error on job id 4242:"
                                                                " Access/permission denied")
            self.state = "CANCELLED"
            return subprocess.CompletedProcess(argv, 0, "", "")
        if argv[:2] == ["scontrol", "show"]:
            return subprocess.CompletedProcess(argv, 0, f"JobId=4242 JobState={self.state} Reason=None"
                                                        f" ExitCode=0:0 NodeList=n1 BatchHost=n1\n", "")
        raise AssertionError(f"unexpected Slurm command {argv}")


@pytest.mark.unit
def test_a_few_failed_polls_of_slurm_do_not_end_a_healthy_job_but_many_do(tmp_path, monkeypatch):
    import logging

    from ballast.launch import slurm
    from ballast.errors import LaunchError
    from ballast.spec import parse_spec

    class Flaky(FakeSlurm):
        def __init__(self, failures: int):
            super().__init__()
            self.failures = failures

        def __call__(self, argv, env=None):
            if argv[0] == "sacct":  # the accounting fallback: no answer either
                return subprocess.CompletedProcess(argv, 1, "", "sacct: error: Slurm accounting storage is disabled")
            if argv[:2] == ["scontrol", "show"] and self.failures:
                self.failures -= 1
                return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Socket timed out")
            if argv[:2] == ["scontrol", "show"]:
                self.state = "COMPLETED"
            return super().__call__(argv, env)

    d = example_data()
    on_slurm(d)
    d["execution"]["slurm"]["poll_seconds"] = 0.01
    backend = slurm.SlurmBackend(parse_spec(d), tmp_path, logging.getLogger("test"))
    handle = {"job_id": "4242", "log": str(tmp_path / "job.log")}
    (tmp_path / "job.log").write_text("")
    monkeypatch.setattr(slurm, "_run", Flaky(backend.state_misses - 1))
    ending = backend.wait(handle, on_line=lambda line: None, should_stop=lambda: False)
    assert not ending.cancelled and "scancel" not in [c[0] for c in slurm._run.calls]
    monkeypatch.setattr(slurm, "_run", Flaky(backend.state_misses))
    with pytest.raises(LaunchError, match="Socket timed out"):
        backend.wait(handle, on_line=lambda line: None, should_stop=lambda: False)


@pytest.mark.unit
def test_the_preview_of_a_slurm_try_shows_its_export_list_and_script():
    from ballast.launch import preview
    from ballast.spec import parse_spec

    d = example_data()
    on_slurm(d)
    text = preview.render(parse_spec(d), try_number=2, after=["preempted"])
    assert "# sbatch --parsable" in text and "--export=" in text and "--export=ALL" not in text
    assert "srun" in text and "--partition=" in text


def _export_list(word: str) -> set[str]:
    assert word.startswith("--export=") and "ALL" not in word.split("=", 1)[1].split(","), word
    return set(word.split("=", 1)[1].split(","))


@pytest.mark.unit
@pytest.mark.parametrize("storage", ["local", "s3", "s3+connection"])
def test_sbatch_and_srun_export_only_what_the_node_needs_and_the_script_is_private_from_creation(
        tmp_path, monkeypatch, storage):
    import logging
    import stat

    from ballast.storage import s3 as storage_s3
    from ballast.launch import slurm
    from ballast.spec import parse_spec

    for name, value in {**CANARIES, "BALLAST_HOME": "/srv/ballast", "PATH": "/usr/bin:/bin",
                        "SLURM_CONF": "/etc/slurm/slurm.conf", "SBATCH_ACCOUNT": "ml", "HTTPS_PROXY": "http://px:3128",
                        "AWS_SESSION_TOKEN": "worker-token"}.items():
        monkeypatch.setenv(name, value)
    d = example_data()
    on_slurm(d)
    if storage != "local":
        d["storage"] = {"uri": "s3://ballast-bucket/pipelines", "conn_id": "ballast_s3" if "+" in storage else None}
    spec = parse_spec(d)
    monkeypatch.setattr(storage_s3, "_s3_connection_kwargs", lambda conn_id: {
        "aws_access_key_id": "conn-key", "aws_secret_access_key": "conn-secret", "endpoint_url": "http://s3:9000"})
    fake = FakeSlurm()
    monkeypatch.setattr(slurm, "_run", fake)
    modes: list[int] = []
    real_fdopen = os.fdopen

    def fdopen(fd, *args, **kwargs):  # the script's mode when it is created, before a byte is in it
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", fdopen)
    old_umask = os.umask(0)  # the mode must not rely on the worker's umask
    try:
        SlurmBackend = slurm.SlurmBackend
        SlurmBackend(spec, tmp_path / "jobs", logging.getLogger("test")).start(
            Launch(name="ballast-x-t1", try_number=1, nodes=2, command=(sys.executable, "-m", "ballast.node")))
    finally:
        os.umask(old_umask)
    script = tmp_path / "jobs" / "ballast-x-t1.sh"
    assert modes == [0o700] and stat.S_IMODE(script.stat().st_mode) == 0o700
    (argv,) = [c for c in fake.calls if c[0] == "sbatch"]
    exported = _export_list(next(w for w in argv if w.startswith("--export")))
    env = fake.sbatch_env
    text = script.read_text()
    everything = " ".join(argv) + text + repr(env)
    assert not [v for v in CANARIES.values() if v in everything.replace("canary-aws", "")] and \
        not any(n.startswith("AIRFLOW") for n in env), env
    # sbatch's own input reaches sbatch, not the job:
    assert exported == set(env) - {"SLURM_CONF", "SBATCH_ACCOUNT"} and env["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    assert env["BALLAST_HOME"] == "/srv/ballast" and env["PATH"] == "/usr/bin:/bin" and env["SBATCH_ACCOUNT"] == "ml"
    if storage == "local":
        assert not any(n.startswith("AWS_") for n in env) and "HTTPS_PROXY" not in env  # no S3: nothing of it
    elif storage == "s3":
        assert env["AWS_SECRET_ACCESS_KEY"] == "canary-aws"  # the worker's S3 credentials, the nodes need them
        assert env["AWS_SESSION_TOKEN"] == "worker-token" and env["HTTPS_PROXY"] == "http://px:3128"
    else:
        assert env["AWS_ACCESS_KEY_ID"] == "conn-key" and env["AWS_SECRET_ACCESS_KEY"] == "conn-secret" \
            and env["AWS_ENDPOINT_URL_S3"] == "http://s3:9000"  # the connection's, not the worker's
        assert "AWS_SESSION_TOKEN" not in env and env["HTTPS_PROXY"] == "http://px:3128"  # no mixed key pair
    srun = next(line for line in text.splitlines() if "srun" in line)
    srun_exports = _export_list(next(w for w in srun.split() if w.startswith("--export")))
    assert exported | {"NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "BALLAST_RDZV_ENDPOINT"} == srun_exports


@pytest.mark.unit
def test_a_slurm_stop_that_did_not_end_the_job_keeps_its_lease_and_the_next_try_ends_it_first(tmp_path,
                                                                                              monkeypatch):
    import json
    import logging

    from ballast.launch import driver, slurm
    from ballast.errors import LaunchError

    spec = spec_on_slurm(poll_seconds=0.05)
    fake = FakeSlurm(scancel_works=False)  # scancel refused: the job goes on running
    monkeypatch.setattr(slurm, "_run", fake)
    monkeypatch.setattr(slurm.SlurmBackend, "stop_wait_seconds", 0.3)
    log = logging.getLogger("test")
    out = tmp_path / "train"
    out.mkdir()
    backend = slurm.SlurmBackend(spec, out / "jobs", log)
    launch = Launch(name="ballast-x-t1", try_number=1, nodes=1, command=("true",))
    end = driver.run(backend, launch, out, log, hang_timeout=0.0, heartbeat=True)  # no heartbeat: a hang
    assert json.loads((out / driver.JOB_LEASE).read_text())["job_id"] == "4242"  # kept: the job may still run
    assert end.hung and end.left_running and ["scancel", "4242"] in fake.calls
    with pytest.raises(LaunchError, match=r"remote\.json: try 1's slurm job 4242 has not ended") as err:
        driver.end_leftovers(lambda: backend, out, log)  # the next try: not beside it
    assert err.value.failure_class == "communication" and (out / driver.JOB_LEASE).exists()
    fake.scancel_works = True
    fake.calls.clear()
    lease = driver.end_leftovers(lambda: backend, out, log)
    assert lease["job_id"] == "4242" and not (out / driver.JOB_LEASE).exists()
    assert fake.calls[0] == ["scancel", "4242"] and fake.state == "CANCELLED"


def _stored_environment(cluster: SlurmCluster, job_id: str) -> bytes:
    """The environment slurmctld keeps of a job (its state directory), as submitted."""
    return b"".join(p.read_bytes() for p in (cluster.base / "spool" / "ctld").rglob(f"job.{job_id}/environment"))


@pytest.mark.integration
def test_a_slurm_job_gets_no_secret_of_the_workers_environment_on_its_nodes_or_in_slurm(cluster, tmp_path,
                                                                                         monkeypatch):
    import logging

    from ballast.launch.slurm import SlurmBackend

    for name, value in {**CANARIES, "BALLAST_PROBE": "probe-7f3a"}.items():
        monkeypatch.setenv(name, value)
    backend = SlurmBackend(spec_on_slurm(), tmp_path / "jobs", logging.getLogger("test"))
    handle = backend.start(Launch(name="ballast-env-t1", try_number=1, nodes=2, command=("env",)))
    stored = _stored_environment(cluster, handle["job_id"])
    lines: list[str] = []
    end = backend.wait(handle, on_line=lines.append, should_stop=lambda: False)
    assert end.ok, (end, lines[-20:])
    env = set(lines)  # each node's task prints its environment
    assert {"BALLAST_PROBE=probe-7f3a", "NCCL_DEBUG=WARN", "SLURM_NODEID=0", "SLURM_NODEID=1"} <= env, sorted(env)
    assert not [line for line in env if any(v in line for v in CANARIES.values())]
    assert not [line for line in env if line.startswith(("AIRFLOW", "AWS_"))]
    assert b"probe-7f3a" in stored, "no stored environment found to check"  # what Slurm keeps of the job
    assert not [v for v in CANARIES.values() if v.encode() in stored]


@pytest.mark.integration
def test_a_slurm_job_that_outlives_its_stop_keeps_its_lease_and_the_next_try_ends_it(cluster, tmp_path):
    import logging
    from collections import deque

    from ballast.launch import driver
    from ballast.launch.slurm import SlurmBackend

    spec = spec_on_slurm()
    log = logging.getLogger("test")
    out = tmp_path / "train"
    out.mkdir()
    backend = SlurmBackend(spec, out / "jobs", log)
    backend.stop_wait_seconds = 1.0  # shorter than KillWait (5 s): the job below outlives the wait
    # It ignores SIGTERM: Slurm ends it with SIGKILL KillWait after scancel.
    launch = Launch(name="ballast-stubborn-t1", try_number=1, nodes=1,
                    command=("/bin/sh", "-c", "trap '' TERM; echo started; exec sleep 300"))
    tail: deque[str] = deque(maxlen=20)

    def cancel_once_started():
        deadline = time.monotonic() + 120
        while "started" not in tail and time.monotonic() < deadline:
            time.sleep(0.2)
        driver.stop_all("the test stops the task")

    t = threading.Thread(target=cancel_once_started, daemon=True)
    t.start()
    end = driver.run(backend, launch, out, log, hang_timeout=600, heartbeat=False, tail=tail)
    t.join(timeout=10)
    assert (out / driver.JOB_LEASE).exists()  # the job may still run: the next try must end it
    assert end.cancelled and end.left_running, end
    next_try = SlurmBackend(spec, out / "jobs", log)  # the next try's, waiting as long as it takes
    lease = driver.end_leftovers(lambda: next_try, out, log)
    assert lease["name"] == launch.name and not (out / driver.JOB_LEASE).exists()
    assert cluster.jobs() == [] and cluster.leftovers() == []
