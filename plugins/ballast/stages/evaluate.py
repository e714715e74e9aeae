"""Stage 6: score the best checkpoint on the held-out test split and gate publishing.

Early stopping already happened inside training (validation split, `evaluation.patience`); this stage
measures the chosen model on rows training never saw, with the trainer's own scores and comparison
(training.metrics), on the model the checkpoint records (verify_checkpoint.load_model). Below
`evaluation.threshold` the run fails without retrying and nothing is published.
"""

from __future__ import annotations

from pathlib import Path

from ballast.pipeline.context import RunContext
from ballast.errors import QualityGateError
from ballast.records import EvaluateResult, HeldOutScores
from ballast.stages.verify_checkpoint import load_model


def _baseline(ctx: RunContext, test) -> tuple[HeldOutScores | None, str | None]:
    """The last published model's scores on this run's test split (evaluation.publish: if_better)."""
    import torch

    from ballast.storage import models as registry
    from ballast.training.scores import classification_sums

    published = registry.latest(ctx)
    if published is None:
        ctx.log.info("evaluation.publish if_better: no model published yet; this one will be the first")
        return None, None
    model = registry.load(registry.weights(ctx, published, ctx.work_dir / "baseline"), published.model_section)
    model.eval()
    with torch.no_grad():
        scores = classification_sums(model(torch.from_numpy(test.features)).float(), torch.from_numpy(test.labels)).scores()
    ev = ctx.spec.evaluation
    ctx.log.info("published model %s on the same test split: %s = %.4f", published.version, ev.metric, scores[ev.metric])
    return HeldOutScores(metric=ev.metric, value=scores[ev.metric], accuracy=scores["accuracy"], loss=scores["loss"],
                         test_rows=len(test)), published.version


def run(ctx: RunContext) -> EvaluateResult:
    import torch

    from ballast.training import checkpoint as ckpt
    from ballast.training.dataset.reader import load_split
    from ballast.training.scores import classification_sums, per_class_accuracy, reaches

    spec = ctx.spec
    ev = spec.evaluation
    best = Path(ctx.result("verify_checkpoint").best.path)
    cache = ctx.result("warm_cache")
    test = load_split(Path(cache.cache_dir), "test", fmt=cache.format, num_classes=spec.dataset.num_classes)
    model, _ = load_model(best)  # a damaged file is a CheckpointFailure naming it: no retry (the runner)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(test.features)).float()
    y = torch.from_numpy(test.labels)
    scores = classification_sums(logits, y).scores()
    value = scores[ev.metric]
    history = ckpt.read_trainer_state(best)["history"]
    ok = None if ev.threshold is None else reaches(value, ev.threshold, mode=ev.mode)
    baseline, baseline_version = _baseline(ctx, test) if ev.publish == "if_better" else (None, None)
    result = EvaluateResult(metric=ev.metric, value=value, accuracy=scores["accuracy"], loss=scores["loss"],
                            test_rows=len(test), per_class_accuracy=per_class_accuracy(logits, y),
                            checkpoint=str(best), validation_history=history, threshold=ev.threshold, passed=ok,
                            baseline=baseline, baseline_version=baseline_version)
    ctx.log.info("test %s = %.4f on %d held-out rows (checkpoint %s)", ev.metric, value, len(test), best)
    if ok is False:
        ctx.save_result("evaluate", result)  # keep the numbers for the report even though we stop here
        raise QualityGateError(f"evaluation.threshold: test {ev.metric} {value:.4f} does not reach"
                               f" {ev.threshold} ({ev.mode}); the model is not published")
    return result
