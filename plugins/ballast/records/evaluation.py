"""The evaluate stage's records: a model's scores on the held-out test split, every metric of its task by
name, and the publish gate."""

from __future__ import annotations

from typing import Any

from pydantic import model_serializer

from ballast.records.base import Record


class HeldOutScores(Record):
    """The model's scores on the held-out test split: the spec's metric and every metric of the task, by
    name (a metric the task does not report is left out of the JSON)."""

    metric: str
    """The spec's `evaluation.metric`."""
    value: float
    """Its value."""
    task: str = "classification"
    """The task (training.task) whose metrics these are."""
    accuracy: float | None = None
    """classification: share of test rows classified right."""
    loss: float | None = None
    """The task's mean loss: cross-entropy per row (classification), per token (causal_lm), per pixel
    (segmentation); the mean squared error (regression)."""
    perplexity: float | None = None
    """causal_lm: exp(mean token loss)."""
    bits_per_byte: float | None = None
    """causal_lm: token losses in bits per UTF-8 byte of the text they stand for."""
    mean_iou: float | None = None
    """segmentation: intersection over union, averaged over the classes present."""
    dice: float | None = None
    """segmentation: Dice coefficient, averaged over the classes present."""
    rmse: float | None = None
    """regression: root of the mean squared error."""
    mae: float | None = None
    """regression: mean absolute error."""
    test_rows: int
    """Rows in the test split."""

    @model_serializer(mode="wrap")
    def _only_the_task_metrics(self, handler: Any) -> Any:
        data = handler(self)
        return {k: v for k, v in data.items() if not (k in METRIC_FIELDS and v is None)}

    @property
    def metrics(self) -> dict[str, float]:
        """Every metric the task reported, by name."""
        return {k: getattr(self, k) for k in METRIC_FIELDS if getattr(self, k) is not None}

    @classmethod
    def of(cls, *, task: str, metric: str, scores: dict[str, float], test_rows: int) -> HeldOutScores:
        """The record of a task's `scores` (every metric by name; `samples` and the like left out)."""
        return cls(task=task, metric=metric, value=scores[metric], test_rows=test_rows,
                   **{k: v for k, v in scores.items() if k in METRIC_FIELDS})


METRIC_FIELDS = ("accuracy", "loss", "perplexity", "bits_per_byte", "mean_iou", "dice", "rmse", "mae")
"""The metrics of every task (ballast.training.tasks.ALL_METRICS), each a field of HeldOutScores."""


class EvaluateResult(HeldOutScores):
    """Stage `evaluate`: the best checkpoint scored on rows training never saw, and the publish gate."""

    version: int = 2
    """Record format version (2: every metric of the task; accuracy only for classification)."""
    per_class_accuracy: dict[int, float] = {}
    """classification: accuracy per label present in the test split."""
    checkpoint: str
    """The checkpoint evaluated."""
    validation_history: list[dict[str, int | float]]
    """The validation record of every epoch, as the trainer saved it in that checkpoint."""
    threshold: float | None
    """The spec's `evaluation.threshold` (None: no gate)."""
    passed: bool | None = None
    """Whether `value` reached the threshold (None without one)."""
    baseline: HeldOutScores | None = None
    """The last published model's scores on the same test split (evaluation.publish: if_better)."""
    baseline_version: str | None = None
    """Its version."""

    def scores(self) -> HeldOutScores:
        """The test scores alone (what the model card and the report quote)."""
        return HeldOutScores(**{k: getattr(self, k) for k in HeldOutScores.model_fields})
