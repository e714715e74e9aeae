"""The spec's `training` and `evaluation` sections.

Built from the training package's own sections (`training.config.sections`): every field a training
process also reads is declared there once, with its default, bounds, docstring and checks. `training`
inherits several of them flat (their fields are its YAML keys); each reaches the run config whole, as
one section (`Section.section`, in `ballast.launch.config.run_config`). What is declared here is the
orchestrator's alone: how many machines and processes, which converted format to read, learning-rate
scaling.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ballast.training.config.rehearsal import RehearsalSettings
from ballast.training.config.sections import (BatchSettings, CheckpointSettings, DataFormat, DistributedSettings,
                                      EarlyStopSettings, LoaderSettings, ModelSettings, MonitorSettings,
                                      NumericsSettings, OptimSettings,
                                      ResourceSettings, RunSettings, Section)

_MAX_LEARNING_RATE = OptimSettings.model_fields["learning_rate"].metadata


class PlacementSpec(Section):
    """Where the processes run: the orchestrator's alone (the trainer reads its world from torchrun)."""

    nodes: int = Field(1, ge=1, le=4096)
    """Machines (pods, Slurm nodes) taking part: a fixed count (an Indexed Job's completions =
    parallelism; no elastic range), 1 on the local backend."""
    processes_per_node: int = Field(2, ge=1, le=64)
    """Training processes per machine (one per GPU on GPU machines)."""


class RehearsalSpec(RehearsalSettings):
    """Faults to rehearse a recovery with (game days), from the Airflow UI; off unless switched on."""

    enabled: bool = False
    """Inject the faults in this run. With faults declared, every DAG gets a trigger parameter
    `rehearsal` that switches them on for one run."""
    scheduled: bool = False
    """Also in scheduled runs (never, unless this says so)."""

    @model_validator(mode="after")
    def _faults_within_budget(self) -> RehearsalSpec:
        for i, f in enumerate(self.faults):
            if self.max_steps is not None and f.step is not None and f.step > self.max_steps:
                raise ValueError(f"faults[{i}].step: {f.step} is past the end of training (max_steps"
                                 f" {self.max_steps}); the fault would never fire")
        return self


# pydantic lists inherited fields base by base, last base first: the order here keeps the model, the
# placement and the batch first in the JSON Schema and in "allowed here" messages, as they always were.
class TrainingSpec(ResourceSettings, LoaderSettings, DistributedSettings, NumericsSettings, OptimSettings,
                   RunSettings, BatchSettings, PlacementSpec, ModelSettings):
    data_format: DataFormat | None = None
    """Which converted format training reads; default the first of conversion.formats."""
    rounds: int = Field(1, ge=1, le=100)
    """Train in this many rounds of epochs / rounds epochs each, one train -> verify -> evaluate group of
    tasks per round; when early stopping ends training, the later rounds are skipped (1: one train task)."""
    lr_reference_batch_size: int | None = Field(None, ge=1, le=16_777_216)
    """If set, the learning rate is scaled linearly by global_batch_size / this (seed documents: 32 per
    device as the reference)."""
    checkpoint: CheckpointSettings = CheckpointSettings()
    """When checkpoints are written and how many are kept."""
    monitors: MonitorSettings = MonitorSettings()
    """Loss-spike detection and gradient statistics."""
    rehearsal: RehearsalSpec = RehearsalSpec()
    """Faults to inject and step/time budgets, for rehearsing recovery; empty in production."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def per_process_batch(self) -> int:
        """Samples each process contributes to an optimizer step (global batch / world size)."""
        return self.global_batch_size // self.world_size

    def grad_accum_for(self, micro_batch_size: int) -> int:
        """Micro-batches per optimizer step that keep the global batch at `micro_batch_size`."""
        return self.per_process_batch // micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.grad_accum_for(self.micro_batch_size)

    @property
    def effective_learning_rate(self) -> float:
        if self.lr_reference_batch_size is None:
            return self.learning_rate
        return self.learning_rate * self.global_batch_size / self.lr_reference_batch_size

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
    def epochs_per_round(self) -> int:
        return self.epochs // self.rounds

    @model_validator(mode="after")
    def _check_rounds(self) -> TrainingSpec:
        if self.epochs % self.rounds:
            divisors = [str(d) for d in range(1, min(self.epochs, 100) + 1) if self.epochs % d == 0]
            raise ValueError(f"rounds: {self.rounds} does not divide epochs {self.epochs}; every round trains the"
                             f" same number of epochs: use one of {', '.join(divisors)} or change epochs")
        return self

    @model_validator(mode="after")
    def _check_scaled_learning_rate(self) -> TrainingSpec:
        # The trainer is handed the scaled rate, under the same bound as the one written here.
        limit = next(m.le for m in _MAX_LEARNING_RATE if getattr(m, "le", None) is not None)
        if self.effective_learning_rate > limit:
            raise ValueError(f"lr_reference_batch_size: the scaled learning rate {self.effective_learning_rate:g}"
                             f" (learning_rate x {self.global_batch_size} / {self.lr_reference_batch_size})"
                             f" exceeds {limit}; lower learning_rate or raise lr_reference_batch_size")
        return self


class EvaluationSpec(EarlyStopSettings):
    threshold: float | None = None
    """Publish only if the test metric is at least (max) / at most (min) this value."""
    warm_start: bool = False
    """Start training from the pipeline's last published model (its weights; a fresh optimizer) instead
    of a random initialisation, when there is one and no checkpoint to resume."""
    publish: Literal["always", "if_better"] = "always"
    """if_better: publish only when the new model beats the last published one on this run's test split
    (scored side by side in the evaluate task); otherwise say so and keep the old one."""
    publish_shard_bytes: int = Field(5_000_000_000, ge=1)
    """The largest safetensors file publish writes (transformers' default, 5 GB): a larger model is
    published as shards `model-0000k-of-0000N.safetensors` with `model.safetensors.index.json`, read
    from the checkpoint and written one shard at a time; a tensor larger than this gets a file alone."""
    batch_size: int = Field(256, ge=1, le=65_536)
    """Test rows read from the cache and scored per forward pass in the evaluate task: the test split
    streams in batches of this many rows (memory grows with it, not with the split) and the metrics add
    up exactly over the batches."""
