"""Which DAGs are Ballast pipelines, and where each keeps its records: the specs the DAG files read.

The view never asks Airflow's metadata database where a run's records are: the spec names its storage.
Specs are read from `$BALLAST_SPECS_DIR`, else `<[core] dags_folder>/specs` (what `dags/` renders),
and read again when a file there changes.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ballast.storage import Storage, open_storage


log = logging.getLogger("ballast.ui")


@dataclass(frozen=True)
class Pipeline:
    dag_id: str
    name: str
    spec_file: str
    storage_uri: str
    conn_id: str | None


def specs_dir() -> Path:
    explicit = os.environ.get("BALLAST_SPECS_DIR")
    if explicit:
        return Path(explicit)
    from airflow.configuration import conf

    return Path(conf.get("core", "dags_folder")) / "specs"


class Catalog:
    """dag_id -> Pipeline, from the spec files, cached until one of them changes."""

    def __init__(self, directory: Path | None = None):
        self._dir, self._lock = directory, threading.Lock()
        self._stamp: tuple | None = None
        self._pipelines: dict[str, Pipeline] = {}
        self._storages: dict[str, Storage] = {}

    @property
    def directory(self) -> Path:
        return self._dir or specs_dir()

    def pipelines(self) -> dict[str, Pipeline]:
        from ballast.airflow.dags import spec_files

        files = spec_files(self.directory) if self.directory.is_dir() else []
        stamp = tuple((str(p), p.stat().st_mtime_ns) for p in files)
        with self._lock:
            if stamp != self._stamp:
                self._pipelines, self._storages = _read(files), {}
                self._stamp = stamp
            return self._pipelines

    def storage(self, dag_id: str) -> Storage | None:
        pipeline = self.pipelines().get(dag_id)
        if pipeline is None:
            return None
        with self._lock:
            if dag_id not in self._storages:
                self._storages[dag_id] = open_storage(pipeline.storage_uri, pipeline.conn_id)
            return self._storages[dag_id]


def _read(files: list[Path]) -> dict[str, Pipeline]:
    from ballast.errors import SpecError
    from ballast.spec import load_spec

    out: dict[str, Pipeline] = {}
    for path in files:
        try:
            spec = load_spec(path)
        except SpecError:
            continue  # the broken-specs DAG reports it; the view has no records of it
        except Exception:  # noqa: BLE001  (as the DAG processor does: that spec alone, never the catalogue)
            log.exception("%s: cannot be read as a Ballast spec; left out of the pipelines list", path)
            continue
        out.setdefault(spec.dag_id, Pipeline(spec.dag_id, spec.name, str(path), spec.storage.uri,
                                             spec.storage.conn_id))
    return out
