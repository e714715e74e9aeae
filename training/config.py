"""The run config: what the orchestrator hands a training process (a JSON file).

Plain dataclass so that the training image needs neither Airflow nor Ballast's spec model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from training.failure import ConfigFailure
from training.models import MODEL_NAMES


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    # model
    model: str
    hidden_size: int = 128
    dropout: float = 0.1
    input_shape: list[int]
    num_classes: int
    feature: str
    label: str
    # data: a cache directory holding manifest.json and the shards it lists
    data_dir: str
    data_format: str = "petastorm"
    loader_workers: int = 2          # DataLoader worker processes per training process (0: in-process)
    loader_prefetch: int = 2         # spans each worker decodes ahead
    data_wait_seconds: float = 0.0   # how long to wait for a shard a staged cache warm-up is still bringing
    # batch and optimisation
    micro_batch_size: int
    grad_accum_steps: int = 1
    optimizer: str = "adamw"
    learning_rate: float
    weight_decay: float = 0.01
    grad_clip_norm: float = 1.0
    precision: str = "fp32"
    epochs: int
    seed: int = 0
    # evaluation and early stopping (on the validation split)
    metric: str = "accuracy"
    mode: str = "max"
    patience: int = 3
    min_delta: float = 0.0
    # checkpoints and outputs
    checkpoint_dir: str
    output_dir: str
    checkpoint_every_steps: int | None = None
    checkpoint_every_seconds: float = 3600.0
    keep_last: int = 3
    max_steps: int | None = None
    max_seconds: float | None = None
    checkpoint_async: bool = True
    checkpoint_writer_priority: str = "idle"
    resume_average_last: int = 0
    # distributed
    backend: str = "auto"
    dist_timeout_seconds: float = 600.0
    parallelism: str = "ddp"
    gradient_compression: str = "none"
    # numerics
    loss_scale_init: float = 8192.0
    loss_scale_growth_interval: int = 100
    lr_plateau_patience: int = 5
    lr_plateau_factor: float = 0.5
    # stability monitors
    spike_zscore: float = 3.0
    spike_window: int = 50
    spike_action: str = "alert"
    stats_every_steps: int = 50
    anomaly_checkpoint_min_steps: int = 100
    hang_timeout_seconds: float = 1800.0
    preempt_grace_seconds: float = 60.0
    # resources and metrics
    gpu_memory_fraction: float = 0.9
    cpu_reserve_fraction: float = 0.2
    reuse_freed_memory: bool = True  # training.hostmem
    metrics_port: int | None = None
    faults: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.model not in MODEL_NAMES:
            raise ConfigFailure(f"model: unknown model {self.model!r}; known: {', '.join(MODEL_NAMES)}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigFailure(f"optimizer: unknown optimizer {self.optimizer!r}; known: adamw, sgd")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ConfigFailure(f"precision: must be fp32, bf16 or fp16 (got {self.precision!r})")
        choices = {"parallelism": ("ddp", "fsdp"), "gradient_compression": ("none", "fp16", "bf16"),
                   "spike_action": ("alert", "rollback"), "data_format": ("petastorm", "tfrecord"),
                   "checkpoint_writer_priority": ("idle", "normal")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigFailure(f"{name}: must be one of {', '.join(allowed)} (got {getattr(self, name)!r})")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigFailure(f"gpu_memory_fraction: must be in (0, 1] (got {self.gpu_memory_fraction})")
        if self.anomaly_checkpoint_min_steps < 0:
            raise ConfigFailure(f"anomaly_checkpoint_min_steps: must be >= 0 (got {self.anomaly_checkpoint_min_steps})")
        for name in ("micro_batch_size", "grad_accum_steps", "epochs", "keep_last", "patience", "spike_window",
                     "stats_every_steps", "lr_plateau_patience", "loss_scale_growth_interval"):
            if getattr(self, name) < 1:
                raise ConfigFailure(f"{name}: must be >= 1 (got {getattr(self, name)})")

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigFailure(f"{path}: cannot read run config ({exc})") from exc
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigFailure(f"{path}: unknown run config key(s): {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigFailure(f"{path}: {exc}") from exc

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True))
