"""The rehearsal section of a run's settings: the faults a run injects on purpose (game days, tests) and
the budgets that end it early. Built like every section (`training.config.sections.Section`); the
spec's `training.rehearsal` and the run config's `rehearsal` extend these classes.

pydantic only: no torch, no Airflow. The spec imports this module at DAG-parse time.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ballast.training.config.sections import MAX_SECONDS, MAX_STEPS, Section

FaultKind = Literal["crash", "oom", "nan", "spike", "hang", "sigterm", "error", "comm", "corrupt", "ecc"]


class FaultSettings(Section):
    kind: FaultKind
    """What happens: crash (SIGKILL), oom, nan (non-finite loss), spike (loss x1000), hang, sigterm
    (a preemption notice), error (a bug), comm (a communication error), corrupt (the newest committed
    checkpoint's weights damaged on disk, then a crash: silent corruption the next try must catch), ecc
    (a GPU's uncorrectable ECC error, as CUDA reports it: a hardware failure)."""
    step: int | None = Field(None, ge=1, le=MAX_STEPS)
    """Optimizer step (1-based) before whose forward pass the fault fires; once per run."""
    seconds: float | None = Field(None, gt=0, le=MAX_SECONDS)
    """Or: fire before the first step once the training process has run this long (once per run)."""
    rank: int | None = Field(None, ge=0, le=1_048_576)
    """Only on this rank; every rank if unset."""
    on_try: int | None = Field(None, ge=1, le=10_000)
    """Only in this try of the train task (the orchestrator passes a try the faults meant for it);
    any try if unset."""

    @model_validator(mode="after")
    def _one_trigger(self) -> FaultSettings:
        if (self.step is None) == (self.seconds is None):
            raise ValueError("step: give a fault either a step or seconds (when it fires), not both or neither")
        return self


class RehearsalSettings(Section):
    faults: tuple[FaultSettings, ...] = ()
    """Faults to inject, for rehearsing recovery (game days) and for tests. The environment variable
    BALLAST_FAULTS (a JSON list of the same objects) adds to them, in a try that injects these."""
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    """End training (with a checkpoint) after this many optimizer steps."""
    max_seconds: float | None = Field(None, gt=0, le=MAX_SECONDS)
    """End training (with a checkpoint) once this much wall time has passed in the process."""
