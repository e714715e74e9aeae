"""The sections of a training run's settings, each defined once.

*Settings* sections hold what a person writes in a spec. The spec's `training`, `evaluation`,
`recovery` and `execution` sections are built from them (by inheritance for flat fields such as
`training.learning_rate`, as sub-models for nested ones such as `training.checkpoint.every_steps`), so
every default, bound, docstring and check exists here and nowhere else. The run config's own sections
(`training.config.run`: *Config* classes) extend them with what the orchestrator fills in for one try
(paths, the cache's format, the adapted micro-batch); they are not built at DAG-parse time.

pydantic only: no torch, no Airflow, no `ballast`. The spec imports this module at DAG-parse time.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from ballast.training.config import docstrings
from ballast.training.models import OPTIMIZER_NAMES, registry
from ballast.training.tasks import ALL_METRICS, DEFAULT_TASK, DIRECTION, TASKS

PositiveInt = Annotated[int, Field(ge=1, le=2**40)]
NumClasses = Annotated[int, Field(ge=2, le=100_000)]
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
"""A seed every consumer takes: numpy's SeedSequence refuses negatives, its legacy seeding 2^32 and up."""
MAX_SECONDS = 31_536_000.0
"""A year: the longest duration any setting needs (timers and timedeltas overflow far above it)."""
MAX_STEPS = 2**40
"""The most steps any step count may name (a trillion steps is far past any run; int64 everywhere)."""
MAX_SHAPE_ELEMENTS = 2**31
"""Elements in one value of a field: what a 32-bit index reaches (int64 products overflow far sooner)."""
MAX_SHAPE_DIMENSIONS = 8


def _bounded_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) > MAX_SHAPE_DIMENSIONS:
        raise ValueError(f"{len(shape)} dimensions; at most {MAX_SHAPE_DIMENSIONS}")
    elements = 1
    for size in shape:
        elements *= size
    if elements > MAX_SHAPE_ELEMENTS:
        raise ValueError(f"{elements} elements per value ({' x '.join(map(str, shape))}); at most"
                         f" {MAX_SHAPE_ELEMENTS} (2^31)")
    return shape


Shape = Annotated[tuple[PositiveInt, ...], AfterValidator(_bounded_shape)]
"""The shape of one value: at most MAX_SHAPE_DIMENSIONS dimensions and MAX_SHAPE_ELEMENTS elements."""
DataFormat = Literal["petastorm", "tfrecord"]


class Section(BaseModel):
    """Frozen, unknown keys refused, the docstring under each field is its description."""

    # The validator is built at first use (not at import: the spec builds only what it validates), and
    # the descriptions come from training.config.docstrings, a cheaper reader than pydantic's own.
    # No setting is infinite or NaN: .inf turned guards off and overflowed where a number became an int.
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True, allow_inf_nan=False)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        docstrings.apply(cls)

    def section(self, cls: type[S]) -> S:
        """The settings section `cls` that this model is built from (one of its bases), whole: every field
        `cls` declares, with this model's values. The spec's `training` inherits several sections flat
        (their fields are its YAML keys); this is how each reaches the run config as one section."""
        if not isinstance(self, cls):
            raise TypeError(f"{type(self).__name__} is not built from {cls.__name__}")
        return cls.model_validate(self.model_dump(include=set(cls.model_fields)))


S = TypeVar("S", bound=Section)


# --- model -------------------------------------------------------------------------------------------


def _registered(kind: str, names: tuple[str, ...], value: object) -> object:
    """The registry's own message for an unknown name (before pydantic's generic "must be one of")."""
    if isinstance(value, str) and value not in names:
        raise ValueError(f"unknown {kind} {value!r}; known: {', '.join(names)}")
    return value


ModelName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
"""An entry point's name in the `ballast.models` group."""


class ModelChoice(Section):
    """A model from the `ballast.models` entry points and its options. A plain name (`model: mlp`) is
    `{name: mlp}`."""

    name: ModelName
    """The entry point's name: a built-in (mlp, cnn, embed, gpt, unet; hf_causal_lm with the `hf` extra) or
    one an installed package registers (`[project.entry-points."ballast.models"]`)."""
    options: dict[str, Any] = {}
    """Handed to the model's factory as they are; checked against its options_schema, where it has one,
    by `ballast lint` and by every run before any data is read."""

    @field_validator("name")
    @classmethod
    def _registered_name(cls, v: str) -> str:
        if v not in registry.names():  # entry-point metadata only: no model module is imported
            raise ValueError(registry.unknown(v))
        return v


