"""The Ballast spec: one YAML file parsed once into a typed, frozen model.

No Airflow, no I/O beyond reading the file, no heavy imports: this module runs at DAG-parse time.
Unknown keys are rejected. Single-field rules sit beside their field; rules that tie fields together
sit in the `_check_*` validators of the model that owns both. Every problem is reported as one line:
``FILE:LINE: field.path: what is wrong (got VALUE); fix``.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ballast.errors import SpecError
from training.models import MODEL_NAMES

# libyaml's safe loader is ~10x faster than the pure-Python one; same safety (no arbitrary objects).
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
SPEC_VERSION = 1
NAME_PATTERN = r"^[a-z][a-z0-9_]{0,62}$"
FieldType = Literal["float32", "float64", "int32", "int64", "uint8", "bool", "string"]
PositiveInt = Annotated[int, Field(ge=1)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# --- dataset -----------------------------------------------------------------------------------


class FieldSpec(_Model):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Column name in the raw data."""
    type: FieldType
    """Element type. Array fields are stored flattened, row-major."""
    shape: tuple[PositiveInt, ...] = ()
    """Shape of one value; `[]` for a scalar, e.g. `[8, 8]` for an 8x8 image."""
    codec: Literal["auto", "png", "jpeg", "ndarray"] = "auto"
    """How the Petastorm dataset stores an array field: `png` or `jpeg` (compressed images; uint8 of
    shape [H, W] or [H, W, 3]), `ndarray` (numpy bytes, any type). `auto`: png for uint8 images,
    ndarray otherwise. Scalars are stored as plain Parquet columns."""

    @model_validator(mode="after")
    def _check_codec(self) -> FieldSpec:
        if self.codec in ("png", "jpeg"):
            image = len(self.shape) == 2 or (len(self.shape) == 3 and self.shape[2] in (1, 3))
            if self.type != "uint8" or not image:
                raise ValueError(f"codec: {self.codec} stores uint8 images of shape [H, W] or [H, W, 3]"
                                 f" (got {self.type} {list(self.shape)}); use codec: ndarray")
        elif self.codec == "ndarray" and not self.shape:
            raise ValueError("codec: ndarray is for array fields; a scalar needs no codec")
        return self

    @property
    def storage_codec(self) -> str:
        """The codec actually used: scalar, png, jpeg or ndarray."""
        if not self.shape:
            return "scalar"
        if self.codec != "auto":
            return self.codec
        image = len(self.shape) == 2 or (len(self.shape) == 3 and self.shape[2] in (1, 3))
        return "png" if self.type == "uint8" and image else "ndarray"


class SplitSpec(_Model):
    validation: float = Field(0.1, ge=0.0, lt=0.5)
    """Fraction of rows held out for per-epoch validation (early stopping)."""
    test: float = Field(0.1, gt=0.0, lt=0.5)
    """Fraction of rows held out for the final evaluation; never seen in training."""
    seed: int = 0
    """Seed of the deterministic row-to-split assignment."""


class DatasetSpec(_Model):
    location: str = Field(min_length=1)
    """Raw data: a Parquet file or directory of Parquet files; a path relative to BALLAST_HOME,
    an absolute path, or an s3:// URI read with the storage connection."""
    format: Literal["parquet"] = "parquet"
    """Format of the raw data."""
    fields: tuple[FieldSpec, ...] = Field(min_length=1)
    """Schema: every column the pipeline reads, with type and shape."""
    label: str
    """Name of the label column (an integer class id)."""
    num_classes: int = Field(ge=2, le=100_000)
    """Number of classes; labels must lie in [0, num_classes)."""
    split: SplitSpec = SplitSpec()
    """How rows are divided into train, validation and test."""

    @model_validator(mode="after")
    def _check_fields(self) -> DatasetSpec:
        names = [f.name for f in self.fields]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"fields: duplicate field name(s) {', '.join(dupes)}")
        if self.label not in names:
            raise ValueError(f"label: {self.label!r} is not one of the fields ({', '.join(names)})")
        label = next(f for f in self.fields if f.name == self.label)
        if label.type not in ("int32", "int64", "uint8") or label.shape:
            raise ValueError(f"label: field {self.label!r} must be a scalar integer (got {label.type} {list(label.shape)})")
        if len(names) != 2:
            raise ValueError(f"fields: need exactly one feature field besides the label (got {len(names) - 1});"
                             " models with several inputs are not supported yet")
        return self

    @property
    def features(self) -> tuple[FieldSpec, ...]:
        return tuple(f for f in self.fields if f.name != self.label)


