"""What every pipeline stage records, and the run's report: one declared, versioned contract.

A stage returns one of these records; the runner saves it as readable JSON at
`runs/<dag>/<run>/stages/<stage>.json` (`RunContext.save_result`) and hands its JSON form to Airflow
(XCom); a later stage reads it back typed (`RunContext.result`) and uses its fields. The report that
publish writes (`runs/<dag>/<run>/report.json`) is a `RunReport`. Whoever else reads these files (the
stability view, the attempt history) reads the same models.

Every stage record and the report carry a `version` (its default is the version this code writes and
reads). A change a reader of an older file would misread (a field renamed, removed or given another
meaning) raises that record's version; adding an optional field does not.

Importable without torch, pyarrow or Airflow: pydantic only (the DAG-parse budget).
"""

from __future__ import annotations

from ballast.records.attempts import Attempt, AttemptHistory, RecoverySummary
from ballast.records.base import Record, current_version
from ballast.records.progress import StageProgress
from ballast.records.results import (
    AppliedParameter,
    BestValidation,
    CheckedCheckpoint,
    ConvertResult,
    EffectiveSpec,
    EvaluateResult,
    HeldOutScores,
    PublishResult,
    Quarantine,
    RECORDS,
    ROUND_RECORDS,
    RoundResult,
    RunReport,
    StageRecords,
    TrainingOutcome,
    TrainResult,
    ValidateResult,
    VerifyResult,
    WarmCacheResult,
    WarmUpPhase,
)

__all__ = [
    "AppliedParameter",
    "Attempt",
    "AttemptHistory",
    "BestValidation",
    "CheckedCheckpoint",
    "ConvertResult",
    "EffectiveSpec",
    "EvaluateResult",
    "HeldOutScores",
    "PublishResult",
    "Quarantine",
    "RECORDS",
    "ROUND_RECORDS",
    "Record",
    "RecoverySummary",
    "RoundResult",
    "RunReport",
    "StageProgress",
    "StageRecords",
    "TrainResult",
    "TrainingOutcome",
    "ValidateResult",
    "VerifyResult",
    "WarmCacheResult",
    "WarmUpPhase",
    "current_version",
]
