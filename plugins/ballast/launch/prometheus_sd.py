"""Prometheus file-based service discovery for a try's rank endpoints.

While a local try trains with `execution.metrics_port` set, `<dir>/<dag>__<run>.json` lists its ranks'
endpoints (`file_sd_configs` format) with the pipeline, run and try as target labels; the file goes
when the try ends. `<dir>` is `$BALLAST_PROMETHEUS_SD_DIR`, else `$BALLAST_HOME/prometheus/targets`: point
a `file_sd_configs` entry at `<dir>/*.json` (docker/prometheus/prometheus.yml does).

A rank whose port is taken (another pipeline's rank on the same worker) serves on a free one and writes
it to its output directory (`training.monitor.PORT_FILE`); given that directory, the file follows.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

from ballast.pipeline.context import safe_run_id
from ballast.storage import atomic_write_bytes, ballast_home
from ballast.training.monitor import PORT_FILE

FOLLOW_SECONDS = 1.0

_followers: dict[Path, tuple[threading.Event, threading.Lock]] = {}


def sd_dir() -> Path:
    explicit = os.environ.get("BALLAST_PROMETHEUS_SD_DIR")
    return Path(explicit) if explicit else ballast_home() / "prometheus" / "targets"


def publish(*, pipeline: str, dag_id: str, run_id: str, try_number: int, port: int, ranks: int,
            out_dir: Path | None = None) -> Path:
    """List the ranks at `port + rank`; with the try's `out_dir` (before its ranks start), at the ports
    they report there, followed until `withdraw`."""
    addr = os.environ.get("BALLAST_METRICS_ADDR", "127.0.0.1")
    host = "127.0.0.1" if addr in ("127.0.0.1", "localhost") else socket.getfqdn()
    path = sd_dir() / f"{dag_id}__{safe_run_id(run_id)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = {"job": "ballast", "pipeline": pipeline, "dag_id": dag_id, "run": run_id, "try": str(try_number)}

    def write(ports: list[int]) -> None:
        groups = [{"targets": [f"{host}:{p}" for p in ports], "labels": labels}]
        atomic_write_bytes(path, json.dumps(groups, indent=1).encode())

    planned = [port + r for r in range(ranks)]
    write(planned)
    if out_dir is not None:
        for r in range(ranks):  # an earlier try's ports: not this try's
            (Path(out_dir) / PORT_FILE.format(rank=r)).unlink(missing_ok=True)
        follower = _followers[path] = (threading.Event(), threading.Lock())
        threading.Thread(target=_follow, args=(Path(out_dir), planned, write, *follower), daemon=True,
                         name="ballast-prometheus-sd").start()
    return path


def _follow(out_dir: Path, planned: list[int], write, stop: threading.Event, lock: threading.Lock) -> None:
    """Rewrite the targets whenever the ports the ranks report differ from those listed."""
    listed = planned
    while not stop.wait(FOLLOW_SECONDS):
        ports = [_reported(out_dir, r) or p for r, p in enumerate(planned)]
        if ports == listed:
            continue
        with lock:  # never after withdraw: the file would outlive the try
            if stop.is_set():
                return
            try:
                write(ports)
            except OSError:
                continue  # the next round tries again; training does not depend on being watched
        listed = ports


def _reported(out_dir: Path, rank: int) -> int | None:
    try:
        return int((out_dir / PORT_FILE.format(rank=rank)).read_text().strip())
    except (OSError, ValueError):
        return None


def withdraw(path: Path | None) -> None:
    if path is not None:
        follower = _followers.pop(Path(path), None)
        if follower is not None:
            stop, lock = follower
            with lock:
                stop.set()
        Path(path).unlink(missing_ok=True)
