"""The run config: what the orchestrator hands a training process, as one typed, frozen model.

Written by the train stage (`ballast.launch_spec.run_config`) as JSON; read here with one validation
call. Its sections are the ones in `training.config.sections`, shared with the spec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import ValidationError

from training.config.messages import describe, one_line
from training.config.sections import (BatchConfig, CheckpointConfig, DataConfig, DistributedConfig,
                                      EarlyStopSettings, ExecutionSettings, ModelConfig, MonitorSettings,
                                      NumericsSettings, OptimSettings, RecoverySettings, RehearsalSettings,
                                      ResourceSettings, RunSettings)
from training.failure import ConfigFailure

RUN_CONFIG_VERSION = 1


class RunConfig(RunSettings):
    """Everything one training process needs, by section."""

    version: Literal[1] = RUN_CONFIG_VERSION
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
    """The validation metric and early stopping."""
    recovery: RecoverySettings = RecoverySettings()
    """What the process does on a preemption notice."""
    execution: ExecutionSettings = ExecutionSettings()
    """Hang watchdog and metrics endpoint."""
    rehearsal: RehearsalSettings = RehearsalSettings()
    """Injected faults and step/time budgets."""

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
