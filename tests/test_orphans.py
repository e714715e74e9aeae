"""No orphans, no duplicates: nothing of a training try outlives its task, the next try ends what an
earlier one left before it starts, a cancel is recorded as one, and `ballast ui` takes its Airflow
processes down with it. Real processes throughout: torchrun (training.launch) with two CPU ranks on
the digits cache, and a stand-in `airflow` for the UI's stack."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ballast.launch import Launch
from ballast.launch.driver import CANCELLED, read_cancel, stop_all, was_cancelled
from ballast.launch.driver import run as run_try
from ballast.launch.local import LocalBackend
from ballast.launch.process import LEASE, LEASE_ENV, end_leftovers, group_members, read_lease
from helpers import config, free_port
from ballast.training.parentdeath import proc_stat

pytestmark = pytest.mark.integration


class ListLog:
    """A logger stand-in keeping every message, for asserting on what the task log would show."""

    def __init__(self):
        self.lines: list[str] = []

    def _add(self, msg, *args):
        self.lines.append(msg % args if args else msg)

    info = warning = error = debug = _add


class Ctx:
    def __init__(self):
        self.log = ListLog()


def two_ranks(d: dict) -> None:
    d["training"].update(processes_per_node=2, global_batch_size=64)


def launch_argv(cfg: Path) -> list[str]:
    """What the train stage runs (ballast.launch.config.torchrun_argv), for one node of two ranks."""
    return [sys.executable, "-m", "ballast.training.torchrun", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0",
            "--monitor-interval=0.5", "--standalone", "--module", "ballast.training", "--config", str(cfg)]


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(poll)


def seconds_until_gone(pgid: int, token: str, timeout: float = 10.0) -> float:
    """Seconds until no process of the group carrying `token` is left (fails past `timeout`)."""
    t0 = time.monotonic()
    wait_for(lambda: not group_members(pgid, token), timeout, f"process group {pgid} to end", poll=0.02)
    return time.monotonic() - t0


def supervise(argv: list[str], out: Path, ctx, *, hang_timeout: float, try_number: int = 1,
              abort=None) -> tuple[int, bool]:
    """What the train stage does for a local try: the one driver runs it on the local backend. (rc, hung)."""
    stop = (lambda: (error := abort()) and f"the cache warm-up failed ({error})") if abort is not None else None
    end = run_try(LocalBackend(out, ctx.log), Launch(name="t", try_number=try_number, nodes=1, command=tuple(argv)),
                  out, ctx.log, hang_timeout=hang_timeout, should_stop=stop)
    return end.exit_code, end.hung


def heartbeat_step(out: Path) -> int:
    try:
        return int((out / "heartbeat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


TASK_RUNNER = r"""
import logging, sys
from pathlib import Path
from ballast.launch import Launch
from ballast.launch.driver import run
from ballast.launch.local import LocalBackend

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
log, out = logging.getLogger("task"), Path(sys.argv[1])
end = run(LocalBackend(out, log), Launch(name="t", try_number=1, nodes=1, command=tuple(sys.argv[2:])), out, log,
          hang_timeout=600)
