"""The stage records and the run's report (see the package docstring for the contract)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from ballast.records.attempts import AttemptHistory, RecoverySummary
from ballast.records.base import Record
from ballast.records.evaluation import EvaluateResult, HeldOutScores


# --- validate ----------------------------------------------------------------------------------------


class Quarantine(Record):
    """The rows validation set aside (`validation.on_failure: quarantine`)."""

    rows: int
    """How many rows were set aside."""
    fraction: float
    """Their share of the input's rows."""
    file: str
    """Storage key of the Parquet file holding those rows, with `_row` (global row id) and `_failed` (why)."""
    row_ids_key: str
    """Storage key of the sorted int64 `.npy` array of their global row ids (what convert leaves out)."""


class ValidateResult(Record):
    """Stage `validate`: the raw input checked with Great Expectations."""

    version: int = 1
    """Record format version."""
    rows: int
    """Rows in the raw input."""
    files: list[str]
    """The raw files read, in order."""
    input_fingerprint: str
    """sha256 over the raw files' names, sizes and modification times: convert refuses input that changed since."""
    expectations: int
    """Expectations evaluated."""
    failures: list[str]
    """One line per failed expectation (empty when all passed)."""
    data_docs: str | None = None
    """Storage key of the Data Docs site's index.html, where one was built."""
    seconds: float
    """Wall time of the stage."""
    quarantine: Quarantine | None = None
    """The rows set aside, when validation quarantined some instead of failing."""


# --- convert -----------------------------------------------------------------------------------------


class ConvertResult(Record):
    """Stage `convert`: the packed dataset (Petastorm and/or TFRecord shards, manifest last)."""

    version: int = 1
    """Record format version."""
    dataset_id: str
    """Hash of the input, the quarantined rows and every setting that changes the output."""
    prefix: str
    """Storage prefix of the dataset (`datasets/<name>/<dataset_id>`); its `manifest.json` lists every file."""
    reused: bool
    """True when a dataset with the same id was already complete and nothing was converted."""
    rows: dict[str, int]
    """Rows per split (train, validation, test)."""
    files: int | None = None
    """Files written (None when reused)."""
    engine: str | None = None
    """Conversion engine that wrote them, `arrow` or `spark` (None when reused)."""
    seconds: float | None = None
    """Wall time of the conversion (None when reused)."""


# --- warm_cache --------------------------------------------------------------------------------------


class WarmUpPhase(Record):
    """One warm-up phase of the node-local cache (an entry of the spec's `cache.phases`)."""

    name: str
    """The phase's name in the spec (`cache.phases[].name`)."""
    files: int
    """Files that belong to the phase."""
    downloaded: int
    """Of those, the files fetched now (the others were already cached and verified)."""
    bytes: int
    """Bytes fetched now."""
    seconds: float
    """Wall time of the phase."""


class WarmCacheResult(Record):
    """Stage `warm_cache` (its first phase), or the later phases the train task warms beside training."""

    version: int = 1
    """Record format version."""
    cache_dir: str
    """Node-local directory of the cached dataset; training reads from it."""
    format: str
    """The packed format cached and trained on (`petastorm` or `tfrecord`)."""
    phases: list[WarmUpPhase]
    """The phases warmed by this call, in order."""
    pending_phases: int
    """Phases still to warm after this call (the train task warms them in the background)."""
    seconds: float
    """Wall time of all the phases warmed."""


# --- train -------------------------------------------------------------------------------------------


class BestValidation(Record):
    """The best validation score of a training run."""

    step: int
    """Optimizer step at which it was measured."""
    epoch: int
    """Epoch (0-based) it ended."""
    value: float
    """Its value of `evaluation.metric`."""


class TrainResult(Record):
    """Stage `train`: what torchrun's training run left."""

    version: int = 1
    """Record format version."""
    summary: str
    """Path of the trainer's summary.json (history, throughput, skipped batches)."""
    checkpoint_dir: str
    """Directory of the run's checkpoints (node-local; uploaded to storage when that is remote)."""
    best_checkpoint: str | None
    """Checkpoint of the best validation score, if any epoch was evaluated."""
    last_checkpoint: str
    """The last checkpoint written."""
    epochs: int
    """Epochs trained."""
    steps: int
    """Optimizer steps taken."""
    stopped_early: bool
    """True when early stopping (`evaluation.patience`) ended training."""
    best: BestValidation | None
    """The best validation score, if any epoch was evaluated."""
    micro_batch_size: int
    """Micro-batch this try trained with (smaller than the spec's after an out-of-memory failure)."""
    uploaded_checkpoints: list[str]
    """Checkpoints copied to remote storage by this try (empty when storage is this disk)."""
    warm_started_from: str | None = None
    """The published model version training started from (evaluation.warm_start), if any."""


# --- verify_checkpoint -------------------------------------------------------------------------------


class CheckedCheckpoint(Record):
    """A checkpoint that is committed, matches its manifest, fits its recorded model and is finite."""

    path: str
    """The checkpoint directory."""
    step: int
    """Optimizer step it was saved at."""
    files: int
    """Files its manifest lists (each verified by size and sha256)."""
    parameters: int
    """Parameters of its model (tied weights counted once)."""


class VerifyResult(Record):
    """Stage `verify_checkpoint`: the checkpoints evaluate and publish may use."""

    version: int = 1
    """Record format version."""
    last: CheckedCheckpoint
    """The last checkpoint."""
    best: CheckedCheckpoint
    """The best one (the last one when training recorded no best)."""
    quarantined: list[str] = []
    """Checkpoints that failed the gate and were moved to the quarantine directory (their place taken by
    the newest one before them that passes)."""


