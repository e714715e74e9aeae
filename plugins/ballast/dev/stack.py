"""The full local Airflow stack on the embedded default: API server (with the UI), scheduler and DAG
processor as three processes on SQLite with the LocalExecutor. Used by `ballast ui` and by the tests
that trigger runs through the real REST API. The same class runs the production path's shape for the
tests: `extra_env` points the metadata database at PostgreSQL and the executor at Celery, and
`celery_workers` starts that many `airflow celery worker` processes beside the three.

Each Airflow process leads its own process group (so a terminal's Ctrl-C reaches `ballast ui` alone,
which then stops them in order); `stop` signals each whole group, so their own children (API server
workers, the LocalExecutor's task processes) go too. `serve` (`ballast ui`) stops the stack on SIGTERM,
SIGHUP and SIGINT alike (a second signal SIGKILLs what is left) and exits 128 + the signal's number (0
for Ctrl-C). For a SIGKILL, which nothing can catch, `bind_to_parent` starts each Airflow process
through `python -m ballast.training.parentdeath`, which sets its parent-death signal (SIGTERM) and execs
Airflow: Airflow's own SIGTERM handling then ends its children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ballast.dev.dag_run import configure_env


class LocalStack:
    def __init__(self, port: int = 8080, *, log_dir: Path | None = None, extra_env: dict[str, str] | None = None,
                 airflow: list[str] | None = None, bind_to_parent: bool = False,
                 users: dict[str, tuple[str, str]] | None = None, celery_workers: int = 0,
                 migrate: bool = True):
        """`airflow`: the command that runs Airflow (default this interpreter's `-m airflow`; a test may
        put a stand-in there). `bind_to_parent`: Airflow's processes get SIGTERM when this process dies;
        only for a caller that starts and waits on one thread (the parent-death signal follows the
        thread that started the process: see training.parentdeath). `users`: name -> (role, password)
        for the simple auth manager, instead of everyone an admin with no login (the first is the
        one `request` logs in as). `celery_workers`: Celery workers to start (with an executor and broker
        set in `extra_env`), each with one slot and its own hostname. `migrate`: run `airflow db
        migrate` first (False where the caller has just migrated the same database)."""
        configure_env()
        self.airflow = list(airflow) if airflow else [sys.executable, "-m", "airflow"]
        self.bind_to_parent = bind_to_parent
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_dir = Path(log_dir or Path(os.environ["AIRFLOW_HOME"]) / "stack-logs")
        self.env = dict(os.environ)
        self.env.update({
            # Local development only: every user is an admin and no login is asked for.
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base}/execution/",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            "AIRFLOW__CORE__PARALLELISM": "4",
        })
        self.users = dict(users or {})
        if self.users:
            passwords = self.log_dir / "simple_auth_manager_passwords.json"
            passwords.parent.mkdir(parents=True, exist_ok=True)
            passwords.write_text(json.dumps({name: pw for name, (_, pw) in self.users.items()}))
            passwords.chmod(0o600)
            self.env.update({
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{n}:{r}" for n, (r, _) in self.users.items()),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            })
        self.env.update(extra_env or {})
        self.celery_workers = celery_workers
        self.migrate = migrate
        self.procs: list[subprocess.Popen] = []
        self.names: dict[int, str] = {}
        self._token: str | None = None

    def start(self, timeout: float = 180.0) -> LocalStack:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()  # a signal or an error half way: nothing started may stay behind
            raise

    def _start(self, timeout: float) -> LocalStack:
        # In the stack's own environment: its database may not be this process's (PostgreSQL, say).
        if self.migrate:
            migrated = subprocess.run(self.airflow + ["db", "migrate"], env=self.env, capture_output=True, text=True)
            if migrated.returncode != 0:
                raise RuntimeError(f"airflow db migrate failed (exit {migrated.returncode}):"
                                   f" {(migrated.stdout + migrated.stderr)[-2000:]}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.commands = {"api-server": ["api-server", "--port", str(self.port), "--host", "127.0.0.1"],
                         "scheduler": ["scheduler"], "dag-processor": ["dag-processor"]}
        for i in range(1, self.celery_workers + 1):
            self.commands[f"celery-worker-{i}"] = ["celery", "worker", "--concurrency", "1",
                                                   "--celery-hostname", f"worker{i}@%h", "--without-mingle",
                                                   "--without-gossip"]
        for name in self.commands:
            self._spawn(name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"an Airflow process exited ({self.names.get(p.pid)}, code {p.returncode});"
                                       f" see {self.log_dir}")
            try:
                health = self.request("GET", "/api/v2/monitor/health")
                if health.get("scheduler", {}).get("status") == "healthy":
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"Airflow did not become healthy on {self.base} within {timeout:.0f}s; see {self.log_dir}")

    def _spawn(self, name: str) -> subprocess.Popen:
        wrap = ([sys.executable, "-m", "ballast.training.parentdeath", "--parent", str(os.getpid()), "--signal", "TERM", "--"]
                if self.bind_to_parent else [])
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(wrap + self.airflow + self.commands[name], env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        self.names[proc.pid] = name
        return proc

    def process(self, name: str) -> subprocess.Popen:
        return next(p for p in self.procs if self.names.get(p.pid) == name and p.poll() is None)

    def restart(self, name: str, sig: int = signal.SIGKILL) -> subprocess.Popen:
        """Signal one process's group (SIGKILL: a crash) and start it again, as a process manager would."""
        old = self.process(name)
        self._signal(old, sig)
        old.wait(timeout=30)
        self.procs.remove(old)
        return self._spawn(name)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to each process's whole group; SIGKILL to a group whose leader outlasts `timeout`, and
        to what is left of every group once its leader has gone."""
        for p in self.procs:
            if p.poll() is None:
                self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.wait()
        from ballast.launch.process import group_members

        for p in self.procs:  # its children: gone with it, or ended now (a group with members keeps its id)
            if group_members(p.pid):
                self._signal(p, signal.SIGKILL)
        self.procs.clear()

    def kill(self) -> None:
        """SIGKILL every group at once (a second stop signal while stopping)."""
        for p in self.procs:
            self._signal(p, signal.SIGKILL)

    @staticmethod
    def _signal(p: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- REST -------------------------------------------------------------------------------------

    def token(self) -> str:
        if self._token is None:
            if self.users:
                self._token = self.login(next(iter(self.users)))
            else:
                req = urllib.request.Request(f"{self.base}/auth/token", method="GET")
                with urllib.request.urlopen(req, timeout=10) as resp:
                    self._token = json.loads(resp.read())["access_token"]
        return self._token

    def login(self, user: str) -> str:
        """A token for one of `users`, as the UI's login form gets it (POST /auth/token)."""
        body = json.dumps({"username": user, "password": self.users[user][1]}).encode()
        req = urllib.request.Request(f"{self.base}/auth/token", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())["access_token"]

    def request(self, method: str, path: str, body: Any = None, *, auth: bool = True) -> Any:
        """JSON request to the API server; raises urllib.error.HTTPError for 4xx/5xx."""
        headers = {"Content-Type": "application/json"}
        if auth and path.startswith("/api/v2/") and not path.startswith("/api/v2/monitor"):
            headers["Authorization"] = f"Bearer {self.token()}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def wait_for_dag(self, dag_id: str, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.request("GET", f"/api/v2/dags/{dag_id}")
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise
            time.sleep(0.5)
        raise TimeoutError(f"DAG {dag_id} did not appear within {timeout:.0f}s; see {self.log_dir}")

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> dict:
        self.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
        return self.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 600.0) -> dict:
        from urllib.parse import quote

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")
            if run["state"] in ("success", "failed"):
                return run
            time.sleep(0.5)
        raise TimeoutError(f"run {run_id} of {dag_id} did not finish within {timeout:.0f}s")

    def task_instances(self, dag_id: str, run_id: str) -> dict[str, dict]:
        """task_id -> the task instance as the REST API returns it (state, try_number, ...)."""
        from urllib.parse import quote

        out = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances")
        return {ti["task_id"]: ti for ti in out["task_instances"]}

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """A task try's log as text (the API's structured entries, one a line)."""
        from urllib.parse import quote

        out = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}"
                                  f"/logs/{try_number}?full_content=true")
        content = out.get("content", "")
        if isinstance(content, str):
            return content
        return "\n".join(e.get("event", "") if isinstance(e, dict) else str(e) for e in content)


