"""A round's evaluate task (training.rounds > 1): the round's validation score and whether early stopping
has ended training.

The early-stopping state is the trainer's own (`bad_epochs`, `best`, the validation history in the
round's verified checkpoint, computed with training.metrics' one `improved`), copied into the run's
records (`RoundResult`), so that it outlives every trainer process: the next round's train task reads
it and skips when it says stop; the skipped rounds show as skipped in the Airflow UI, and the test-split
evaluate and publish still run.
"""

from __future__ import annotations

from pathlib import Path

from ballast.pipeline.context import RunContext
from ballast.records import RoundResult


def run(ctx: RunContext) -> RoundResult:
    from ballast.training import checkpoint as ckpt

    spec, ev = ctx.spec, ctx.spec.evaluation
    k, rounds = ctx.round or 1, spec.training.rounds
    verified = ctx.result("verify_checkpoint")
    train = ctx.result("train")
    state = ckpt.read_trainer_state(Path(verified.last.path))
    history = state.get("history") or []
    best = state.get("best") or {}
    value = history[-1].get(ev.metric) if history else None
    bad = int(state.get("bad_epochs", 0))
    epochs = int(state.get("epoch", 0))
    if train.stopped_early or bad >= ev.patience:
        stop, reason = True, (f"validation {ev.metric} has not improved by more than {ev.min_delta:g} for {bad}"
                              f" epochs (evaluation.patience {ev.patience}); best {best.get('value')} at epoch"
                              f" {best.get('epoch')}")
    elif k == rounds:
        stop, reason = True, f"all {rounds} rounds trained ({epochs} epochs)"
    else:
        stop, reason = False, (f"round {k} of {rounds}: validation {ev.metric} {value}, best {best.get('value')};"
                               f" {bad} of {ev.patience} epochs without improvement")
    ctx.log.info("round %d: %s", k, reason)
    return RoundResult(round=k, rounds=rounds, epochs_trained=epochs, checkpoint=verified.last.path,
                       metric=ev.metric, value=value, best_value=best.get("value"), best_epoch=best.get("epoch"),
                       bad_epochs=bad, stop=stop, reason=reason)