print("the try ended", end, flush=True)
"""


@pytest.mark.parametrize("state", ["silent", "training"])
def test_a_sigkilled_task_runner_leaves_no_trainer_once_the_next_try_starts(tmp_path, digits_cache, state):
    # silent: both ranks hang (sleep) at step 20, so from then on nothing of the group writes a line and
    # only the parent-death signals, not a broken pipe at the next log line, can end it. training: killed
    # mid-training, where a rank's next line can hit the broken pipe before its signal: still no record.
    out = tmp_path / "out"
    out.mkdir()
    faults = [{"kind": "hang", "step": 20}] if state == "silent" else []
    cfg = config(tmp_path, digits_cache, epochs=200, edit=two_ranks, changes={"rehearsal.faults": faults})
    with open(tmp_path / "task.log", "w") as task_log:
        task = subprocess.Popen([sys.executable, "-c", TASK_RUNNER, str(out), *launch_argv(cfg)], stdout=task_log,
                                stderr=subprocess.STDOUT)
    try:
        hung = [out / f".fault-hang-step20-try0-rank{r}.fired" for r in (0, 1)]
        ready = (lambda: all(p.exists() for p in hung)) if state == "silent" else (lambda: heartbeat_step(out) >= 15)
        wait_for(lambda: ready() or task.poll() is not None, 120, f"the group to be {state}")
        assert task.poll() is None, (tmp_path / "task.log").read_text()[-3000:]
        lease = read_lease(out)
        assert lease["try_number"] == 1 and lease["task_pid"] == task.pid and lease["host"] == socket.gethostname()
        pgid, token = lease["pgid"], lease["token"]
        members = group_members(pgid, token)
        assert len(members) >= 4, members  # torchrun, its forkserver, two ranks (and their loader workers)
        if state == "silent":
            time.sleep(1.0)  # nothing of the group has written since
        task.kill()
        task.wait()
        gone = seconds_until_gone(pgid, token)
    finally:
        if task.poll() is None:
            task.kill()
        lease = read_lease(out)
        if lease and group_members(lease["pgid"], lease["token"]):  # the test failed: leave nothing behind
            os.killpg(lease["pgid"], signal.SIGKILL)
    print(f"\n[orphans] SIGKILLed task runner ({state}): its group of {len(members)} processes gone {gone:.2f}s later")
    assert gone < 5.0  # well under a second alone; a test beside it on the same two cores slows the teardown
    assert not (out / "failure.json").exists()  # the abandoned try recorded no failure for the next to misread
    # The next try: the lease names the ended try, and nothing is left to end.
    log = ListLog()
    found = end_leftovers(out, log)
    assert found["try_number"] == 1 and found["pgid"] == pgid and found["leftover_processes"] == 0
    assert not (out / LEASE).exists() and not log.lines


SLEEPER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);" \
          " time.sleep(600)"


def write_lease(out: Path, pgid: int, token: str, *, host: str | None = None, try_number: int = 1) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / LEASE).write_text(json.dumps({
        "version": 1, "host": host or socket.gethostname(), "boot_id": None, "pgid": pgid, "pid": pgid,
        "pid_start": proc_stat(pgid)[3], "task_pid": 1, "try_number": try_number, "started": time.time(),
        "token": token}))


def test_b_next_try_ends_a_live_leftover_group_but_not_a_reused_pid(tmp_path):
    token = uuid.uuid4().hex
    leftover = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True,
                                env=dict(os.environ, **{LEASE_ENV: token}))
    unrelated = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    try:
        wait_for(lambda: len(group_members(leftover.pid)) == 2 and len(group_members(unrelated.pid)) == 2, 20,
                 "both groups to have two processes")
        # A try that left its group running (its task runner hung, or was stopped without a signal).
        write_lease(tmp_path / "a", leftover.pid, token, try_number=3)
        log = ListLog()
        t0 = time.monotonic()
        found = end_leftovers(tmp_path / "a", log)
        took = time.monotonic() - t0
        assert found["try_number"] == 3 and found["leftover_processes"] == 2 and found["same_host"]
        assert not group_members(leftover.pid) and not (tmp_path / "a" / LEASE).exists()
        assert len(log.lines) == 1 and "try 3" in log.lines[0] and str(leftover.pid) in log.lines[0] \
            and socket.gethostname() in log.lines[0], log.lines
        assert leftover.wait(timeout=5) == -signal.SIGKILL

        # A lease whose group id now belongs to another process (the old try ended, the pid was reused):
        # its processes do not carry the lease's token, and are left alone.
        write_lease(tmp_path / "b", unrelated.pid, uuid.uuid4().hex, try_number=4)
        found = end_leftovers(tmp_path / "b", ListLog())
        assert found["try_number"] == 4 and found["leftover_processes"] == 0
        assert unrelated.poll() is None and len(group_members(unrelated.pid)) == 2

        # A lease from another host: reported, not acted on (that host's backend ends it).
        write_lease(tmp_path / "c", unrelated.pid, token, host="elsewhere.invalid")
        log = ListLog()
        found = end_leftovers(tmp_path / "c", log)
        assert found["same_host"] is False and "elsewhere.invalid" in log.lines[0]
        assert unrelated.poll() is None and (tmp_path / "c" / LEASE).exists()
    finally:
        for p in (leftover, unrelated):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    print(f"\n[orphans] end_leftovers ended a live 2-process group in {took:.2f}s")


def test_c_cancel_is_recorded_and_leaves_no_process(tmp_path, digits_cache):
    out = tmp_path / "out"
    out.mkdir()
    (out / CANCELLED).write_text("{}")  # an earlier try's marker: this try's supervise clears it
    cfg = config(tmp_path, digits_cache, epochs=200, edit=two_ranks)
    ctx = Ctx()
    result: dict = {}

    def task():
        result["rc"], result["hung"] = supervise(launch_argv(cfg), out, ctx, hang_timeout=600, try_number=2)

    runner = threading.Thread(target=task)
    runner.start()
    try:
        wait_for(lambda: heartbeat_step(out) >= 15 or not runner.is_alive(), 120, "training to reach step 15")
        assert runner.is_alive(), "\n".join(ctx.log.lines[-40:])
        assert not was_cancelled(out)
        lease = read_lease(out)
        pgid, token = lease["pgid"], lease["token"]
        members = group_members(pgid, token)
        t0 = time.monotonic()
        stop_all()  # what the operator's on_kill does
        took = time.monotonic() - t0
        left = group_members(pgid, token)
    finally:
        stop_all()
        runner.join(timeout=30)
    print(f"\n[orphans] cancel: {len(members)} processes gone {took:.2f}s after stop_all()")
    assert not left and took < 5.0  # well under a second alone; a test beside it slows the kernel's teardown
    assert result == {"rc": -signal.SIGKILL, "hung": False}
    assert was_cancelled(out)
    marker = read_cancel(out)
    assert marker["try_number"] == 2 and marker["pgid"] == pgid and "stopped" in marker["reason"]
    assert not (out / "failure.json").exists()  # no rank read it as a failure of any class
    assert not (out / LEASE).exists()
    text = "\n".join(ctx.log.lines)
    assert "[train] world 2" in text and "Traceback" not in text, text[-3000:]


def test_e_group_sigterm_still_gives_a_preemption_checkpoint(tmp_path, digits_cache):
    # The stalled-group and failed-warm-up paths end the group with SIGTERM first: every process of the
    # group gets it. The forkserver and the loader workers must live through it (dying of it, they took
    # the ranks down by parent death, or had them fail with a DataLoader traceback) so the ranks commit.
    from ballast.training import checkpoint as ckpt
    from ballast.training.checkpoint import gate

    out = tmp_path / "out"
    out.mkdir()
    cfg = config(tmp_path, digits_cache, epochs=200, edit=two_ranks)
    ctx = Ctx()
    t0 = None

    def abort():  # as a failed background warm-up: once training is under way
        nonlocal t0
        if heartbeat_step(out) >= 15:
            t0 = t0 or time.monotonic()
            return RuntimeError("damaged shard")
        return None

    rc, hung = supervise(launch_argv(cfg), out, ctx, hang_timeout=600, abort=abort)
    took = time.monotonic() - t0
    print(f"\n[orphans] group SIGTERM: preempted and gone {took:.2f}s after the abort")
    text = "\n".join(ctx.log.lines)
    assert rc != 0 and not hung and took < 30, text[-3000:]
    record = json.loads((out / "failure.json").read_text())
    assert record["class"] == "preempted" and "checkpoint committed" in record["exception"], record
    latest = gate.latest_passing(tmp_path / "ckpt", quarantine_failures=False)
    assert ckpt.read_trainer_state(latest)["reason"] == "preempted"
    around = text[max(0, text.find("Traceback") - 3000):][:5000]
    assert "Traceback" not in text and text.count("failed (preempted") == 2, around
    assert not was_cancelled(out) and not (out / LEASE).exists()


FAKE_AIRFLOW = r"""
import http.server, json, os, signal, subprocess, sys, time