# --- validation ----------------------------------------------------------------------------------

RuleKind = Literal["not_null", "between", "in_set", "row_count", "unique", "finite", "shape", "balance"]


class RuleSpec(_Model):
    kind: RuleKind
    """What to check: not_null, between (min/max), in_set (values), row_count (min/max), unique,
    finite (no NaN/Inf in a numeric or array column), shape (array length matches the schema),
    balance (every value's share of the rows within min/max, e.g. class balance of the label)."""
    column: str | None = None
    """The column checked; not used by row_count."""
    min: float | None = None
    """Lower bound (between, row_count)."""
    max: float | None = None
    """Upper bound (between, row_count)."""
    values: tuple[int | float | str | bool, ...] | None = None
    """Allowed values (in_set)."""
    mostly: float = Field(1.0, gt=0.0, le=1.0)
    """Fraction of rows that must pass."""

    @model_validator(mode="after")
    def _check_kind(self) -> RuleSpec:
        if self.kind == "row_count":
            if self.column is not None:
                raise ValueError("column: row_count checks the whole table; remove column")
        elif self.column is None:
            raise ValueError(f"column: rule {self.kind!r} needs a column")
        if self.kind in ("between", "row_count", "balance") and self.min is None and self.max is None:
            raise ValueError(f"rule {self.kind!r} needs min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is greater than max ({self.max})")
        if self.kind == "in_set" and not self.values:
            raise ValueError("values: rule 'in_set' needs a non-empty list of values")
        return self


class ValidationSpec(_Model):
    rules: tuple[RuleSpec, ...] = ()
    """Checks declared in the spec, run with Great Expectations before anything else."""
    suites: tuple[str, ...] = ()
    """Names of suite files under data_checks/suites/ (without .yaml) to run as well."""
    schema_checks: bool = True
    """Also check that every schema field exists, is not null and has its declared shape."""
    on_failure: Literal["fail", "quarantine"] = "fail"
    """`fail`: any failed expectation fails the run (no retry). `quarantine`: rows failing a row-level
    expectation go to a quarantine file and the good rows go on, unless more than
    `max_bad_fraction` of the rows are bad; table-level expectations (row_count) still fail the run."""
    max_bad_fraction: float = Field(0.01, ge=0.0, lt=1.0)
    """With `on_failure: quarantine`: the largest fraction of rows that may be set aside."""


# --- conversion and cache --------------------------------------------------------------------------


