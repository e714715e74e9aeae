"""One exception family for everything Ballast reports to a user, and the one place that decides
whether a retry can help.

Every message names the file, the field (or object) and what would fix it, so that a task log or
`ballast lint` can print it as one line instead of a traceback.

The training package (`training/`, which never imports Ballast) has its own family: every
`training.failure.TrainingFailure` carries a failure class. A stage does not catch those: the runner
translates whatever reaches it once, by class (`from_training`), and asks `retry_helps` whether the
task fails at once or goes back to Airflow's retries.
"""

from __future__ import annotations

from training.failure import RETRYABLE, TrainingFailure


class BallastError(Exception):
    """Base class: a problem a user can act on, reported as one line."""


class SpecError(BallastError):
    """A spec file cannot be read or does not validate."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(SpecError):
    """The training package refused the run config a spec produced (failure class `config`): fix the spec."""


class DataError(BallastError):
    """The data a stage read is missing, malformed or fails its checks (a checkpoint's files included)."""


class CheckpointError(BallastError):
    """No committed, intact checkpoint where one was expected, or one that does not fit its model."""


class LaunchError(BallastError):
    """A training launch failed; carries the failure class the trainer recorded (`unknown` without a record)."""

    def __init__(self, message: str, *, failure_class: str = "unknown"):
        self.failure_class = failure_class
        super().__init__(message)


class StorageError(BallastError):
    """Reading or writing the pipeline's storage failed."""


class QualityGateError(BallastError):
    """The evaluated model did not reach the spec's publish threshold."""


# --- the one translation, the one retry decision -------------------------------------------------------

# Failure class (training.failure) -> the Ballast error it becomes; every other class is a LaunchError.
_BY_CLASS: dict[str, type[BallastError]] = {"config": ConfigError, "data": DataError}

# Errors no retry can fix: the same spec, data, checkpoint files or model come back on the next try.
FAIL_FAST: tuple[type[BallastError], ...] = (SpecError, DataError, CheckpointError, QualityGateError)

# Launch failures a retry may get past: the training package's retryable classes, and `unknown`
# (torchrun died without a failure record: killed from outside, the node lost).
RETRY_CLASSES: frozenset[str] = RETRYABLE | {"unknown"}


def training_error(message: str, failure_class: str) -> BallastError:
    """The Ballast error for a training failure of class `failure_class` (from an exception or a
    failure record), its message on one line (a task log line, not a traceback)."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    cls = _BY_CLASS.get(failure_class)
    return cls(line) if cls is not None else LaunchError(line, failure_class=failure_class)


def from_training(exc: TrainingFailure) -> BallastError:
    """Translate a training failure that reached a stage, by its class (the one place that does)."""
    return training_error(str(exc) or type(exc).__name__, exc.failure_class)


def retry_helps(exc: BallastError) -> bool:
    """Whether Airflow's retries may get past `exc`; the runner fails the task at once when not."""
    if isinstance(exc, LaunchError):
        return exc.failure_class in RETRY_CLASSES
    return not isinstance(exc, FAIL_FAST)
