"""Throwaway production services for the tests, on loopback and free ports: a PostgreSQL 15 cluster
(`initdb`/`pg_ctl` on the PATH or where Debian's postgresql package puts them, /usr/lib/postgresql/<v>/bin,
which `make postgres` installs when neither has them; run as the `postgres` user since PostgreSQL refuses root)
and a Redis server (Debian's redis-server: `make redis`). Every file of theirs lives under one
temporary directory that is removed on stop; stop ends the servers (nothing outlives a test).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from helpers import free_port


def _wait_port(port: int, proc: subprocess.Popen | None, what: str, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f}s; see {log}")


def pg_tool(name: str) -> str | None:
    """PostgreSQL's server program `name`: on the PATH, else the newest Debian install's."""
    found = shutil.which(name)
    if found:
        return found
    debian = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]) if
                    p.parts[-3].isdigit() else 0)
    return str(debian[-1]) if debian else None


def missing() -> str | None:
    """Why these services cannot start here (None: they can)."""
    gone = [c for c in ("initdb", "pg_ctl", "createdb") if pg_tool(c) is None]
    gone += [c for c in ("redis-server",) if shutil.which(c) is None]
    if gone:
        return f"{', '.join(gone)} not found: `make postgres redis` installs them (Debian's postgresql, redis-server)"
    return None


class _Service:
    """Started on enter (stopped again if starting fails half way), stopped on exit."""

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class Postgres(_Service):
    """One PostgreSQL cluster with a database `airflow` owned by a role `airflow` (trust auth on loopback:
    a test server, never a deployment's)."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="ballast-pg-"))
        self.data = self.base / "data"
        self.log = self.base / "postgres.log"
        self.port = free_port()
        try:
            self.user = pwd.getpwnam("postgres")
        except KeyError:
            self.user = pwd.getpwnam("nobody")
        self.url = f"postgresql+psycopg2://airflow@127.0.0.1:{self.port}/airflow"

    def _as_owner(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, user=self.user.pw_uid, group=self.user.pw_gid, capture_output=True, text=True,
                              cwd=self.base, check=True, **kw)

    def start(self) -> Postgres:
        os.chmod(self.base, 0o755)
        os.chown(self.base, self.user.pw_uid, self.user.pw_gid)
        self._as_owner([pg_tool("initdb"), "-D", str(self.data), "-U", "airflow", "--auth=trust", "-E", "UTF8", "--no-sync"])
        self._as_owner([pg_tool("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start", "-o",
                        f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off"
                        " -c max_connections=200"])
        _wait_port(self.port, None, "PostgreSQL", self.log)
        self._as_owner([pg_tool("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "airflow", "airflow"])
        return self

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self._as_owner([pg_tool("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])
            except subprocess.CalledProcessError:
                pid = int((self.data / "postmaster.pid").read_text().split()[0])
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)


class Redis(_Service):
    """A Redis server with no persistence, as the Celery broker."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="ballast-redis-"))
        self.log = self.base / "redis.log"
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Redis:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.base)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_port(self.port, self.proc, "redis-server", self.log)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.base, ignore_errors=True)