def _plain_model_name(v: object) -> object:
    """`model: mlp` is `model: {name: mlp}`."""
    return {"name": v} if isinstance(v, str) else v


CLASSIC_MODELS = ("mlp", "cnn", "embed")
"""The built-ins whose options default to the flat `training.hidden_size` and `training.dropout`."""


class ModelSettings(Section):
    task: Literal[TASKS] = DEFAULT_TASK  # type: ignore[valid-type]
    """What is learned, which decides the loss, the metrics and the fields the dataset needs:
    classification (a class per row), causal_lm (next token of text), segmentation (a class per pixel or
    voxel), regression (float values)."""
    model: Annotated[ModelChoice, BeforeValidator(_plain_model_name, json_schema_input_type=ModelName | ModelChoice)]
    """The model: `{name: gpt, options: {layers: 4}}`, or a plain name (`mlp`)."""
    hidden_size: int = Field(128, ge=1, le=65536)
    """Width of the hidden layers of mlp, cnn and embed (their options' default)."""
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    """Dropout probability of mlp, cnn and embed (their options' default)."""
    seq_len: int | None = Field(None, ge=1, le=1_048_576)
    """causal_lm: tokens per training sequence (each stored sequence holds seq_len + 1 tokens)."""

    @model_validator(mode="after")
    def _check_seq_len(self) -> ModelSettings:
        if self.task == "causal_lm" and self.seq_len is None:
            raise ValueError("seq_len: task causal_lm needs seq_len (tokens per training sequence)")
        if self.task != "causal_lm" and self.seq_len is not None:
            raise ValueError(f"seq_len: only task causal_lm reads seq_len (the task is {self.task}); remove it")
        return self

    @property
    def model_options(self) -> dict[str, Any]:
        """The options the factory gets: for mlp, cnn and embed, hidden_size and dropout default to the
        flat settings."""
        if self.model.name in CLASSIC_MODELS:
            return {"hidden_size": self.hidden_size, "dropout": self.dropout, **self.model.options}
        return dict(self.model.options)


# --- batch -------------------------------------------------------------------------------------------


class BatchSettings(Section):
    micro_batch_size: int = Field(ge=1, le=65536)
    """Samples per process per forward/backward pass."""
    global_batch_size: int = Field(ge=1, le=16_777_216)
    """Samples per optimizer step over all processes; kept fixed when the micro-batch changes."""




# --- optimisation ------------------------------------------------------------------------------------


class PlateauSettings(Section):
    patience: int = Field(5, ge=1, le=1000)
    """Epochs without validation improvement before the learning rate is reduced (seed documents: 5)."""
    factor: float = Field(0.5, gt=0.0, lt=1.0)
    """Multiplier applied to the learning rate on a plateau (seed documents: 0.5)."""


class OptimSettings(Section):
    optimizer: Literal[OPTIMIZER_NAMES] = "adamw"  # type: ignore[valid-type]
    """Optimizer (PyTorch's fused kernel)."""
    learning_rate: float = Field(gt=0.0, le=10.0)
    """Peak learning rate."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """Decoupled weight decay."""
    grad_clip_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping max norm (seed documents: 1.0)."""
    lr_plateau: PlateauSettings = PlateauSettings()
    """Learning-rate decay when the validation metric stops improving."""

    @field_validator("optimizer", mode="before")
    @classmethod
    def _known_optimizer(cls, v: object) -> object:
        return _registered("optimizer", OPTIMIZER_NAMES, v)


# --- numerics ----------------------------------------------------------------------------------------


