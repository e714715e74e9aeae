"""The classification scores and the "is this better" rule, defined once for the trainer and the stages.

The trainer scores the validation split with them each epoch (its shard on every rank, the parts
summed across ranks) and decides early stopping; the evaluate stage scores the test split with the
same functions and gates publishing with the same comparison. So a metric means the same thing in
the validation history, in the test report and in the threshold.

Importable without torch (the functions that take tensors import nothing: they call the tensors'
own methods and torch.nn.functional, imported when called).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Mode = Literal["max", "min"]


@dataclass(frozen=True)
class ScoreSums:
    """Summable parts of the scores: add them over ranks or batches, then take `scores()`."""

    samples: float
    """Rows scored."""
    loss_sum: float
    """Sum of their cross-entropy losses."""
    correct: float
    """Rows whose highest logit is their label."""

    def as_list(self) -> list[float]:
        """The parts in a fixed order, for one all-reduce (`from_list` reads it back)."""
        return [self.samples, self.loss_sum, self.correct]

    @classmethod
    def from_list(cls, parts: list[float]) -> ScoreSums:
        samples, loss_sum, correct = parts
        return cls(samples=samples, loss_sum=loss_sum, correct=correct)

    def __add__(self, other: ScoreSums) -> ScoreSums:
        return ScoreSums(samples=self.samples + other.samples, loss_sum=self.loss_sum + other.loss_sum,
                         correct=self.correct + other.correct)

    def scores(self) -> dict[str, float]:
        """accuracy, mean loss and the number of rows (0 scores for no rows, not a division by zero)."""
        n = max(self.samples, 1.0)
        return {"accuracy": self.correct / n, "loss": self.loss_sum / n, "samples": self.samples}


def classification_sums(logits: Any, labels: Any) -> ScoreSums:
    """The summable score parts of a batch: `logits` (n, classes) and integer `labels` (n,) tensors."""
    import torch.nn.functional as F

    logits = logits.float()
    if not len(labels):
        return ScoreSums(samples=0.0, loss_sum=0.0, correct=0.0)
    return ScoreSums(samples=float(len(labels)), loss_sum=float(F.cross_entropy(logits, labels, reduction="sum")),
                     correct=float((logits.argmax(1) == labels).sum()))


def per_class_accuracy(logits: Any, labels: Any, *, digits: int = 4) -> dict[int, float]:
    """Accuracy within each label present in `labels`, rounded to `digits`."""
    pred = logits.argmax(1)
    return {int(c): round(float((pred[labels == c] == c).float().mean()), digits) for c in labels.unique()}


def improved(value: float, best: float | None, *, mode: Mode, min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` by more than `min_delta` in the direction of `mode` (any value
    beats no best yet): the trainer's early-stopping and best-checkpoint rule."""
    if best is None:
        return True
    return value > best + min_delta if mode == "max" else value < best - min_delta


def reaches(value: float, threshold: float, *, mode: Mode) -> bool:
    """Whether `value` is at least as good as `threshold` in the direction of `mode` (the publish gate)."""
    return value >= threshold if mode == "max" else value <= threshold