class ConversionSpec(_Model):
    formats: tuple[Literal["petastorm", "tfrecord"], ...] = ("petastorm", "tfrecord")
    """Packed formats to write: petastorm (Parquet readable by petastorm) and/or tfrecord."""
    shard_rows: int = Field(1000, ge=1, le=10_000_000)
    """Rows per output shard."""
    engine: Literal["arrow", "spark"] = "arrow"
    """Conversion engine: `arrow` streams in one process; `spark` runs the same conversion as a Spark
    job (`local[*]` here, or a cluster through `spark_master`). Both write the same rows and shards."""
    spark_master: str = "local[*]"
    """Spark master URL for the spark engine."""
    row_group_rows: int = Field(256, ge=1, le=1_000_000)
    """Rows per Parquet row group (the unit a Petastorm reader fetches)."""
    read_batch_rows: int = Field(4096, ge=1, le=1_000_000)
    """Rows read from the raw input at a time: bounds the arrow engine's memory."""

    @field_validator("formats")
    @classmethod
    def _unique_formats(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("list at least one format: petastorm, tfrecord")
        if len(set(v)) != len(v):
            raise ValueError(f"formats listed twice: {list(v)}")
        return v


class CacheStageSpec(_Model):
    name: str = Field(pattern=NAME_PATTERN)
    """Stage name, shown in the task log."""
    fraction: float = Field(gt=0.0, le=1.0)
    """Cumulative fraction of the training shards cached once this stage is done."""


class CacheSpec(_Model):
    directory: str | None = None
    """Node-local cache directory; default BALLAST_HOME/cache."""
    stages: tuple[CacheStageSpec, ...] = (
        CacheStageSpec(name="first_steps", fraction=0.25),
        CacheStageSpec(name="rest", fraction=1.0),
    )
    """Stages in order; the last must reach fraction 1.0. Validation and test shards come last."""
    max_bytes: int | None = Field(None, ge=1)
    """Byte budget of the cache; warming refuses to start a stage that would exceed it."""
    concurrency: int = Field(4, ge=1, le=64)
    """Parallel downloads."""
    wait_seconds: float = Field(3600.0, gt=0)
    """How long training waits for a shard that a later cache stage has not brought yet."""

    @field_validator("stages")
    @classmethod
    def _stages_increase(cls, v: tuple[CacheStageSpec, ...]) -> tuple[CacheStageSpec, ...]:
        if not v:
            raise ValueError("list at least one stage")
        fractions = [s.fraction for s in v]
        if any(b <= a for a, b in zip(fractions, fractions[1:])):
            raise ValueError(f"stage fractions must increase (got {fractions})")
        if fractions[-1] != 1.0:
            raise ValueError(f"the last stage must have fraction 1.0 (got {fractions[-1]})")
        return v


# --- training --------------------------------------------------------------------------------------


class CheckpointSpec(_Model):
    every_steps: int | None = Field(None, ge=1)
    """Save every N optimizer steps (in addition to every_seconds and the end of each epoch)."""
    every_seconds: float = Field(3600.0, gt=0)
    """Save at least this often (seed documents: hourly)."""
    keep_last: int = Field(3, ge=1, le=100)
    """Committed checkpoints kept, besides the best one."""
    asynchronous: bool = True
    """Write checkpoints in the background; training waits only for an in-memory snapshot."""
    writer_priority: Literal["idle", "normal"] = "idle"
    """CPU priority of the background writer. `idle` (Linux SCHED_IDLE): it runs on CPU time training
    leaves free, so a save slows training less, and takes longer where the CPUs are saturated.
    `normal`: the same priority as training."""
    resume_average_last: int = Field(0, ge=0, le=100)
    """On resume, start from the mean weights of the last N checkpoints (seed documents: 3); 0 = off."""


class LossScaleSpec(_Model):
    initial: float = Field(8192.0, gt=0)
    """Initial dynamic loss scale for fp16 (seed documents: 8192; PyTorch's default is 65536)."""
    growth_interval: int = Field(100, ge=1)
    """Steps without overflow before the scale grows (seed documents: 100; PyTorch's default is 2000)."""


class PlateauSpec(_Model):
    patience: int = Field(5, ge=1, le=1000)
    """Epochs without validation improvement before the learning rate is reduced (seed documents: 5)."""
    factor: float = Field(0.5, gt=0.0, lt=1.0)
    """Multiplier applied to the learning rate on a plateau (seed documents: 0.5)."""


class MonitorSpec(_Model):
    spike_zscore: float = Field(3.0, gt=0)
    """A loss this many standard deviations above the trailing window is a spike (seed documents: 3)."""
    spike_window: int = Field(50, ge=5, le=100_000)
    """Steps in the trailing window of the spike detector."""
    spike_action: Literal["alert", "rollback"] = "alert"
    """alert: an event and an immediate checkpoint (see anomaly_checkpoint_min_steps); rollback: back to the
    last checkpoint, batch skipped."""
    stats_every_steps: int = Field(50, ge=1)
    """Gradient norm and histogram statistics every N steps."""
    anomaly_checkpoint_min_steps: int = Field(100, ge=0)
    """An anomaly (a loss spike under alert) checkpoints the last good state, at most once per this
    many steps so that a storm of alerts does not become a storm of saves; 0: after every anomaly."""


class TrainingSpec(_Model):
    model: str
    """Architecture from the closed registry (training/models.py): mlp, cnn, or embed (pixel values
    0-255 as tokens, for uint8 images; its embeddings stay in fp32 under mixed precision)."""
    hidden_size: int = Field(128, ge=1, le=65536)
    """Width of the hidden layers."""
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    """Dropout probability."""
    nodes: int = Field(1, ge=1, le=4096)
    """Machines (pods) taking part."""
    processes_per_node: int = Field(2, ge=1, le=64)
    """Training processes per machine (one per GPU on GPU machines)."""
    micro_batch_size: int = Field(ge=1, le=65536)
    """Samples per process per forward/backward pass."""
    global_batch_size: int = Field(ge=1, le=16_777_216)
    """Samples per optimizer step over all processes; kept fixed when the micro-batch changes."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision; bf16/fp16 use autocast (fp32 on CPU where autocast does not apply)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """Optimizer."""
    learning_rate: float = Field(gt=0.0, le=10.0)
    """Peak learning rate."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """Decoupled weight decay."""
    epochs: int = Field(ge=1, le=100_000)
    """Upper bound on epochs; early stopping may end sooner."""
    grad_clip_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping max norm (seed documents: 1.0)."""
    seed: int = 0
    """Seed of model init, shuffling and dropout."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    """When checkpoints are written and how many are kept."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """ddp: replicated weights; fsdp: fully sharded weights, gradients and optimizer state (ZeRO-3)."""
    gradient_compression: Literal["none", "fp16", "bf16"] = "none"
    """DDP gradient compression hook for slow networks (ddp only)."""
    lr_reference_batch_size: int | None = Field(None, ge=1)
    """If set, the learning rate is scaled linearly by global_batch_size / this (seed documents: 32 per
    device as the reference)."""
    loss_scale: LossScaleSpec = LossScaleSpec()
    """Dynamic loss scaling for fp16."""
    lr_plateau: PlateauSpec = PlateauSpec()
    """Learning-rate decay when the validation metric stops improving."""
    monitors: MonitorSpec = MonitorSpec()
    """Loss-spike detection and gradient statistics."""
    gpu_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """Per-process GPU memory cap (seed documents: under 90%)."""
    loader_workers: int | None = Field(None, ge=0, le=64)
    """DataLoader worker processes per training process; default twice the compute devices per
    process (seed documents' 2-3x rule: 2 on one GPU or on CPU). 0 reads in the training process."""
    loader_prefetch: int = Field(2, ge=1, le=64)
    """Shard chunks each loader worker decodes ahead."""
    data_format: Literal["petastorm", "tfrecord"] | None = None
    """Which converted format training reads; default the first of conversion.formats."""
    cpu_reserve_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    """Share of CPU cores left to data loading (seed documents: 20%)."""
    reuse_freed_memory: bool = True
    """Training processes keep freed host memory for the next step instead of returning it to the OS
    after every step (glibc malloc thresholds; see training/hostmem.py). Resident memory stays at the
    step's peak; false gives glibc's defaults."""

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        if v not in MODEL_NAMES:
            raise ValueError(f"unknown model {v!r}; known: {', '.join(MODEL_NAMES)}")
        return v

    @model_validator(mode="after")
    def _check_parallelism(self) -> TrainingSpec:
        if self.parallelism == "fsdp" and self.gradient_compression != "none":
            raise ValueError("gradient_compression: DDP compression hooks do not apply to fsdp; set none")
        return self

    @property
    def effective_learning_rate(self) -> float:
        if self.lr_reference_batch_size is None:
            return self.learning_rate
        return self.learning_rate * self.global_batch_size / self.lr_reference_batch_size

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @model_validator(mode="after")
    def _check_batch(self) -> TrainingSpec:
        step = self.micro_batch_size * self.world_size
        if self.global_batch_size % step:
            raise ValueError(
                f"global_batch_size: must be a multiple of micro_batch_size x processes_per_node x nodes"
                f" = {self.micro_batch_size} x {self.processes_per_node} x {self.nodes} = {step}"
                f" (got {self.global_batch_size})")
        return self

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.world_size)


class RecoverySpec(_Model):
    retries: int = Field(3, ge=0, le=50)
    """Airflow retries of each task (seed documents: at most 3 after out-of-memory)."""
    retry_delay_seconds: float = Field(30.0, ge=0.0, le=86_400)
    """Wait before a retry."""
    max_restarts: int = Field(0, ge=0, le=100)
    """torchrun restarts of the process group within one try."""
    preempt_grace_seconds: float = Field(60.0, gt=0)
    """After SIGTERM (preemption notice), time allowed to commit a checkpoint before exiting."""
    oom_micro_batch_factor: float = Field(0.5, gt=0.0, lt=1.0)
    """After an out-of-memory failure the next try multiplies the micro-batch by this factor
    (global batch kept through gradient accumulation)."""


class EvaluationSpec(_Model):
    metric: Literal["accuracy", "loss"] = "accuracy"
    """Metric on the validation split for early stopping, and on the test split for publishing."""
    mode: Literal["max", "min"] = "max"
    """Whether a larger or a smaller metric is better."""
    patience: int = Field(3, ge=1, le=1000)
    """Epochs without improvement before training stops (seed documents: 3)."""
    min_delta: float = Field(0.0, ge=0.0)
    """Smallest change that counts as an improvement."""
    threshold: float | None = None
    """Publish only if the test metric is at least (max) / at most (min) this value."""

    @model_validator(mode="after")
    def _check_mode(self) -> EvaluationSpec:
        natural = {"accuracy": "max", "loss": "min"}[self.metric]
        if self.mode != natural:
            raise ValueError(f"mode: metric {self.metric!r} improves when it goes {natural}; set mode: {natural}")
        return self


class ScheduleSpec(_Model):
    cron: str | None = None
    """Cron expression or preset (@daily) for periodic retraining."""
    asset: str | None = None
    """Asset URI (e.g. s3://bucket/raw/digits): retrain when a producer updates it."""
    start_date: dt.date = dt.date(2026, 1, 1)
    """First logical date."""
    catchup: bool = False
    """Run the intervals missed since start_date."""

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, v: str | None) -> str | None:
        if v is None:
            return v
        presets = {"@once", "@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@annually"}
        if v.startswith("@"):
            if v not in presets:
                raise ValueError(f"unknown preset {v!r}; use one of {', '.join(sorted(presets))}")
            return v
        parts = v.split()
        if len(parts) != 5 or not all(re.fullmatch(r"[0-9*/,\-A-Za-z?LW#]+", p) for p in parts):
            raise ValueError(f"not a 5-field cron expression: {v!r} (e.g. '0 3 * * 1')")
        return v

    @model_validator(mode="after")
    def _one_trigger(self) -> ScheduleSpec:
        if self.cron and self.asset:
            raise ValueError("set cron or asset, not both")
        return self


