"""One exception family for everything Ballast reports to a user.

Every message names the file, the field (or object) and what would fix it, so that a task log or
`ballast lint` can print it as one line instead of a traceback.
"""

from __future__ import annotations


class BallastError(Exception):
    """Base class: a problem a user can act on, reported as one line."""


class SpecError(BallastError):
    """A spec file cannot be read or does not validate."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class DataError(BallastError):
    """The data a stage read is missing, malformed or fails its checks."""


class CheckpointError(BallastError):
    """No committed, intact checkpoint where one was expected."""


class LaunchError(BallastError):
    """A training launch failed; carries the failure class the trainer recorded."""

    def __init__(self, message: str, *, failure_class: str = "unknown", retryable: bool = True):
        self.failure_class = failure_class
        self.retryable = retryable
        super().__init__(message)


class StorageError(BallastError):
    """Reading or writing the pipeline's storage failed."""


class QualityGateError(BallastError):
    """The evaluated model did not reach the spec's publish threshold."""
