"""What a stage gets when it runs: the effective spec, the run's identity and its storage layout."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

from pydantic import ValidationError

from ballast.errors import BallastError
from ballast.records import (RECORDS, ROUND_RECORDS, ConvertResult, EvaluateResult, PublishResult, Record, RoundResult, RunReport, TrainResult,
                             ValidateResult, VerifyResult, WarmCacheResult, current_version)
from ballast.spec import Spec
from ballast.storage import Storage, ballast_home, open_storage

R = TypeVar("R", bound=Record)


_KEY_SAFE = re.compile(r"[A-Za-z0-9._-]+")


def safe_run_id(run_id: str) -> str:
    """A run's directory name and storage key part, one-to-one with the run id.

    An id of path- and key-safe characters is its own key (`manual_1`); any other
    (`manual__2026-12-02T12:00:00+00:00`) is a readable form, every other character as '_', then '~' and
    12 hex digits of the exact id's sha256. '~' occurs in no key-safe id, and ids that read alike
    (':' or '_') hash apart: two runs never share a directory, checkpoints, records or lease."""
    if _KEY_SAFE.fullmatch(run_id) and run_id.strip("."):
        return run_id
    return f"{legacy_run_id(run_id)[:200]}~{hashlib.sha256(run_id.encode()).hexdigest()[:12]}"


def legacy_run_id(run_id: str) -> str:
    """The key earlier Ballast versions used (not one-to-one): only for reading what they wrote."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)


def run_key(dag_id: str, run_id: str) -> str:
    """Storage prefix of everything one run writes."""
    return f"runs/{dag_id}/{safe_run_id(run_id)}"


def run_key_for_reading(storage: Storage, dag_id: str, run_id: str) -> str:
    """`run_key`, or for a run an earlier Ballast wrote under its old key, that key: when the run has no
    records under its own key and the old directory's spec.json does not name another run."""
    key, old = run_key(dag_id, run_id), f"runs/{dag_id}/{legacy_run_id(run_id)}"
    if old == key or storage.exists(f"{key}/spec.json") or not storage.exists(f"{old}/spec.json"):
        return key
    try:
        owner = json.loads(storage.read_bytes(f"{old}/spec.json")).get("run_id")
    except (ValueError, AttributeError):
        return key
    return old if owner in (None, run_id) else key


@dataclass
class RunContext:
    spec: Spec
    dag_id: str
    run_id: str
    try_number: int = 1
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("ballast"))
    task_id: str = ""
    """The Airflow task running the stage (its attempt history's name)."""
    spec_file: str = ""
    """The spec file the DAG was built from (for messages)."""
    state: Any = None
    """Airflow's task_state_store of the task (survives its retries); None outside Airflow."""
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
        return run_key(self.dag_id, self.run_id)

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

    @property
    def round(self) -> int | None:
        """The training round this task belongs to (task `round_2.train`: 2), None outside rounds."""
        m = re.fullmatch(r"round_(\d+)\..+", self.task_id or "")
        return int(m.group(1)) if m else None

    def result_key(self, stage: str, round_: int | None = None) -> str:
        name = f"round_{round_}.{stage}" if round_ is not None else stage
        return f"{self.run_key}/stages/{name}.json"

    def _round_of(self, stage: str) -> int | None:
        """Which round's record of `stage` to read: this task's round, or (after the rounds) the last
        round that recorded one; None for a stage that is not per round."""
        if stage not in ROUND_RECORDS or self.spec.training.rounds <= 1:
            return None
        if self.round is not None:
            return self.round
        for k in range(self.spec.training.rounds, 0, -1):
            if self.storage.exists(self.result_key(stage, k)):
                return k
        return 1

    def save_result(self, stage: str, record: Record) -> None:
        """Save a stage's record as readable JSON (with its version) at `result_key(stage)` (per round
        inside the rounds of training)."""
        expected = RECORDS.get(stage)
        if expected is not None and not isinstance(record, expected):
            raise TypeError(f"stage {stage!r} records a {expected.__name__}, not {type(record).__name__}")
        round_ = self.round if stage in ROUND_RECORDS else None
        self.storage.write_bytes(self.result_key(stage, round_), record.model_dump_json(indent=2).encode())

    @overload
    def result(self, stage: Literal["validate"]) -> ValidateResult: ...
    @overload
    def result(self, stage: Literal["convert"]) -> ConvertResult: ...
    @overload
    def result(self, stage: Literal["warm_cache"]) -> WarmCacheResult: ...
    @overload
    def result(self, stage: Literal["train"]) -> TrainResult: ...
    @overload
    def result(self, stage: Literal["verify_checkpoint"]) -> VerifyResult: ...
    @overload
    def result(self, stage: Literal["evaluate"]) -> EvaluateResult: ...
    @overload
    def result(self, stage: Literal["publish"]) -> PublishResult: ...
    @overload
    def result(self, stage: Literal["evaluate_round"]) -> RoundResult: ...
    @overload
    def result(self, stage: str) -> Record: ...

    def result(self, stage: str) -> Record:
        """The typed record `stage` saved for this run; a missing, unreadable or other-version one is a
        BallastError naming its storage key and what to do."""
        model = RECORDS.get(stage)
        if model is None:
            raise BallastError(f"stage {stage!r} keeps no record; stages that do: {', '.join(RECORDS)}")
        key = self.result_key(stage, self._round_of(stage))
        if not self.storage.exists(key):
            raise BallastError(f"{self.storage.describe(key)}: stage {stage!r} has no result for run {self.run_id};"
                               f" run the pipeline from the start (or clear that task) first")
        return self._read(key, model, f"clear task {stage!r} of run {self.run_id} so that it records its result again")

    @property
    def report_key(self) -> str:
        """Storage key of the run's report, written by publish."""
        return f"{self.run_key}/report.json"

    def report(self) -> RunReport:
        """The run's report (publish writes it last), validated like a stage record."""
        key = self.report_key
        if not self.storage.exists(key):
            raise BallastError(f"{self.storage.describe(key)}: run {self.run_id} has no report; it is written when"
                               f" task 'publish' succeeds")
        return self._read(key, RunReport, f"clear task 'publish' of run {self.run_id} so that it writes it again")

    def _read(self, key: str, model: type[R], rerun: str) -> R:
        where = self.storage.describe(key)
        try:
            data = json.loads(self.storage.read_bytes(key))
        except ValueError as exc:
            raise BallastError(f"{where}: not a readable {model.__name__} record ({exc}); {rerun}") from exc
        want = current_version(model)
        got = data.get("version") if isinstance(data, dict) else None
        if got != want:
            raise BallastError(f"{where}: {model.__name__} version {got!r}, this Ballast reads version {want}"
                               f" (written by another Ballast version); {rerun}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            field_path = ".".join(str(p) for p in first["loc"]) or "(record)"
            raise BallastError(f"{where}: {model.__name__}.{field_path}: {first['msg']}; {rerun}") from exc
