"""The training tasks: their names, metrics and the direction in which each metric improves.

The tables here are what the spec checks names against at DAG-parse time (no torch at import); the
torch side (losses, summable metric parts, how inputs and targets come from a batch) is
`ballast.training.tasks.ops`, imported where a model runs.
"""

from __future__ import annotations

from typing import Literal

TASKS: tuple[str, ...] = ("classification", "causal_lm", "segmentation", "regression")
DEFAULT_TASK = "classification"

METRICS: dict[str, tuple[str, ...]] = {
    "classification": ("accuracy", "loss"),
    "causal_lm": ("loss", "perplexity", "bits_per_byte"),
    "segmentation": ("mean_iou", "dice", "loss"),
    "regression": ("rmse", "mae", "loss"),
}
"""Every metric a task reports on validation and test, by name; its default (early stopping, the publish
gate) first."""

ALL_METRICS: tuple[str, ...] = ("accuracy", "loss", "perplexity", "bits_per_byte", "mean_iou", "dice", "rmse", "mae")

DIRECTION: dict[str, Literal["max", "min"]] = {
    "accuracy": "max", "mean_iou": "max", "dice": "max",
    "loss": "min", "perplexity": "min", "bits_per_byte": "min", "rmse": "min", "mae": "min",
}
"""Whether a larger (max) or a smaller (min) value of a metric is better."""

LOSSES: dict[str, str] = {
    "classification": "cross-entropy over the classes",
    "causal_lm": "next-token cross-entropy (mean over tokens)",
    "segmentation": "per-pixel (per-voxel) cross-entropy",
    "regression": "mean squared error",
}

LABELLED = frozenset({"classification", "segmentation", "regression"})
"""The tasks whose dataset has a label field (causal_lm's targets are its own tokens, shifted)."""
CLASSES = frozenset({"classification", "segmentation"})
"""The tasks that predict classes (num_classes applies)."""


def default_metric(task: str) -> str:
    """The metric a task is judged by when the spec names none."""
    return METRICS[task][0]


def metric_of(task: str, metric: str | None) -> str:
    """`metric` if the task reports it (the default when None); ValueError naming the task's metrics."""
    if metric is None:
        return default_metric(task)
    if metric not in METRICS[task]:
        raise ValueError(f"{metric!r} is not a metric of task {task} ({', '.join(METRICS[task])})")
    return metric


def check_columns(manifest: dict, data: dict, features: list[str], *, where: str) -> None:
    """The packed dataset (its manifest) holds the feature columns a model was built for, of their shapes
    (`data`: the model's data dict); a DataFailure naming the column otherwise. causal_lm's sequences
    hold seq_len + 1 tokens."""
    from ballast.training.failure import DataFailure

    columns = {c["name"]: list(c["shape"]) for c in manifest.get("columns", [])
               if c.get("role", "feature") == "feature"}
    inputs = data["inputs"]
    for name in features:
        want = [int(data["seq_len"]) + 1] if data["task"] == "causal_lm" else inputs.get(name, {}).get("shape")
        if name not in columns:
            raise DataFailure(f"{where}: the dataset has no feature column {name!r} (it has"
                              f" {', '.join(columns) or 'none'}); convert it again for this spec")
        if want is not None and columns[name] != list(want):
            raise DataFailure(f"{where}: feature {name!r} has shape {columns[name]}, the model expects"
                              f" {list(want)}; convert the dataset again for this spec")