class StorageSpec(_Model):
    uri: str = "storage"
    """Where datasets, checkpoints and models live: a path (relative to BALLAST_HOME) or s3://bucket/prefix."""
    conn_id: str | None = None
    """Airflow connection with S3 credentials and endpoint; default: the standard AWS environment."""
    retry_mode: Literal["standard", "adaptive", "legacy"] = "adaptive"
    """botocore retry mode for S3 calls (adaptive adds client-side rate limiting on throttling)."""
    max_attempts: int = Field(8, ge=1, le=50)
    """Attempts per S3 call, the first included."""
    multipart_chunk_mb: int = Field(16, ge=5, le=5120)
    """Part size of multipart uploads and downloads (boto3's transfer manager); files above it go in parts."""
    transfer_concurrency: int = Field(8, ge=1, le=64)
    """Parallel parts per multipart transfer."""

    @field_validator("uri")
    @classmethod
    def _valid_uri(cls, v: str) -> str:
        if "://" in v and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?", v):
            raise ValueError(f"must be a local path or s3://bucket/prefix (got {v!r})")
        return v


class KubernetesSpec(_Model):
    image: str = Field(min_length=1)
    """Training image (built from docker/training.Dockerfile)."""
    namespace: str = "default"
    """Namespace of the training pods."""
    service_account: str | None = None
    """Service account of the training pods."""
    cpu: str = "2"
    """CPU request per pod."""
    memory: str = "8Gi"
    """Memory request per pod."""
    gpus_per_node: int = Field(0, ge=0, le=16)
    """nvidia.com/gpu limit per pod."""