class LossScaleSettings(Section):
    initial: float = Field(8192.0, gt=0, le=2**24)
    """Initial dynamic loss scale for fp16 (seed documents: 8192; PyTorch's default is 65536); at most
    2^24, since every step whose scaled gradients overflow fp16 is skipped while the scale halves."""
    growth_interval: int = Field(100, ge=1, le=1_000_000)
    """Steps without overflow before the scale grows (seed documents: 100; PyTorch's default is 2000)."""
    minimum: float = Field(1.0, gt=0, le=2**24)
    """The scale at or below which no step is skipped (DeepSpeed's min_loss_scale: 1; `initial` where
    that is lower): a step whose gradients are not finite at this scale or under it ends the run as
    diverged, as without loss scaling. Each skipped step halves the scale, so a loss or gradients that
    stay non-finite end the run within about log2(initial / minimum) + 1 steps, where they were skipped
    for ever."""

    @model_validator(mode="before")
    @classmethod
    def _default_minimum(cls, raw: Any) -> Any:
        """No `minimum` given and an `initial` under 1 (valid before the minimum existed): start there."""
        if isinstance(raw, dict) and "minimum" not in raw:
            initial = raw.get("initial")
            if isinstance(initial, (int, float)) and not isinstance(initial, bool) and 0 < initial < 1:
                return {**raw, "minimum": initial}
        return raw

    @model_validator(mode="after")
    def _check_minimum(self) -> LossScaleSettings:
        if self.minimum > self.initial:
            raise ValueError(f"minimum: {self.minimum:g} is above initial ({self.initial:g}); the scale starts at"
                             " initial and only halves down to minimum, so set minimum <= initial")
        return self


