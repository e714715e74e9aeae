"""Checkpoints: written by every rank, trusted only once committed, loaded without unpickling.

One module per responsibility, none of which imports torch at import time (the verification stage
and `ballast.storage` import this package in the orchestrator):

    commit    the layout, the commit protocol, the integrity check `verify` (marker and manifest),
              pruning and `uncommit` (a directory loses its marker before its files)
    fileio    the O_DIRECT writer that hashes while writing, `sha256_file`, the tensor-only loader
    sharding  the optimizer state in parts, one share per rank, merged at load (DDP)
    dcp       sharded checkpoints under FSDP (torch.distributed.checkpoint): each rank its own shards;
              `model_weights(path)`, a checkpoint's whole model for the orchestrator's stages
    saver     the background writer (`AsyncSaver`), at idle CPU priority where asked
    writer_process  the process a background save's bytes are written by (plans of shared-memory ranges)
    writer_child    that process's own side: writes the plans it is sent, ends with its trainer
    arena     the shared memory (memfd) the snapshot buffers live in, for the writer process
    average   the mean of the last checkpoints' weights, and the export CLI (`python -m ballast.training.average`)
    export    a checkpoint's model as published safetensors, one output shard at a time; `source`, the
              tensors of any saved model read by name
    streamed  a saved model run in one process that need not hold it (blocks read as they run)
    snapshot  CPU copies of the state into buffers reused from save to save
    gate      the validity predicate (`check`: may this checkpoint be resumed from or promoted),
              quarantine, the newest checkpoint that passes (`latest_passing`)
    manager   what a training checkpoint holds: the trainer's `save(reason)` and `load()`
              (imported from `training.checkpoint.manager` by the trainer; not re-exported here)

Callers use the package: `from ballast.training import checkpoint as ckpt; ckpt.verify(path)`; the gate
is `from ballast.training.checkpoint import gate` (it imports torch when it checks).
"""

from __future__ import annotations

from ballast.training.checkpoint.average import average
from ballast.training.checkpoint.commit import (
    COMMIT_MARKER,
    DCP_METADATA,
    LOCAL_FILES,
    MANIFEST,
    SHARD_SUFFIX,
    TRAINER_STATE,
    Writer,
    committed,
    held_files,
    is_committed,
    prune,
    read_trainer_state,
    recorded_model,
    step_dir_name,
    step_of_name,
    uncommit,
    verify,
)
from ballast.training.checkpoint.dcp import model_weights
from ballast.training.checkpoint.fileio import _FileWriter  # noqa: F401  (the tests spy on its writes)
from ballast.training.checkpoint.fileio import load_tensors, sha256_file, staging_buffer
from ballast.training.checkpoint.saver import AsyncSaver
from ballast.training.checkpoint.sharding import load_optimizer, optimizer_part, optimizer_shares
from ballast.training.failure import CheckpointFailure

__all__ = [
    "COMMIT_MARKER", "DCP_METADATA", "LOCAL_FILES", "MANIFEST", "SHARD_SUFFIX", "TRAINER_STATE", "AsyncSaver", "CheckpointFailure", "Writer", "average",
    "committed", "held_files", "is_committed", "load_optimizer", "load_tensors", "model_weights", "optimizer_part",
    "optimizer_shares", "prune", "read_trainer_state", "recorded_model", "sha256_file", "staging_buffer",
    "step_dir_name", "step_of_name", "uncommit", "verify",
]
