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
from ballast.training.config.rehearsal import RehearsalSettings
from ballast.training.config.sections import (BatchSettings, DistributedSettings, EarlyStopSettings, ExecutionSettings,
                                              LoaderSettings, NumericsSettings, OptimSettings, RecoverySettings,
                                              ResourceSettings, RunSettings, S, Section)

TOKENS = "tokens"
"""The packed dataset's column of token sequences (causal_lm), CONTRACT 4."""


def run_config(spec: Spec, *, data_dir: str, data_format: str, checkpoint_dir: str, output_dir: str,
               micro_batch_size: int | None = None, data_wait_seconds: float = 0.0,
               faults: tuple | None = None, epochs: int | None = None,
               init_weights: str | None = None, identity: RunIdentity | None = None,
               manifest: dict[str, Any] | None = None) -> RunConfig:
    """The trainer's run config for one try: each of the spec's settings sections passed through whole
    (`Section.section`: the section as declared in `training.config.sections`, not fields matched by
    name), plus what this try decided (paths, the cache's format, an adapted micro-batch, the scaled
    learning rate, the rehearsal faults meant for this try: none unless given). A setting added to a
    section reaches the trainer with no change here. `manifest`: the packed dataset's manifest, where a
    model needs what conversion found (causal_lm: the tokenizer's vocab_size)."""
    t = spec.training
    micro = micro_batch_size or t.micro_batch_size
    return RunConfig(
        **_extend(RunSettings, t.section(RunSettings), epochs=epochs or t.epochs).model_dump(),
        output_dir=output_dir,
        model=ModelConfig(name=t.model.name, options=t.model_options, data=model_data(spec, manifest)),
        data=_extend(DataConfig, t.section(LoaderSettings), directory=data_dir, format=data_format,
                     features=feature_columns(spec), label=spec.dataset.label if t.task != "causal_lm" else None,
                     wait_seconds=data_wait_seconds),
        batch=_extend(BatchConfig, t.section(BatchSettings), micro_batch_size=micro,
                      grad_accum_steps=t.grad_accum_for(micro)),
        optim=_extend(OptimSettings, t.section(OptimSettings), learning_rate=t.effective_learning_rate),
        numerics=t.section(NumericsSettings),
        distributed=_extend(DistributedConfig, t.section(DistributedSettings)),
        resources=t.section(ResourceSettings),
        checkpoint=_extend(CheckpointConfig, t.checkpoint, directory=checkpoint_dir, init_weights=init_weights),
        monitors=t.monitors,
        early_stop=spec.evaluation.section(EarlyStopSettings),  # metric and mode resolved by the spec
        recovery=spec.recovery.section(RecoverySettings),
        execution=spec.execution.section(ExecutionSettings),
        rehearsal=_extend(RehearsalConfig, t.rehearsal.section(RehearsalSettings), faults=tuple(faults or ()),
                          env_faults=bool(faults)),
        identity=identity or RunIdentity(pipeline=spec.name),
    )


def feature_columns(spec: Spec) -> list[str]:
    """The packed columns the model reads: the feature fields, or causal_lm's token sequences."""
    if spec.training.task == "causal_lm":
        return [TOKENS]
    return [f.name for f in spec.dataset.features]


def model_data(spec: Spec, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model factory's `data` (CONTRACT 3): the task, the inputs' shapes and dtypes, and where they
    apply num_classes, vocab_size (from the manifest's tokenizer), seq_len and target_shape."""
    t, ds = spec.training, spec.dataset
    if t.task == "causal_lm":
        data: dict[str, Any] = {"task": t.task, "input_shape": [t.seq_len], "input_dtype": "int64",
                                "seq_len": t.seq_len, "inputs": {TOKENS: {"shape": [t.seq_len], "dtype": "int64"}}}
        vocab = ((manifest or {}).get("tokenizer") or {}).get("vocab_size")
        if vocab:
            data["vocab_size"] = int(vocab)
        return data
    first = ds.features[0]
    data = {"task": t.task, "input_shape": list(first.shape) or [1], "input_dtype": first.type,
            "inputs": {f.name: {"shape": list(f.shape), "dtype": f.type} for f in ds.features}}
    if t.task in ("classification", "segmentation"):
        data["num_classes"] = ds.num_classes
    if t.task in ("segmentation", "regression") and ds.label_field is not None:
        data["target_shape"] = list(ds.label_field.shape)
    return data


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