role = sys.argv[1]
if role == "db":  # db migrate
    sys.exit(0)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

def on_term(signum, frame):  # as Airflow's processes do: end their own children, then exit
    child.kill()
    child.wait()
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(os.environ["FAKE_PIDS"], role), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
if role == "api-server":
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"scheduler": {"status": "healthy"}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
while True:
    time.sleep(3600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=["term", "hup", "kill"])
def test_d_ballast_ui_stopped_by_a_signal_leaves_no_airflow_process(tmp_path, sig):
    fake = tmp_path / "fake_airflow.py"
    fake.write_text(FAKE_AIRFLOW)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    script = (f"import sys; from ballast.dev.stack import serve; sys.exit(serve({free_port()},"
              f" airflow=[sys.executable, {str(fake)!r}], log_dir={str(tmp_path / 'logs')!r}))")
    ui = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, FAKE_PIDS=str(pids_dir)),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(list(pids_dir.iterdir())) == 3 or ui.poll() is not None, 30, "three Airflow processes")
        assert ui.poll() is None, ui.communicate()[0]
        pids = [int(x) for p in pids_dir.iterdir() for x in p.read_text().split()]
        lines = []
        while not any(line.startswith("ready:") for line in lines):
            lines.append(ui.stdout.readline())
            assert lines[-1], "".join(lines)
        assert all(alive(p) for p in pids)
        t0 = time.monotonic()
        ui.send_signal(sig)
        rc = ui.wait(timeout=40)
        wait_for(lambda: not any(alive(p) for p in pids), 10, "every Airflow process and child to end", poll=0.02)
        took = time.monotonic() - t0
    finally:
        if ui.poll() is None:
            ui.kill()
        ui.wait()
    print(f"\n[orphans] ballast ui, {sig.name}: exit {rc}, its {len(pids)} processes gone in {took:.2f}s")
    assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig)


