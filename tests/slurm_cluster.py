"""A real Slurm cluster on this machine for the tests: munged, slurmctld and three node daemons
(`slurmd -N n1..n3`, Debian's slurm-wlm 22.05, whose slurmd runs several named daemons on one host),
every file of theirs under one temporary directory, on free ports. `make slurm` installs the packages.

Nodes n1-n3 claim the machine's cores each (Slurm schedules, it does not pin: proctrack/linuxproc,
task/none); partitions `spot` (preemptible: a job of `ondemand`, the higher tier, preempts its jobs
with SIGTERM, 30 s of grace, then SIGKILL) and `ondemand`. `stop()` cancels every job, ends the
daemons and SIGKILLs any job process left with this cluster's SLURM_CONF: nothing outlives a test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

NODES = ("n1", "n2", "n3")


def available() -> str | None:
    """Why no cluster can start here (None: it can)."""
    missing = [c for c in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey") if shutil.which(c) is None]
    return f"Slurm is not installed ({', '.join(missing)} missing): run `make slurm`" if missing else None


@contextlib.contextmanager
def running_cluster(memory_mb: int = 12000) -> Iterator[SlurmCluster]:
    """A started cluster with SLURM_CONF naming it (what a Slurm user's environment names), for a test
    module's fixture (after `available()`); stopped at the end, SLURM_CONF restored, and no job process
    left behind."""
    # munged wants every directory above its socket world-searchable: not pytest's 0700 tmp_path.
    base = Path(tempfile.mkdtemp(prefix="ballast-slurm-"))
    base.chmod(0o755)
    c = SlurmCluster(base, memory_mb=memory_mb).start()
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(c.conf)
    try:
        yield c
    finally:
        c.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        shutil.rmtree(base, ignore_errors=True)
    assert c.leftovers() == [], "job processes outlived the cluster"


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class SlurmCluster:
    def __init__(self, base: Path, *, memory_mb: int = 6000):
        self.base = Path(base)
        self.conf = self.base / "etc" / "slurm.conf"
        self.memory_mb = memory_mb
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        b = self.base
        for d in ("etc", "log", "run", "spool/ctld", "munge", *(f"spool/{n}" for n in NODES)):
            (b / d).mkdir(parents=True, exist_ok=True)
        os.chmod(b, 0o755)
        os.chmod(b / "munge", 0o755)
        ctld, slurmd, *node_ports = _free_ports(2 + len(NODES))
        cores = max(2, os.cpu_count() or 2)
        # Job IDs from a range of this test process's own: a job's rendezvous port is derived from its ID
        # (launch/slurm/script.py), and under pytest-xdist two workers' clusters can run side by side.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        first_job = 1 + 1000 * (int(worker) % 10 if worker.isdigit() else 0)
        lines = [
            "ClusterName=ballasttest", "SlurmctldHost=localhost", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={b / 'munge/munge.sock'}", "CredType=cred/munge",
            f"SlurmctldPort={ctld}", f"SlurmdPort={slurmd}", "CommunicationParameters=NoInAddrAny",
            f"StateSaveLocation={b / 'spool/ctld'}", f"SlurmdSpoolDir={b / 'spool/%n'}",
            f"SlurmctldPidFile={b / 'run/slurmctld.pid'}", f"SlurmdPidFile={b / 'run/slurmd-%n.pid'}",
            f"SlurmctldLogFile={b / 'log/slurmctld.log'}", f"SlurmdLogFile={b / 'log/slurmd-%n.log'}",
            "MailProg=/bin/true", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory", "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,batch_sched_delay=0", "ReturnToService=2",
            # A job of the ondemand partition (higher tier) preempts spot jobs: SIGTERM, GraceTime, SIGKILL.
            "PreemptType=preempt/partition_prio", "PreemptMode=CANCEL", "MpiDefault=none", "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/linux", "JobAcctGatherFrequency=task=1",
            "JobAcctGatherParams=OverMemoryKill", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MinJobAge=600", "KillWait=5", "UnkillableStepTimeout=30",
            "SlurmdTimeout=10", "SlurmctldTimeout=10", "InactiveLimit=0", "Waittime=0", f"FirstJobId={first_job}",
        ]
        for name, port in zip(NODES, node_ports):
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} Sockets=1"
                         f" CoresPerSocket={cores} ThreadsPerCore=1 RealMemory={self.memory_mb} State=UNKNOWN")
        nodes = ",".join(NODES)
        lines += [f"PartitionName=spot Nodes={nodes} Default=YES MaxTime=INFINITE PriorityTier=1 GraceTime=30 State=UP",
                  f"PartitionName=ondemand Nodes={nodes} MaxTime=INFINITE PriorityTier=2 PreemptMode=OFF State=UP"]
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        self._write_conf()
        b = self.base
        key = b / "munge/munge.key"
        if not key.exists():
            subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
        subprocess.run(["munged", "-S", str(b / "munge/munge.sock"), f"--key-file={key}",
                        f"--log-file={b / 'munge/munged.log'}", f"--pid-file={b / 'munge/munged.pid'}",
                        f"--seed-file={b / 'munge/munged.seed'}"], check=True, capture_output=True, env=self.env)
        subprocess.run(["slurmctld", "-i"], check=True, capture_output=True, env=self.env)
        for name in NODES:
            subprocess.run(["slurmd", "-N", name], check=True, capture_output=True, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-p", "spot", "-o", "%T"], capture_output=True, text=True,
                                 env=self.env)
            if out.stdout.split().count("idle") == len(NODES):
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"Slurm nodes did not come up within {timeout:.0f}s; see {b / 'log'}")

    def jobs(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, env=self.env)
        return [line for line in out.stdout.splitlines() if line.strip()]

    def stop(self) -> None:
        subprocess.run(["scancel", "--quiet", "--user=root"], capture_output=True, env=self.env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.jobs():
            time.sleep(0.3)
        b = self.base
        for pidfile in [*(b / f"run/slurmd-{n}.pid" for n in NODES), b / "run/slurmctld.pid", b / "munge/munged.pid"]:
            _kill_pidfile(pidfile)
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftovers(self) -> list[int]:
        """Processes of this cluster's jobs still alive (their environment names its SLURM_CONF)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if mine in env and (comm.startswith("slurmstepd") or any(e.startswith(b"SLURM_JOB_ID=") for e in env)):
                found.append(int(entry.name))
        return found


def _kill_pidfile(path: Path) -> None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return
    path.unlink(missing_ok=True)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