class NumericsSettings(Section):
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision; bf16/fp16 use autocast (fp32 on CPU where autocast does not apply)."""
    loss_scale: LossScaleSettings = LossScaleSettings()
    """Dynamic loss scaling for fp16."""


# --- distribution and resources ----------------------------------------------------------------------


class DistributedSettings(Section):
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """ddp: replicated weights; fsdp: fully sharded weights, gradients and optimizer state (ZeRO-3)."""
    gradient_compression: Literal["none", "fp16", "bf16"] = "none"
    """DDP gradient compression hook for slow networks (ddp only)."""
    activation_checkpointing: bool = False
    """Recompute each model block's activations in backward instead of keeping them (less memory, about
    a third more compute); per block of `ballast_blocks()`, under ddp or fsdp."""

    @model_validator(mode="after")
    def _check_parallelism(self) -> DistributedSettings:
        if self.parallelism == "fsdp" and self.gradient_compression != "none":
            raise ValueError("gradient_compression: DDP compression hooks do not apply to fsdp; set none")
        return self


class ResourceSettings(Section):
    gpu_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """Per-process GPU memory cap (seed documents: under 90%)."""
    cpu_reserve_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    """Share of CPU cores left to data loading (seed documents: 20%)."""
    reuse_freed_memory: bool = True
    """Training processes keep freed host memory for the next step instead of returning it to the OS
    after every step (glibc malloc thresholds; see training/hostmem.py). Resident memory stays at the
    step's peak; false gives glibc's defaults."""


class LoaderSettings(Section):
    loader_workers: int = Field(2, ge=0, le=64)
    """DataLoader worker processes per training process; twice the compute devices per process (the
    seed documents' 2-3x rule: 2 on one GPU or on CPU). 0 reads in the training process."""
    loader_prefetch: int = Field(2, ge=1, le=64)
    """Shard chunks each loader worker decodes ahead."""

    @field_validator("loader_workers", mode="before")
    @classmethod
    def _null_is_the_default(cls, v: object) -> object:
        return 2 if v is None else v  # specs written when the default was `null` (= 2 per process)




# --- checkpoints, monitors, early stopping -----------------------------------------------------------


class CheckpointSettings(Section):
    every_steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    """Save every N optimizer steps (in addition to every_seconds and the end of each epoch)."""
    every_seconds: float = Field(3600.0, gt=0, le=MAX_SECONDS)
    """Save at least this often (seed documents: hourly)."""
    keep_last: int = Field(3, ge=1, le=100)
    """Committed checkpoints kept, besides the best one."""
    asynchronous: bool = True
    """Write checkpoints in the background; training waits only for an in-memory snapshot."""
    writer_priority: Literal["idle", "normal"] = "idle"
    """CPU priority of the background writer. `idle` (Linux SCHED_IDLE): it runs on CPU time training
    leaves free, so a save slows training less, and takes longer where the CPUs are saturated.
    `normal`: the same priority as training."""
    writer_process: bool = True
    """Write background saves from a process of its own (Linux; never holds training's GIL); false: a thread."""
    resume_average_last: int = Field(0, ge=0, le=100)
    """On resume, start from the mean weights of the last N checkpoints (seed documents: 3); 0 = off."""
    resume: bool = True
    """Resume from the newest checkpoint that passes the gate; false: every try and every restart starts
    from step 0 (what a run without checkpoints would do: the goodput benchmark's comparison)."""


class MonitorSettings(Section):
    spike_zscore: float = Field(3.0, gt=0)
    """A loss this many standard deviations above the trailing window is a spike (seed documents: 3)."""
    spike_window: int = Field(50, ge=5, le=100_000)
    """Steps in the trailing window of the spike detector."""
    spike_action: Literal["alert", "rollback"] = "alert"
    """alert: an event and an immediate checkpoint (see anomaly_checkpoint_min_steps); rollback: back to the
    last checkpoint, batch skipped."""
    stats_every_steps: int = Field(50, ge=1, le=MAX_STEPS)
    """Gradient norm and histogram statistics every N steps."""
    anomaly_checkpoint_min_steps: int = Field(100, ge=0, le=MAX_STEPS)
    """An anomaly (a loss spike under alert) checkpoints the last good state, at most once per this
    many steps so that a storm of alerts does not become a storm of saves; 0: after every anomaly."""
    max_rollbacks: int = Field(3, ge=0, le=100)
    """Under spike_action rollback: rollbacks to the same checkpoint after which a spike that keeps
    coming back counts as the data, not a fluke, and training goes on (the alert and the anomaly
    checkpoint still happen); 0: never roll back."""


Metric = Literal[ALL_METRICS]  # type: ignore[valid-type]


class EarlyStopSettings(Section):
    metric: Metric | None = None
    """Metric on the validation split for early stopping and the LR plateau, and on the test split for
    publishing: one of the task's (classification: accuracy, loss; causal_lm: loss, perplexity,
    bits_per_byte; segmentation: mean_iou, dice, loss; regression: rmse, mae, loss). Default: the task's
    first."""
    mode: Literal["max", "min"] | None = None
    """Whether a larger or a smaller metric is better; the metric knows (a contradicting mode is refused)."""
    patience: int = Field(3, ge=1, le=1000)
    """Epochs without improvement before training stops (seed documents: 3)."""
    min_delta: float = Field(0.0, ge=0.0)
    """Smallest change that counts as an improvement."""

    @model_validator(mode="after")
    def _check_mode(self) -> EarlyStopSettings:
        if self.metric is not None and self.mode is not None:
            natural = DIRECTION[self.metric]
            if self.mode != natural:
                raise ValueError(f"mode: metric {self.metric!r} improves when it goes {natural}; set mode: {natural}"
                                 f" or leave mode out")
        return self


def resolve_early_stop(raw: Any, task: Any) -> Any:
    """A raw (not yet validated) early-stopping mapping with `metric` and `mode` filled in for `task`:
    the task's default metric, the metric's direction. Anything malformed is left for validation to
    name."""
    from ballast.training.tasks import METRICS, default_metric

    if raw is None:
        raw = {}
    if not isinstance(raw, dict) or task not in METRICS:
        return raw
    out = dict(raw)
    if out.get("metric") is None:
        out["metric"] = default_metric(task)
    if out.get("mode") is None and out["metric"] in DIRECTION:
        out["mode"] = DIRECTION[out["metric"]]
    return out


# --- what the training process needs of recovery and execution ---------------------------------------


class RecoverySettings(Section):
    preempt_grace_seconds: float = Field(60.0, gt=0, le=65535)
    """After SIGTERM (preemption notice), time allowed to commit a checkpoint before exiting; at most
    65535 (sbatch --signal's limit; the pods' terminationGracePeriodSeconds on Kubernetes)."""


class ExecutionSettings(Section):
    hang_timeout_seconds: float = Field(1800.0, gt=0, le=MAX_SECONDS)
    """A training process without a finished step for this long counts as hung: its stacks are dumped
    and it is ended."""
    metrics_port: int | None = Field(None, ge=1024, le=65000)
    """First port of the per-rank Prometheus endpoints (rank r serves on port + r); none if unset."""


class RunSettings(Section):
    epochs: int = Field(ge=1, le=100_000)
    """Upper bound on epochs; early stopping may end sooner."""
    seed: Seed = 0
    """Seed of model init, shuffling and dropout (0 to 2^32 - 1)."""