class ExecutionSpec(_Model):
    backend: Literal["local", "kubernetes"] = "local"
    """Where training runs: `local` (torchrun on the worker) or `kubernetes` (one pod per node)."""
    kubernetes: KubernetesSpec | None = None
    """Pod settings; required when backend is kubernetes."""
    hang_timeout_seconds: float = Field(1800.0, gt=0)
    """A training process without a finished step for this long counts as hung: its stacks are dumped
    and it is ended."""
    metrics_port: int | None = Field(None, ge=1024, le=65000)
    """First port of the per-rank Prometheus endpoints (rank r serves on port + r); none if unset."""

    @model_validator(mode="after")
    def _check_backend(self) -> ExecutionSpec:
        if self.backend == "kubernetes" and self.kubernetes is None:
            raise ValueError("kubernetes: backend 'kubernetes' needs a kubernetes section with at least image")
        if self.backend == "kubernetes":
            # Refused here rather than after hours of upstream stages: training pods still need their own
            # cache warm-up and checkpoint upload, which only the local backend has so far.
            raise ValueError("backend: 'kubernetes' cannot launch training pods in this release; use backend: local")
        return self


# --- the spec --------------------------------------------------------------------------------------


class Spec(_Model):
    version: Literal[1] = 1
    """Spec format version."""
    name: str = Field(pattern=NAME_PATTERN)
    """Pipeline name; the DAG id is `ballast_<name>`."""
    description: str = ""
    """Shown on the DAG page."""
    owner: str = "ballast"
    """DAG owner."""
    tags: tuple[str, ...] = ()
    """DAG tags (`ballast` is always added)."""
    dataset: DatasetSpec
    validation: ValidationSpec = ValidationSpec()
    conversion: ConversionSpec = ConversionSpec()
    cache: CacheSpec = CacheSpec()
    training: TrainingSpec
    recovery: RecoverySpec = RecoverySpec()
    evaluation: EvaluationSpec = EvaluationSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    storage: StorageSpec = StorageSpec()
    execution: ExecutionSpec = ExecutionSpec()
    overridable: tuple[str, ...] = ()
    """Dotted field paths (e.g. training.learning_rate) a person may change when triggering a run.
    Each becomes a run parameter named after its last part."""

    @property
    def dag_id(self) -> str:
        return f"ballast_{self.name}"

    @property
    def train_format(self) -> str:
        """The converted format training reads."""
        return self.training.data_format or self.conversion.formats[0]

    @model_validator(mode="after")
    def _check_cross(self) -> Spec:
        names = {f.name for f in self.dataset.fields}
        for i, rule in enumerate(self.validation.rules):
            if rule.column is not None and rule.column not in names:
                raise ValueError(f"validation.rules[{i}].column: {rule.column!r} is not a dataset field"
                                 f" ({', '.join(sorted(names))})")
        fmt = self.training.data_format
        if fmt is not None and fmt not in self.conversion.formats:
            raise ValueError(f"training.data_format: {fmt!r} is not among conversion.formats"
                             f" ({', '.join(self.conversion.formats)}); add it there or pick one of those")
        leaves: dict[str, str] = {}
        for path in self.overridable:
            info = overridable_field(path)  # raises ValueError naming the path
            leaf = path.rsplit(".", 1)[-1]
            if leaf in leaves:
                raise ValueError(f"overridable: {path!r} and {leaves[leaf]!r} would both be parameter {leaf!r}")
            leaves[leaf] = path
            del info
        return self


