"""Stage 6: score the best checkpoint on the held-out test split and gate publishing.

Early stopping already happened inside training (validation split, `evaluation.patience`); this stage
measures the chosen model on rows training never saw, with the trainer's own task metrics and
comparison (training.tasks.ops, training.scores), on the model the checkpoint records
(verify_checkpoint.load_model). The record holds every metric of the task by name. Below
`evaluation.threshold` the run fails without retrying and nothing is published.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ballast.pipeline.context import RunContext
from ballast.errors import ConfigError, QualityGateError
from ballast.records import EvaluateResult, HeldOutScores
from ballast.stages.verify_checkpoint import load_model, recorded_section

EVAL_ROWS = 256
"""Rows scored per forward pass (the test split is held in memory; its activations need not be)."""


def task_of(section: Any, cache_dir: str) -> Any:
    """The recorded model's task (training.tasks.ops.TaskOps), with the dataset tokenizer's byte lengths."""
    from ballast.training.tasks import ops as task_ops

    manifest = json.loads((Path(cache_dir) / "manifest.json").read_text())
    return task_ops.TaskOps(section.task, num_classes=section.data.get("num_classes"),
                            token_bytes=(manifest.get("tokenizer") or {}).get("token_bytes"))


def test_scores(model: Any, task: Any, test: Any) -> dict[str, float]:
    """Every metric of the task of `model` on the whole split `test`."""
    from ballast.training.tasks import ops as task_ops

    model.eval()
    parts = task_ops.split_parts(model, task, test.features, test.labels, device="cpu", batch=EVAL_ROWS)
    return task.scores(parts)


def _baseline(ctx: RunContext, test, task) -> tuple[HeldOutScores | None, str | None]:
    """The last published model's scores on this run's test split (evaluation.publish: if_better)."""
    from ballast.storage import models as registry

    published = registry.latest(ctx)
    if published is None:
        ctx.log.info("evaluation.publish if_better: no model published yet; this one will be the first")
        return None, None
    model = registry.load(registry.weights(ctx, published, ctx.work_dir / "baseline"), published.model_section)
    scores = test_scores(model, task, test)
    ev = ctx.spec.evaluation
    ctx.log.info("published model %s on the same test split: %s = %.4f", published.version, ev.metric,
                 scores[ev.metric])
    return HeldOutScores.of(task=task.task, metric=ev.metric, scores=scores, test_rows=len(test)), published.version


def run(ctx: RunContext) -> EvaluateResult:
    import torch

    from ballast.training import checkpoint as ckpt
    from ballast.training.dataset.reader import load_split
    from ballast.training.scores import reaches
    from ballast.training.tasks import ops as task_ops

    spec = ctx.spec
    ev = spec.evaluation
    best = Path(ctx.result("verify_checkpoint").best.path)
    cache = ctx.result("warm_cache")
    test = load_split(Path(cache.cache_dir), "test", fmt=cache.format, num_classes=spec.dataset.num_classes)
    model, _ = load_model(best)  # a damaged file is a CheckpointFailure naming it: no retry (the runner)
    task = task_of(recorded_section(best), cache.cache_dir)
    scores = test_scores(model, task, test)
    if ev.metric not in scores:
        raise ConfigError(f"evaluation.metric: {ev.metric!r} is not computed for this dataset (task {task.task}"
                               f" reports {', '.join(task.metrics)} here); choose one of those")
    per_class: dict[int, float] = {}
    if task.task == "classification":
        with torch.no_grad():
            logits = torch.cat([model(task_ops.as_tensors(task_ops.take(test.features, i, i + EVAL_ROWS)))
                                for i in range(0, len(test), EVAL_ROWS)])
        per_class = task_ops.per_class_accuracy(logits, task_ops.as_tensors(test.labels))
    value = scores[ev.metric]
    history = ckpt.read_trainer_state(best)["history"]
    ok = None if ev.threshold is None else reaches(value, ev.threshold, mode=ev.mode)
    baseline, baseline_version = _baseline(ctx, test, task) if ev.publish == "if_better" else (None, None)
    held_out = HeldOutScores.of(task=task.task, metric=ev.metric, scores=scores, test_rows=len(test))
    result = EvaluateResult(**held_out.model_dump(), per_class_accuracy=per_class, checkpoint=str(best),
                            validation_history=history, threshold=ev.threshold, passed=ok,
                            baseline=baseline, baseline_version=baseline_version)
    ctx.log.info("test %s = %.4f on %d held-out rows (checkpoint %s); %s", ev.metric, value, len(test), best,
                 ", ".join(f"{k} {v:.4f}" for k, v in held_out.metrics.items()))
    if ok is False:
        ctx.save_result("evaluate", result)  # keep the numbers for the report even though we stop here
        raise QualityGateError(f"evaluation.threshold: test {ev.metric} {value:.4f} does not reach"
                               f" {ev.threshold} ({ev.mode}); the model is not published")
    return result
