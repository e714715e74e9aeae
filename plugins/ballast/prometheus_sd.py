"""Prometheus file-based service discovery for a try's rank endpoints.

While a local try trains with `execution.metrics_port` set, `<dir>/<dag>__<run>.json` lists its ranks'
endpoints (`file_sd_configs` format) with the pipeline, run and try as target labels; the file goes
when the try ends. `<dir>` is `$BALLAST_PROMETHEUS_SD_DIR`, else `$BALLAST_HOME/prometheus/targets`: point
a `file_sd_configs` entry at `<dir>/*.json` (docker/prometheus/prometheus.yml does).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from ballast.context import safe_run_id
from ballast.storage import atomic_write_bytes, ballast_home


def sd_dir() -> Path:
    explicit = os.environ.get("BALLAST_PROMETHEUS_SD_DIR")
    return Path(explicit) if explicit else ballast_home() / "prometheus" / "targets"


def publish(*, pipeline: str, dag_id: str, run_id: str, try_number: int, port: int, ranks: int) -> Path:
    addr = os.environ.get("BALLAST_METRICS_ADDR", "127.0.0.1")
    host = "127.0.0.1" if addr in ("127.0.0.1", "localhost") else socket.getfqdn()
    path = sd_dir() / f"{dag_id}__{safe_run_id(run_id)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    groups = [{"targets": [f"{host}:{port + r}" for r in range(ranks)],
               "labels": {"job": "ballast", "pipeline": pipeline, "dag_id": dag_id, "run": run_id,
                          "try": str(try_number)}}]
    atomic_write_bytes(path, json.dumps(groups, indent=1).encode())
    return path


def withdraw(path: Path | None) -> None:
    if path is not None:
        Path(path).unlink(missing_ok=True)
