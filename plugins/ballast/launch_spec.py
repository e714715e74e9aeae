"""Launch specs as pure functions of the typed spec: the trainer's run config and the torchrun argv.

Nothing here starts a process or touches the disk; the train stage does that with what these return.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from ballast.spec import Spec
from ballast.training.config.run import (BatchConfig, CheckpointConfig, DataConfig, DistributedConfig, ModelConfig,
                                 RehearsalConfig, RunConfig, RunIdentity)
from ballast.training.config.sections import (EarlyStopSettings, ExecutionSettings, NumericsSettings, OptimSettings,
                                      RecoverySettings, ResourceSettings)

S = TypeVar("S", bound=BaseModel)


def adapt_micro_batch(spec: Spec, current: int, factor: float) -> int:
    """A smaller micro-batch after an out-of-memory failure that still divides the per-process batch,
    so the global batch stays fixed (gradient accumulation makes up the difference)."""
    per_process = spec.training.per_process_batch
    target = max(1, math.floor(current * factor))
    return max(d for d in range(1, target + 1) if per_process % d == 0)


def run_config(spec: Spec, *, data_dir: str, data_format: str, checkpoint_dir: str, output_dir: str,
               micro_batch_size: int | None = None, data_wait_seconds: float = 0.0,
               faults: tuple | None = None, epochs: int | None = None,
               init_weights: str | None = None, identity: RunIdentity | None = None) -> RunConfig:
    """The trainer's run config for one try: the spec's sections passed through whole, plus what this
    try decided (paths, the cache's format, an adapted micro-batch, the rehearsal faults meant for this
    try: none unless given). A setting added to a section of
    `training.config.sections` reaches the trainer with no change here."""
    t = spec.training
    micro = micro_batch_size or t.micro_batch_size
    feature = spec.dataset.features[0]
    return RunConfig(
        epochs=epochs or t.epochs, seed=t.seed, output_dir=output_dir,
        model=_section(ModelConfig, t, input_shape=feature.shape or (1,), num_classes=spec.dataset.num_classes),
        data=_section(DataConfig, t, directory=data_dir, format=data_format, feature=feature.name,
                      label=spec.dataset.label, wait_seconds=data_wait_seconds),
        batch=_section(BatchConfig, t, micro_batch_size=micro,
                       grad_accum_steps=t.grad_accum_for(micro)),
        optim=_section(OptimSettings, t, learning_rate=t.effective_learning_rate),
        numerics=_section(NumericsSettings, t),
        distributed=_section(DistributedConfig, t),
        resources=_section(ResourceSettings, t),
        checkpoint=_section(CheckpointConfig, t.checkpoint, directory=checkpoint_dir, init_weights=init_weights),
        monitors=t.monitors,
        early_stop=_section(EarlyStopSettings, spec.evaluation),
        recovery=_section(RecoverySettings, spec.recovery),
        execution=_section(ExecutionSettings, spec.execution),
        rehearsal=_section(RehearsalConfig, t.rehearsal, faults=tuple(faults or ()), env_faults=bool(faults)),
        identity=identity or RunIdentity(pipeline=spec.name),
    )


def _section(cls: type[S], source: BaseModel, **extra: Any) -> S:
    """An exact `cls` from the fields `source` (a spec section built from it) shares with it, plus `extra`."""
    shared = (cls.model_fields.keys() & type(source).model_fields.keys()) - extra.keys()
    return cls.model_validate({**source.model_dump(include=shared), **extra})


def torchrun_argv(spec: Spec, config_path: str | Path, *, python: str = sys.executable,
                  rdzv_endpoint: str | None = None, run_id: str = "ballast") -> list[str]:
    """torchrun for one node of the job, as an argument list (see training/launch.py)."""
    t = spec.training
    # training.launch is torchrun (same options and elastic agent) with workers forked from a process
    # that already imported torch: a restarted group is training again seconds sooner.
    argv = [python, "-m", "ballast.training.launch",
            f"--nnodes={t.nodes}", f"--nproc-per-node={t.processes_per_node}",
            f"--max-restarts={spec.recovery.max_restarts}", "--monitor-interval=0.1"]
    if t.nodes == 1 and rdzv_endpoint is None:
        argv.append("--standalone")  # a free local port; no rendezvous server to run
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint or 'localhost:29400'}",
                 f"--rdzv-id={run_id}"]
    argv += ["--module", "ballast.training", "--config", str(config_path)]
    return argv
