"""The "is this better" rule, defined once for the trainer and the stages, for every task's metrics.

The trainer scores the validation split each epoch with its task's summable parts
(`ballast.training.tasks.ops.TaskOps`, summed across ranks) and decides early stopping and the LR
plateau with `improved`; the evaluate stage scores the test split with the same parts and gates
publishing with `reaches` and `improved`. So a metric means the same thing in the validation history,
in the test report and in the threshold. The direction of a metric is the task table's
(`ballast.training.tasks.DIRECTION`), never guessed.

Importable without torch.
"""

from __future__ import annotations

from typing import Literal

from ballast.training.tasks import DIRECTION

Mode = Literal["max", "min"]


def mode_of(metric: str) -> Mode:
    """The direction in which `metric` improves (KeyError for a name no task reports)."""
    return DIRECTION[metric]


def improved(value: float, best: float | None, *, mode: Mode, min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` by more than `min_delta` in the direction of `mode` (any value
    beats no best yet): the trainer's early-stopping and best-checkpoint rule, and if_better's."""
    if best is None:
        return True
    return value > best + min_delta if mode == "max" else value < best - min_delta


def reaches(value: float, threshold: float, *, mode: Mode) -> bool:
    """Whether `value` is at least as good as `threshold` in the direction of `mode` (the publish gate)."""
    return value >= threshold if mode == "max" else value <= threshold
