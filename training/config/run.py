"""The run config: what the orchestrator hands a training process, as one typed, frozen model.

Written by the train stage (`ballast.launch.config.run_config`) as JSON; read here with one validation
call. Its sections are the ones in `training.config.sections`, shared with the spec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import Field, ValidationError, field_validator, model_validator

from ballast.training.config.messages import describe, one_line

from ballast.training.config.rehearsal import RehearsalSettings
from ballast.training.config.sections import (BatchSettings, CheckpointSettings, DataFormat, DistributedSettings,
                                      EarlyStopSettings, ExecutionSettings, LoaderSettings, MAX_SECONDS,
                                      ModelName, MonitorSettings, NumericsSettings, OptimSettings,
                                      RecoverySettings, ResourceSettings, RunSettings,
                                      Section, _bounded_shape, resolve_early_stop)
from ballast.training.failure import ConfigFailure

RUN_CONFIG_VERSION = 2
"""2: the model section is {name, options, data} (models from entry points, tasks); data lists features."""

# --- the run config's own sections: a spec's settings plus what the orchestrator decided for this try --


class ModelConfig(Section):
    """The model to build and what it is built for; checkpoints record this section, and the stages
    rebuild the model from it (`ballast.training.models.build_configured_model`)."""

    name: ModelName
    """The `ballast.models` entry point."""
    options: dict[str, Any] = {}
    """The factory's options (the spec's training.model.options; mlp, cnn and embed with hidden_size and
    dropout filled in from the flat settings)."""
    data: dict[str, Any]
    """What the task feeds the model (the factory's `data`): `task`, `input_shape` (causal_lm: [seq_len]),
    `input_dtype`, `inputs` ({field: {shape, dtype}} for every feature), and where they apply
    `num_classes`, `vocab_size`, `seq_len`, `target_shape`."""

    @field_validator("data")
    @classmethod
    def _check_data(cls, v: dict[str, Any]) -> dict[str, Any]:
        from ballast.training.tasks import TASKS

        if v.get("task") not in TASKS:
            raise ValueError(f"task: must be one of {', '.join(TASKS)} (got {v.get('task')!r})")
        for key in ("input_shape", "target_shape"):
            shape = v.get(key)
            if shape is None and key == "target_shape":
                continue
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 1 for d in shape):
                raise ValueError(f"{key}: must be a list of positive integers (got {shape!r})")
            try:
                _bounded_shape(tuple(shape))
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
        if not isinstance(v.get("inputs"), dict) or not v["inputs"]:
            raise ValueError("inputs: must map every feature field to its shape and dtype")
        return v

    @property
    def task(self) -> str:
        return self.data["task"]


class BatchConfig(BatchSettings):
    grad_accum_steps: int = Field(1, ge=1)
    """Micro-batches accumulated per optimizer step on each process:
    global_batch_size / (micro_batch_size x world size)."""

    @property
    def per_process(self) -> int:
        """Samples one process contributes to an optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps


class DistributedConfig(DistributedSettings):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto: NCCL where CUDA is available, gloo otherwise."""
    timeout_seconds: float = Field(600.0, gt=0, le=MAX_SECONDS)
    """Timeout of the process group's collectives."""


class DataConfig(LoaderSettings):
    directory: str = Field(min_length=1)
    """Cache directory holding the dataset's manifest.json and the shards it lists."""
    format: DataFormat
    """Which packed format to read."""
    features: list[str] = Field(min_length=1)
    """The feature columns the model reads (causal_lm: the packed `tokens` column)."""
    label: str | None = None
    """The label column; None when the targets come from the features (causal_lm)."""
    wait_seconds: float = Field(0.0, ge=0.0, le=MAX_SECONDS)
    """How long to wait for a shard that a staged cache warm-up is still bringing."""


class CheckpointConfig(CheckpointSettings):
    directory: str = Field(min_length=1)
    """Where this run's checkpoints are committed (shared by every try)."""
    node_local: bool = False
    """`directory` is this node's own (a cluster node on object storage): each node commits its own ranks'
    files there, with the whole manifest (training.checkpoint.commit); the node pushes them to storage."""
    fetch: list[str] | None = None
    """With `node_local`: the command (an argument list; the checkpoint directory and file names are
    appended) that copies files of a checkpoint committed in storage into this node's directory, each
    checked against the manifest's sha256 (`python -m ballast.node --job REF --fetch`): a resume reads
    from storage only the shard files this node's ranks read."""
    init_weights: str | None = None
    """A tensor file of model weights to start from when there is no checkpoint to resume (a warm
    start from a published model); loaded without unpickling."""


class RehearsalConfig(RehearsalSettings):
    env_faults: bool = False
    """Also inject the faults listed in the environment variable BALLAST_FAULTS. The orchestrator sets it
    only for a try that injects the spec's rehearsal faults (rehearsal switched on for the run; a scheduled
    run only with training.rehearsal.scheduled): a node's environment alone never starts a fault."""


# --- the run config --------------------------------------------------------------------------------


class RunIdentity(Section):
    """Which pipeline, run and try this process trains for: labels on its metrics."""

    pipeline: str = ""
    """The spec's name."""
    run: str = ""
    """The Airflow DAG run id."""
    try_number: int = Field(1, ge=1)
    """The train task's try."""
    failures_before: dict[str, int] = {}
    """Failed tries of this task before this one, by failure class."""


class RunConfig(RunSettings):
    """Everything one training process needs, by section."""

    version: Literal[2] = RUN_CONFIG_VERSION
    """Format version of this file."""
    output_dir: str
    """Where the process writes its metrics, heartbeat, summary and failure record."""
    model: ModelConfig
    """Architecture and shapes."""
    data: DataConfig
    """The cached dataset and how it is loaded."""
    batch: BatchConfig
    """Micro-batch, global batch and gradient accumulation."""
    optim: OptimSettings
    """Optimizer, learning rate (already scaled for the batch) and its schedule."""
    numerics: NumericsSettings = NumericsSettings()
    """Precision and loss scaling."""
    distributed: DistributedConfig = DistributedConfig()
    """Parallelism and the process group."""
    resources: ResourceSettings = ResourceSettings()
    """CPU, GPU and host-memory guards."""
    checkpoint: CheckpointConfig
    """When and where checkpoints are committed."""
    monitors: MonitorSettings = MonitorSettings()
    """Loss-spike detection and gradient statistics."""
    early_stop: EarlyStopSettings = EarlyStopSettings()
    """The validation metric (resolved: never empty) and early stopping."""
    recovery: RecoverySettings = RecoverySettings()
    """What the process does on a preemption notice."""
    execution: ExecutionSettings = ExecutionSettings()
    """Hang watchdog and metrics endpoint."""
    rehearsal: RehearsalConfig = RehearsalConfig()
    """Injected faults and step/time budgets."""
    identity: RunIdentity = RunIdentity()
    """The pipeline, run and try (metric labels)."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_metric(cls, data: Any) -> Any:
        """early_stop.metric and .mode default to the task's metric and its direction."""
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            model = data["model"]
            task = (model.get("data") or {}).get("task") if isinstance(model.get("data"), dict) else None
            raw = data.get("early_stop")
            if isinstance(raw, EarlyStopSettings):
                raw = raw.model_dump()
            data = {**data, "early_stop": resolve_early_stop(raw, task)}
        return data

    @model_validator(mode="after")
    def _metric_of_the_task(self) -> RunConfig:
        from ballast.training.tasks import metric_of

        try:
            metric_of(self.model.task, self.early_stop.metric)
        except ValueError as exc:
            raise ValueError(f"early_stop.metric: {exc}") from None
        return self

    @classmethod
    def parse(cls, data: Any, *, source: str = "run config") -> RunConfig:
        """Validate a decoded run config; every problem is one line in a ConfigFailure."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            lines = [f"{source}: {one_line(*describe(err, cls))}" for err in exc.errors()]
            raise ConfigFailure("; ".join(lines)) from None

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigFailure(f"{path}: cannot read run config ({exc})") from exc
        return cls.parse(data, source=str(path))

    def dump(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        tmp.replace(path)

    def updated(self, changes: Mapping[str, Any]) -> RunConfig:
        """A copy with `{"section.field": value}` changes applied and validated again."""
        data = self.model_dump(mode="json")
        for path, value in changes.items():
            *head, last = path.split(".")
            node = data
            for part in head:
                if not isinstance(node.get(part), dict):
                    raise ConfigFailure(f"run config: {path!r}: {part!r} is not a section")
                node = node[part]
            if last not in node:
                raise ConfigFailure(f"run config: {path!r} is not a run config field")
            node[last] = value
        return type(self).parse(data)