# --- publish -----------------------------------------------------------------------------------------


class RoundResult(Record):
    """Stage `evaluate_round` (a round's `evaluate` task): the round's validation score and the early-
    stopping state the later rounds read (from the trainer's own state in the round's checkpoint)."""

    version: int = 1
    """Record format version."""
    round: int
    """The round (1-based)."""
    rounds: int
    """Rounds planned."""
    epochs_trained: int
    """Epochs trained so far, all rounds together."""
    checkpoint: str
    """The round's verified checkpoint (the next round resumes from it)."""
    metric: str
    """Validation metric (evaluation.metric)."""
    value: float | None
    """Its value after the round's last epoch."""
    best_value: float | None
    """The best value so far."""
    best_epoch: int | None
    """The epoch (0-based) it was reached in."""
    bad_epochs: int
    """Epochs since the best one that did not improve it by evaluation.min_delta."""
    stop: bool
    """True: early stopping has ended training; the later rounds are skipped."""
    reason: str
    """One line: why training goes on or stops."""


class PublishResult(Record):
    """Stage `publish`: where the model, its card and the run's report went."""

    version: int = 1
    """Record format version."""
    published_version: str
    """The model version published (`models/<name>/<published_version>/`, named in `models/<name>/LATEST`)."""
    model: str
    """Where the weights are (storage URI)."""
    model_card: str
    """Where the model card is (storage URI)."""
    report: str
    """Where the run's report is (storage URI)."""
    checkpoints: str
    """Directory of the run's checkpoints."""
    metric: str
    """The spec's `evaluation.metric`."""
    value: float
    """Its value on the test split."""
    published: bool = True
    """False when evaluation.publish: if_better kept the model already published (`published_version`)."""
    reason: str | None = None
    """Why it was or was not published (if_better)."""


class TrainingOutcome(Record):
    """How training ended, as the report and the model card quote it."""

    epochs: int
    """Epochs trained."""
    steps: int
    """Optimizer steps taken."""
    stopped_early: bool
    """True when early stopping ended training."""


class StageRecords(Record):
    """The records of the stages before publish, as they were when the report was written."""

    # `validate` is a (deprecated) BaseModel classmethod: the field is `validate_`, named `validate` in JSON.
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True, validate_by_alias=True)
    validate_: ValidateResult = Field(alias="validate")
    """Stage `validate`."""
    convert: ConvertResult
    """Stage `convert`."""
    warm_cache: WarmCacheResult
    """Stage `warm_cache`."""
    train: TrainResult
    """Stage `train`."""
    verify_checkpoint: VerifyResult
    """Stage `verify_checkpoint`."""


class RunReport(Record):
    """The run's report (`runs/<dag>/<run>/report.json`), written by publish."""

    version: int = 2
    """Record format version (2: `test` holds every metric of the task, by name)."""
    pipeline: str
    """The spec's name."""
    dag_id: str
    """The DAG that ran."""
    run_id: str
    """The DAG run."""
    published: bool = True
    """Whether this run published its model (evaluation.publish: if_better may keep the old one)."""
    model: str
    """Where the published weights are (storage URI)."""
    model_card: str
    """Where the model card is (storage URI)."""
    checkpoints: str
    """Directory of the run's checkpoints."""
    test: HeldOutScores
    """The model's scores on the test split."""
    training: TrainingOutcome
    """How training ended."""
    stages: StageRecords
    """Every earlier stage's record."""
    recovery: RecoverySummary | None = None
    """What the training tries add up to: wall, productive and lost time, failures by class, MTBF."""
    attempts: list[AttemptHistory] = []
    """The attempt history of each training task."""


class AppliedParameter(Record):
    """A run parameter that changed the spec."""

    path: str
    """The spec field it overrides (e.g. training.epochs)."""
    spec_value: Any
    """The value the spec file gives."""
    value: Any
    """The value this run used."""


class EffectiveSpec(Record):
    """The spec a run used (`runs/<dag>/<run>/spec.json`), written by its first stage: the spec file with
    the run parameters applied, and which parameters were given and which changed something."""

    version: int = 1
    """Record format version."""
    spec_file: str
    """The spec file the DAG was built from."""
    run_id: str | None = None
    """The exact run id whose directory this is (None: written before Ballast recorded it)."""
    parameters_given: dict[str, Any]
    """The run parameters as the trigger gave them (the run's conf; the trigger form sends every one)."""
    parameters_applied: dict[str, AppliedParameter]
    """Parameter name -> the field it changed; a given parameter equal to the spec's value is not here."""
    spec: dict[str, Any]
    """The effective spec, as JSON."""


RECORDS: dict[str, type[Record]] = {
    "validate": ValidateResult,
    "convert": ConvertResult,
    "warm_cache": WarmCacheResult,
    "train": TrainResult,
    "verify_checkpoint": VerifyResult,
    "evaluate": EvaluateResult,
    "publish": PublishResult,
    "evaluate_round": RoundResult,
}
"""Pipeline stage -> the record it returns (closed: every stage of `ballast.pipeline.plan.STAGES` is here, and a
round's evaluate)."""

ROUND_RECORDS = frozenset({"train", "verify_checkpoint", "evaluate_round"})
"""Stages recorded once per round (`stages/round_<k>.<stage>.json`) when training runs in rounds."""
