"""Stage 6: score the best checkpoint on the held-out test split and gate publishing.

Early stopping already happened inside training (validation split, `evaluation.patience`); this stage
measures the chosen model on rows training never saw. Below `evaluation.threshold` the run fails
without retrying and nothing is published.
"""

from __future__ import annotations

from pathlib import Path

from ballast.context import RunContext
from ballast.errors import QualityGateError
from ballast.records import EvaluateResult


def run(ctx: RunContext) -> EvaluateResult:
    import torch
    import torch.nn.functional as F

    from training import checkpoint as ckpt
    from training.dataset.reader import load_split
    from training.models import build_model

    spec = ctx.spec
    best = Path(ctx.result("verify_checkpoint").best.path)
    cache = ctx.result("warm_cache")
    feature = spec.dataset.features[0]
    shape = list(feature.shape) or [1]
    test = load_split(Path(cache.cache_dir), "test", fmt=cache.format, num_classes=spec.dataset.num_classes)
    model = build_model(spec.training.model, input_shape=shape, num_classes=spec.dataset.num_classes,
                        hidden=spec.training.hidden_size)
    model.load_state_dict(ckpt.load_tensors(best / "model.pt"))
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(test.features))
        y = torch.from_numpy(test.labels)
        loss = float(F.cross_entropy(logits, y))
        pred = logits.argmax(1)
        accuracy = float((pred == y).float().mean())
    per_class = {int(c): round(float((pred[y == c] == c).float().mean()), 4) for c in torch.unique(y)}
    value = accuracy if spec.evaluation.metric == "accuracy" else loss
    history = ckpt.read_trainer_state(best)["history"]
    thr = spec.evaluation.threshold
    ok = None if thr is None else (value >= thr if spec.evaluation.mode == "max" else value <= thr)
    result = EvaluateResult(metric=spec.evaluation.metric, value=value, accuracy=accuracy, loss=loss,
                            test_rows=len(test), per_class_accuracy=per_class, checkpoint=str(best),
                            validation_history=history, threshold=thr, passed=ok)
    ctx.log.info("test %s = %.4f on %d held-out rows (checkpoint %s)", spec.evaluation.metric, value, len(test), best)
    if ok is False:
        ctx.save_result("evaluate", result)  # keep the numbers for the report even though we stop here
        raise QualityGateError(f"evaluation.threshold: test {spec.evaluation.metric} {value:.4f} does not reach"
                               f" {thr} ({spec.evaluation.mode}); the model is not published")
    return result