# --- overridable fields ------------------------------------------------------------------------------

_SCALARS = (int, float, str, bool)


def overridable_field(path: str) -> tuple[type[BaseModel], str]:
    """Resolve a dotted path to (owning model class, field name); only scalar fields qualify."""
    model: type[BaseModel] = Spec
    parts = path.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            raise ValueError(f"overridable: {path!r} is not a spec field ({'.'.join(parts[:i + 1])} unknown)")
        ann = field.annotation
        if i < len(parts) - 1:
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                raise ValueError(f"overridable: {path!r}: {'.'.join(parts[:i + 1])} has no sub-fields")
            model = ann
        else:
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                raise ValueError(f"overridable: {path!r} is a section; name one of its fields")
            if getattr(ann, "__origin__", None) is tuple:
                raise ValueError(f"overridable: {path!r} is a list; only single values can be overridden")
            return model, part
    raise ValueError(f"overridable: empty path {path!r}")


def get_path(spec: Spec, path: str) -> Any:
    value: Any = spec
    for part in path.split("."):
        value = getattr(value, part)
    return value


def apply_overrides(spec: Spec, overrides: dict[str, Any], *, source: str = "run parameters") -> Spec:
    """Return a new spec with `{leaf: value}` overrides applied to the overridable paths, re-validated."""
    by_leaf = {p.rsplit(".", 1)[-1]: p for p in spec.overridable}
    unknown = sorted(set(overrides) - set(by_leaf))
    if unknown:
        raise SpecError(f"{source}: unknown parameter(s) {', '.join(unknown)}; allowed: {', '.join(sorted(by_leaf)) or 'none'}")
    data = spec.model_dump(mode="json")
    for leaf, value in overrides.items():
        *head, last = by_leaf[leaf].split(".")
        node = data
        for part in head:
            node = node[part]
        node[last] = value
    return parse_spec(data, source=source)


