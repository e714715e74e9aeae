"""Why a training process died: failure classes, their exit codes, and the failure record.

The contract with the orchestrator: on failure, the first rank to fail writes `failure.json` in the
run's output directory (later ranks write `failure-rank<R>.json`: they mostly fail because of it) and the process exits with the class's code. torchrun itself exits 1 whenever a
worker fails, so the orchestrator reads the record, not torchrun's exit status.

| class         | exit | retry helps? | examples                                       |
|---------------|------|--------------|------------------------------------------------|
| config        | 64   | no           | unknown model, bad run config                  |
| data          | 65   | no           | missing shard, wrong column, bad label         |
| user_code     | 70   | no           | a bug: TypeError, shape mismatch               |
| divergence    | 71   | yes (resume) | NaN/Inf loss                                   |
| communication | 72   | yes          | gloo/NCCL errors, rendezvous failures          |
| oom           | 73   | yes, smaller | torch.OutOfMemoryError, MemoryError            |
| hardware      | 74   | yes          | uncorrectable ECC error, GPU off the bus       |
| preempted     | 75   | yes          | SIGTERM (spot reclaim, node drain)             |
| hang          | 76   | yes          | no progress for the hang timeout               |
| lost          | -    | yes          | a rank SIGKILLed from outside, a node gone     |
| unknown       | -    | once         | no record and nothing known in the log         |

The third column is the spec's default `recovery.policy` (the retry policy decides; the record only
names the class). `lost` and `unknown` have no exit code: no trainer exits with them; they are what
the orchestrator concludes: `lost` when a rank or the try's process ended without a record and
nothing (the platform, the kernel's OOM kill) says why, `unknown` when nothing else matches (`training.failure_patterns.classify_exit`, the one
place that decides a try's class), and retries. Both sides read exception texts and log lines through one
pattern table, `training.failure_patterns`; the classes and codes themselves are `training.failure_classes`.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path

from ballast.training.failure_classes import EXIT_CODES, FAILURE_CLASSES  # noqa: F401 (re-exported)

# training.outputs.FAILURE_RECORD. The pattern table and the outputs' models are imported where used:
# ballast.errors imports this module at DAG-parse time, and they cost ~30 ms to import.
RECORD_NAME = "failure.json"


class TrainingFailure(Exception):
    """An error with a known failure class."""

    failure_class = "user_code"

    def __init__(self, message: str, *, failure_class: str | None = None):
        super().__init__(message)
        if failure_class:
            self.failure_class = failure_class


# Named "...Failure", not "...Error": the orchestrator's exception family (ballast.errors) has its own
# DataError and CheckpointError, and a stage that meets one of these translates it by failure_class.


class ConfigFailure(TrainingFailure):
    """The run config cannot be trained as written (unknown model, inconsistent settings)."""

    failure_class = "config"


class DataFailure(TrainingFailure):
    """The data on disk is missing or does not match its manifest; retrying reads the same bytes."""

    failure_class = "data"


class CheckpointFailure(TrainingFailure):
    """A checkpoint is uncommitted, damaged, or does not fit this run: class "data", a retry reads the same files."""

    failure_class = "data"


class DivergenceFailure(TrainingFailure):
    """The loss or the gradients went non-finite; a resume from the last good checkpoint may get past it."""

    failure_class = "divergence"


class HardwareFailure(TrainingFailure):
    """The GPU or the node failed (ECC error, GPU lost from the bus); a retry on sound hardware may pass."""

    failure_class = "hardware"


class Preempted(TrainingFailure):
    failure_class = "preempted"


def classify(exc: BaseException) -> str:
    """The failure class of an exception: its own class if it has one, oom for memory errors by type,
    else what its text matches in the pattern table, else user_code."""
    if isinstance(exc, TrainingFailure):
        return exc.failure_class
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return "oom"
    from ballast.training.failure_patterns import classify_text

    match = classify_text(f"{type(exc).__name__}: {exc}")
    return match.failure_class if match else "user_code"


def host_name() -> str:
    """The node this process runs on, as its scheduler names it: BALLAST_HOST (set by `ballast.node`
    from the Slurm node or Kubernetes node name), else the host name."""
    return os.environ.get("BALLAST_HOST") or socket.gethostname()


def write_record(out_dir: Path, exc: BaseException, *, step: int | None, rank: int) -> dict:
    """Write this rank's failure record (`training.outputs.FailureRecord`, through `write_failure`:
    failure.json for the first rank to fail, failure-rank<R>.json after it) and return it as its JSON."""
    from ballast.training.outputs import FailureRecord, write_failure

    cls = classify(exc)
    record = FailureRecord(failure_class=cls, exit_code=EXIT_CODES[cls], exception=f"{type(exc).__name__}: {exc}",
                           traceback=traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:],
                           step=step, rank=rank, host=host_name(), pid=os.getpid(), time=time.time())
    write_failure(out_dir, record)
    return record.as_dict()


def read_record(out_dir: Path) -> dict | None:
    """failure.json as its JSON object (read through `training.outputs.read_failure`), or None."""
    from ballast.training.outputs import read_failure

    record = read_failure(Path(out_dir))
    return record.as_dict() if record is not None else None
