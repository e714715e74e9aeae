"""Launch specs as pure functions of the typed model: the trainer's run config and the torchrun argv.

Nothing here starts a process or touches the disk; the train stage does that with what these return.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from ballast.spec import Spec


def adapt_micro_batch(spec: Spec, current: int, factor: float) -> int:
    """A smaller micro-batch after an out-of-memory failure that still divides the per-process batch,
    so the global batch stays fixed (gradient accumulation makes up the difference)."""
    per_process = spec.training.global_batch_size // spec.training.world_size
    target = max(1, math.floor(current * factor))
    return max(d for d in range(1, target + 1) if per_process % d == 0)


def run_config(spec: Spec, *, data_dir: str, data_format: str, checkpoint_dir: str, output_dir: str,
               micro_batch_size: int | None = None, data_wait_seconds: float = 0.0) -> dict[str, Any]:
    """The JSON the trainer reads (training.config.RunConfig)."""
    t = spec.training
    micro = micro_batch_size or t.micro_batch_size
    per_process = t.global_batch_size // t.world_size
    feature = spec.dataset.features[0]
    return {
        "model": t.model, "hidden_size": t.hidden_size, "dropout": t.dropout,
        "input_shape": list(feature.shape) or [1], "num_classes": spec.dataset.num_classes,
        "feature": feature.name, "label": spec.dataset.label,
        "data_dir": data_dir, "data_format": data_format,
        # Each process drives one device (a GPU, or the CPU): the 2-3x rule gives two loader workers per process.
        "loader_workers": t.loader_workers if t.loader_workers is not None else 2,
        "loader_prefetch": t.loader_prefetch, "data_wait_seconds": data_wait_seconds,
        "micro_batch_size": micro, "grad_accum_steps": per_process // micro,
        "optimizer": t.optimizer, "learning_rate": t.effective_learning_rate, "weight_decay": t.weight_decay,
        "grad_clip_norm": t.grad_clip_norm, "precision": t.precision, "epochs": t.epochs, "seed": t.seed,
        "metric": spec.evaluation.metric, "mode": spec.evaluation.mode, "patience": spec.evaluation.patience,
        "min_delta": spec.evaluation.min_delta,
        "checkpoint_dir": checkpoint_dir, "output_dir": output_dir,
        "checkpoint_every_steps": t.checkpoint.every_steps, "checkpoint_every_seconds": t.checkpoint.every_seconds,
        "keep_last": t.checkpoint.keep_last, "checkpoint_async": t.checkpoint.asynchronous,
        "checkpoint_writer_priority": t.checkpoint.writer_priority,
        "resume_average_last": t.checkpoint.resume_average_last,
        "parallelism": t.parallelism, "gradient_compression": t.gradient_compression,
        "loss_scale_init": t.loss_scale.initial, "loss_scale_growth_interval": t.loss_scale.growth_interval,
        "lr_plateau_patience": t.lr_plateau.patience, "lr_plateau_factor": t.lr_plateau.factor,
        "spike_zscore": t.monitors.spike_zscore, "spike_window": t.monitors.spike_window,
        "spike_action": t.monitors.spike_action, "stats_every_steps": t.monitors.stats_every_steps,
        "anomaly_checkpoint_min_steps": t.monitors.anomaly_checkpoint_min_steps,
        "hang_timeout_seconds": spec.execution.hang_timeout_seconds,
        "preempt_grace_seconds": spec.recovery.preempt_grace_seconds,
        "gpu_memory_fraction": t.gpu_memory_fraction, "cpu_reserve_fraction": t.cpu_reserve_fraction,
        "reuse_freed_memory": t.reuse_freed_memory,
        "metrics_port": spec.execution.metrics_port,
    }


def torchrun_argv(spec: Spec, config_path: str | Path, *, python: str = sys.executable,
                  rdzv_endpoint: str | None = None, run_id: str = "ballast") -> list[str]:
    """torchrun for one node of the job, as an argument list (see training/launch.py)."""
    t = spec.training
    # training.launch is torchrun (same options and elastic agent) with workers forked from a process
    # that already imported torch: a restarted group is training again seconds sooner.
    argv = [python, "-m", "training.launch",
            f"--nnodes={t.nodes}", f"--nproc-per-node={t.processes_per_node}",
            f"--max-restarts={spec.recovery.max_restarts}", "--monitor-interval=0.5"]
    if t.nodes == 1 and rdzv_endpoint is None:
        argv.append("--standalone")  # a free local port; no rendezvous server to run
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint or 'localhost:29400'}",
                 f"--rdzv-id={run_id}"]
    argv += ["--module", "training", "--config", str(config_path)]
    return argv
