"""Stage 5: verify the checkpoints training left before anything uses them.

Uses the same predicate as the trainer's resume path (training.checkpoint.verify): committed marker,
manifest, every file's size and sha256. Then loads the weights without unpickling arbitrary objects,
checks they fit the spec's model and are all finite.
"""

from __future__ import annotations

from pathlib import Path

from ballast.context import RunContext
from ballast.errors import CheckpointError
from ballast.records import CheckedCheckpoint, VerifyResult


def check(path: Path, ctx: RunContext) -> CheckedCheckpoint:
    import torch

    from training import checkpoint as ckpt
    from training.models import build_model

    # A CheckpointFailure from these goes up as it is: the runner translates it (class data, no retry).
    manifest = ckpt.verify(path)
    state = ckpt.read_trainer_state(path)
    weights = ckpt.load_tensors(path / "model.pt")
    spec = ctx.spec
    feature = spec.dataset.features[0]
    model = build_model(spec.training.model, input_shape=list(feature.shape) or [1],
                        num_classes=spec.dataset.num_classes, hidden=spec.training.hidden_size)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise CheckpointError(f"{path / 'model.pt'}: weights do not fit model {spec.training.model!r}: "
                              f"{str(exc).splitlines()[0]}") from exc
    bad = [name for name, t in weights.items() if torch.is_floating_point(t) and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"{path / 'model.pt'}: non-finite values in {', '.join(bad[:5])}")
    n_params = sum(t.numel() for t in weights.values())
    return CheckedCheckpoint(path=str(path), step=state["step"], files=len(manifest["files"]), parameters=n_params)


def run(ctx: RunContext) -> VerifyResult:
    train = ctx.result("train")
    best = Path(train.best_checkpoint) if train.best_checkpoint else None
    last = Path(train.last_checkpoint)
    checked_last = check(last, ctx)
    checked_best = check(best, ctx) if best is not None and best != last else checked_last
    ctx.log.info("checkpoints verified: best %s (step %d), last %s (step %d), %d parameters", checked_best.path,
                 checked_best.step, checked_last.path, checked_last.step, checked_best.parameters)
    return VerifyResult(last=checked_last, best=checked_best)
