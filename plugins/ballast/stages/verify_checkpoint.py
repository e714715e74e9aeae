"""Stage 5: verify the checkpoints training left before anything uses them.

Uses the same predicate as the trainer's resume path (training.checkpoint.verify): committed marker,
manifest, every file's size and sha256. Then rebuilds the model from what the checkpoint records
about itself (`load_model`, which evaluate uses too), loads the weights into it without unpickling
arbitrary objects, and checks they are all finite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ballast.context import RunContext
from ballast.errors import CheckpointError
from ballast.records import CheckedCheckpoint, VerifyResult


def load_model(path: Path) -> tuple[Any, dict[str, Any]]:
    """The checkpoint's model with its weights loaded, and the weights: built from the model section
    its trainer.json records (training.checkpoint.recorded_model), not from the spec, which may have
    been edited since. A CheckpointFailure (missing or damaged file) goes up as it is: the runner
    translates it (class data, no retry)."""
    from pydantic import ValidationError

    from training import checkpoint as ckpt
    from training.config.run import ModelConfig
    from training.models import build_configured_model

    recorded = ckpt.recorded_model(path)
    try:
        section = ModelConfig.model_validate(recorded)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CheckpointError(f"{path / ckpt.TRAINER_STATE}: recorded model section is not buildable:"
                              f" {'.'.join(map(str, first['loc']))}: {first['msg']}") from exc
    weights = ckpt.load_tensors(path / "model.pt")
    model = build_configured_model(section)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise CheckpointError(f"{path / 'model.pt'}: weights do not fit the model {section.model!r}"
                              f" {list(section.input_shape)} -> {section.num_classes} recorded in"
                              f" {ckpt.TRAINER_STATE}: {str(exc).splitlines()[0]}") from exc
    return model, weights


def check(path: Path) -> CheckedCheckpoint:
    import torch

    from training import checkpoint as ckpt

    manifest = ckpt.verify(path)
    state = ckpt.read_trainer_state(path)
    _, weights = load_model(path)
    bad = [name for name, t in weights.items() if torch.is_floating_point(t) and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"{path / 'model.pt'}: non-finite values in {', '.join(bad[:5])}")
    n_params = sum(t.numel() for t in weights.values())
    return CheckedCheckpoint(path=str(path), step=state["step"], files=len(manifest["files"]), parameters=n_params)


def run(ctx: RunContext) -> VerifyResult:
    train = ctx.result("train")
    best = Path(train.best_checkpoint) if train.best_checkpoint else None
    last = Path(train.last_checkpoint)
    checked_last = check(last)
    checked_best = check(best) if best is not None and best != last else checked_last
    ctx.log.info("checkpoints verified: best %s (step %d), last %s (step %d), %d parameters", checked_best.path,
                 checked_best.step, checked_last.path, checked_last.step, checked_best.parameters)
    return VerifyResult(last=checked_last, best=checked_best)
