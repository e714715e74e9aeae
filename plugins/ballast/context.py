"""What a stage gets when it runs: the effective spec, the run's identity and its storage layout."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ballast.errors import BallastError
from ballast.spec import Spec
from ballast.storage import Storage, ballast_home, open_storage


def safe_run_id(run_id: str) -> str:
    """Run ids hold ':' and '+' (manual__2026-12-02T12:00:00+00:00); keep them path- and key-safe."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)


@dataclass
class RunContext:
    spec: Spec
    dag_id: str
    run_id: str
    try_number: int = 1
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("ballast"))
    _storage: Storage | None = None

    @property
    def storage(self) -> Storage:
        if self._storage is None:
            st = self.spec.storage
            self._storage = open_storage(st.uri, st.conn_id, retry_mode=st.retry_mode, max_attempts=st.max_attempts,
                                         multipart_chunk_mb=st.multipart_chunk_mb,
                                         transfer_concurrency=st.transfer_concurrency)
        return self._storage

    @property
    def run_key(self) -> str:
        """Storage prefix of everything this run writes."""
        return f"runs/{self.dag_id}/{safe_run_id(self.run_id)}"

    @property
    def work_dir(self) -> Path:
        """Local directory for this run's training outputs. With local storage it is the run's storage
        directory itself (nothing to copy); with S3 it is node-local and synced by the stages."""
        local = self.storage.local_path(self.run_key)
        path = local if local is not None else ballast_home() / "work" / self.dag_id / safe_run_id(self.run_id)
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def cache_root(self) -> Path:
        base = self.spec.cache.directory
        return (Path(base).expanduser() if base else ballast_home() / "cache").resolve()

    def result_key(self, stage: str) -> str:
        return f"{self.run_key}/stages/{stage}.json"

    def save_result(self, stage: str, result: dict[str, Any]) -> None:
        self.storage.write_bytes(self.result_key(stage), json.dumps(result, indent=2, default=str).encode())

    def result(self, stage: str) -> dict[str, Any]:
        key = self.result_key(stage)
        if not self.storage.exists(key):
            raise BallastError(f"{self.storage.describe(key)}: stage {stage!r} has no result for run {self.run_id};"
                               f" run the pipeline from the start (or clear that task) first")
        return json.loads(self.storage.read_bytes(key))
