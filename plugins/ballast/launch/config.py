"""Launch specs as pure functions of the typed spec: the trainer's run config and the torchrun argv.

Nothing here starts a process or touches the disk; the train stage does that with what these return.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ballast.spec import Spec
from ballast.training.config.run import (BatchConfig, CheckpointConfig, DataConfig, DistributedConfig, ModelConfig,
                                         RehearsalConfig, RunConfig, RunIdentity)
from ballast.training.config.sections import (BatchSettings, DistributedSettings, EarlyStopSettings, ExecutionSettings,
                                              LoaderSettings, ModelSettings, NumericsSettings, OptimSettings,
                                              RecoverySettings, RehearsalSettings, ResourceSettings, RunSettings,
                                              S, Section)


def run_config(spec: Spec, *, data_dir: str, data_format: str, checkpoint_dir: str, output_dir: str,
               micro_batch_size: int | None = None, data_wait_seconds: float = 0.0,
               faults: tuple | None = None, epochs: int | None = None,
               init_weights: str | None = None, identity: RunIdentity | None = None) -> RunConfig:
    """The trainer's run config for one try: each of the spec's settings sections passed through whole
    (`Section.section`: the section as declared in `training.config.sections`, not fields matched by
    name), plus what this try decided (paths, the cache's format, an adapted micro-batch, the scaled
    learning rate, the rehearsal faults meant for this try: none unless given). A setting added to a
    section reaches the trainer with no change here."""
    t = spec.training
    micro = micro_batch_size or t.micro_batch_size
    feature = spec.dataset.features[0]
    return RunConfig(
        **_extend(RunSettings, t.section(RunSettings), epochs=epochs or t.epochs).model_dump(),
        output_dir=output_dir,
        model=_extend(ModelConfig, t.section(ModelSettings), input_shape=feature.shape or (1,),
                      num_classes=spec.dataset.num_classes),
        data=_extend(DataConfig, t.section(LoaderSettings), directory=data_dir, format=data_format,
                     feature=feature.name, label=spec.dataset.label, wait_seconds=data_wait_seconds),
        batch=_extend(BatchConfig, t.section(BatchSettings), micro_batch_size=micro,
                      grad_accum_steps=t.grad_accum_for(micro)),
        optim=_extend(OptimSettings, t.section(OptimSettings), learning_rate=t.effective_learning_rate),
        numerics=t.section(NumericsSettings),
        distributed=_extend(DistributedConfig, t.section(DistributedSettings)),
        resources=t.section(ResourceSettings),
        checkpoint=_extend(CheckpointConfig, t.checkpoint, directory=checkpoint_dir, init_weights=init_weights),
        monitors=t.monitors,
        early_stop=spec.evaluation.section(EarlyStopSettings),
        recovery=spec.recovery.section(RecoverySettings),
        execution=spec.execution.section(ExecutionSettings),
        rehearsal=_extend(RehearsalConfig, t.rehearsal.section(RehearsalSettings), faults=tuple(faults or ()),
                          env_faults=bool(faults)),
        identity=identity or RunIdentity(pipeline=spec.name),
    )


def _extend(cls: type[S], settings: Section, **decided: Any) -> S:
    """`cls` (the section itself, or a run-config section extending it with what a try decides) from the
    whole section `settings`, with `decided` set; validated again."""
    if type(settings) not in cls.__mro__:
        raise TypeError(f"{cls.__name__} does not extend {type(settings).__name__}")
    return cls.model_validate({**settings.model_dump(), **decided})


def torchrun_argv(spec: Spec, config_path: str | Path, *, python: str = sys.executable,
                  rdzv_endpoint: str | None = None, run_id: str = "ballast") -> list[str]:
    """torchrun for one node of the job, as an argument list (see training/torchrun.py)."""
    t = spec.training
    # training.launch is torchrun (same options and elastic agent) with workers forked from a process
    # that already imported torch: a restarted group is training again seconds sooner.
    argv = [python, "-m", "ballast.training.torchrun",
            f"--nnodes={t.nodes}", f"--nproc-per-node={t.processes_per_node}",
            f"--max-restarts={spec.recovery.max_restarts}", "--monitor-interval=0.1"]
    if t.nodes == 1 and rdzv_endpoint is None:
        argv.append("--standalone")  # a free local port; no rendezvous server to run
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint or 'localhost:29400'}",
                 f"--rdzv-id={run_id}"]
    argv += ["--module", "ballast.training", "--config", str(config_path)]
    return argv