# --- loading and error reporting ---------------------------------------------------------------------


def load_spec(path: str | Path) -> Spec:
    """Read and validate one spec file. Raises SpecError with one line per problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read spec ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        data = yaml.load(text, Loader=_SafeLoader)  # safe: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{where}: invalid YAML: {problem}") from exc
    return parse_spec(data, source=str(path), text=text)


def parse_spec(data: Any, *, source: str = "<spec>", text: str | None = None) -> Spec:
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError(f"{source}: a spec is a YAML mapping of sections (dataset, training, ...); this file is {kind}")
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        lines = _line_index(text) if text else {}
        raise SpecError([_format_error(source, err, lines) for err in exc.errors()]) from exc


def _format_error(source: str, err: dict[str, Any], lines: dict[tuple, int]) -> str:
    loc = tuple(err["loc"])
    kind = err["type"]
    ctx = err.get("ctx") or {}
    value = err.get("input")
    msg = err["msg"]
    if kind == "value_error":
        msg = str(ctx.get("error", msg))
        # A model-level check may name a sub-field: "label: 'x' is not ..." -> loc + label.
        head, sep, rest = msg.partition(": ")
        if sep and re.fullmatch(r"[a-z_][a-z0-9_.\[\]]*", head):
            for part in head.split("."):
                name, _, index = part.partition("[")
                loc = loc + ((name, int(index.rstrip("]"))) if index else (name,))
            msg = rest
        value = _NOVALUE
    elif kind == "extra_forbidden":
        msg = f"unknown key {loc[-1]!r}"
        allowed = _allowed_keys(loc[:-1])
        if allowed:
            msg += f"; allowed here: {', '.join(allowed)}"
        value = _NOVALUE
    elif kind == "missing":
        msg = "required field is missing"
        value = _NOVALUE
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        msg = f"must be {op} {bound}"
    elif kind == "literal_error":
        msg = f"must be one of {ctx.get('expected')}"
    elif kind in ("int_parsing", "int_type", "int_from_float"):
        msg = "must be an integer"
    elif kind in ("float_parsing", "float_type"):
        msg = "must be a number"
    elif kind in ("string_type",):
        msg = "must be a string"
    elif kind in ("bool_parsing", "bool_type"):
        msg = "must be true or false"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        msg = "must be a mapping of keys"
    elif kind in ("tuple_type", "list_type"):
        msg = "must be a list"
    elif kind == "string_pattern_mismatch":
        msg = f"must match {ctx.get('pattern')}"
    elif kind in ("too_short", "string_too_short"):
        msg = "must not be empty"
    else:
        msg = msg[0].lower() + msg[1:] if msg else kind
    field = _dotted(loc) or "(top level)"
    line = _nearest_line(lines, loc)
    where = f"{source}:{line}" if line else source
    got = "" if value is _NOVALUE else f" (got {_short(value)})"
    return f"{where}: {field}: {msg}{got}"


_NOVALUE = object()


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.startswith("[") and part.endswith("]"):
            out += part
        else:
            # pydantic adds the union member's type name as a loc element; drop it.
            if part in ("str", "int", "float", "bool", "KubernetesSpec"):
                continue
            out += ("." if out else "") + str(part)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = Spec
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        candidates = [ann, *args]
        nested = [a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            for a in args:  # tuple[Model, ...]
                if isinstance(a, type) and issubclass(a, BaseModel):
                    nested = [a]
        if not nested:
            return []
        model = nested[0]
    return list(getattr(model, "model_fields", {}))


def _line_index(text: str) -> dict[tuple, int]:
    """Map each key/item path in the YAML document to its 1-based line number."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    index: dict[tuple, int] = {}

    def walk(node: Any, path: tuple) -> None:
        index[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                kpath = path + (key.value,)
                walk(value, kpath)
                index[kpath] = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    if root is not None:
        walk(root, ())
    return index


def _nearest_line(index: dict[tuple, int], loc: tuple) -> int | None:
    loc = tuple(p for p in loc if not (isinstance(p, str) and p in ("str", "int", "float", "bool")))
    while loc:
        if loc in index:
            return index[loc]
        loc = loc[:-1]
    return None


def json_schema() -> dict[str, Any]:
    """JSON Schema of the spec, for editors (yaml-language-server) and `ballast schema`."""
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Ballast training pipeline spec"
    return schema