class _Stop(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def serve(port: int, **stack_options: Any) -> int:
    """`ballast ui`: the stack until a signal (SIGINT, SIGTERM, SIGHUP) or one of its processes exits.
    Returns 0 after Ctrl-C, 128 + the signal's number after SIGTERM or SIGHUP, 1 if a process exited."""
    stack = LocalStack(port, bind_to_parent=True, **stack_options)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if stopping:  # asked again while stopping: no more waiting
            stack.kill()
            return
        stopping = True
        raise _Stop(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    print(f"starting Airflow on {stack.base} (AIRFLOW_HOME={os.environ['AIRFLOW_HOME']}, logs in {stack.log_dir})",
          flush=True)
    code = 0
    try:
        stack.start()
        print(f"ready: open {stack.base} ; Ctrl-C stops the API server, scheduler and DAG processor", flush=True)
        while all(p.poll() is None for p in stack.procs):
            time.sleep(2)
        exited = next(p for p in stack.procs if p.poll() is not None)
        print(f"{stack.names.get(exited.pid)} exited (code {exited.returncode}); stopping the rest;"
              f" see {stack.log_dir}", file=sys.stderr)
        code = 1
    except _Stop as stop:
        code = 0 if stop.signum == signal.SIGINT else 128 + stop.signum
    finally:
        stopping = True
        print("stopping the API server, scheduler and DAG processor", flush=True)
        stack.stop()
    return code