def test_f_a_process_whose_parent_died_before_it_asked_ends_at_once(tmp_path):
    # The race a parent-death signal leaves open: the parent dies before the child's prctl. The child
    # then finds another parent than the one it was told of, and ends by the signal itself.
    code = "import signal, sys; from ballast.training.parentdeath import die_with_parent;" \
           " die_with_parent(getattr(signal, sys.argv[1]), int(sys.argv[2])); print('ran on')"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for name, sig in (("SIGKILL", signal.SIGKILL), ("SIGHUP", signal.SIGHUP)):
        proc = subprocess.run([sys.executable, "-c", code, name, str(gone.pid)], capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == -sig and "ran on" not in proc.stdout, proc.stderr
    proc = subprocess.run([sys.executable, "-c", code, "SIGKILL", str(os.getpid())], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0 and "ran on" in proc.stdout, proc.stderr
    # The exec wrapper `ballast ui` starts Airflow's processes with: the same check, then the program.
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ballast.training.parentdeath", "--parent", str(gone.pid), "--", "sleep",
                           "30"], timeout=30)
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - t0 < 10


@pytest.mark.integration
def test_the_local_backend_behind_the_cluster_backends_interface(tmp_path):
    """`local` is one backend among three: start, wait with the log relayed, stop, an Ending that names
    the signal and the host; a stop from another thread (as on_kill) records the cancel and ends it all."""
    import logging
    import socket
    import sys
    import threading

    from ballast.launch.driver import run, stop_all

    backend = LocalBackend(tmp_path, logging.getLogger("test"))
    code = "import os, signal; print('step', os.environ['X']); os.kill(os.getpid(), signal.SIGKILL)"
    handle = backend.start(Launch(name="t", try_number=3, nodes=1, command=(sys.executable, "-c", code),
                                  env={"X": "7"}))
    assert read_lease(tmp_path)["try_number"] == 3
    lines: list[str] = []
    end = backend.wait(handle, on_line=lines.append)
    assert lines == ["step 7"]
    assert (end.exit_code, end.reason, end.host, end.ok, end.cancelled) == (-9, "killed by SIGKILL",
                                                                            socket.gethostname(), False, False)
    assert read_lease(tmp_path) is None

    sleeper = (sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c',"
               " 'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)")
    started, group = threading.Event(), {}
    log = ListLog()
    log.info = lambda msg, *args: started.set()  # the driver relays the try's lines to the task log

    def on_kill():  # from another thread, as Airflow's on_kill
        if started.wait(30):
            group.update(read_lease(tmp_path))
            stop_all("on_kill")

    threading.Thread(target=on_kill, daemon=True).start()
    end = run(backend, Launch(name="t", try_number=4, nodes=1, command=sleeper), tmp_path, log, hang_timeout=600)
    assert end.cancelled and not end.ok and end.reason == "cancelled (by Ballast)"
    assert read_cancel(tmp_path)["try_number"] == 4
    assert group and not group_members(group["pgid"], group["token"])

    handle = backend.start(Launch(name="t", try_number=5, nodes=1, command=sleeper))
    end = backend.wait(handle, on_line=lambda line: None, should_stop=lambda: "the warm-up failed")
    assert end.exit_code == -15 and not end.cancelled and not group_members(handle.pgid, handle.token)

    with pytest.raises(ValueError, match="one node"):
        backend.start(Launch(name="t", try_number=6, nodes=2, command=sleeper))
