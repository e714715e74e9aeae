"""Stage 5: verify the checkpoints training left before anything uses them.

The verification gate (`training.checkpoint.gate.check`, the trainer's resume path runs the same
predicate): committed marker, manifest sizes and sha256, tensors loadable without unpickling and
finite, the step where its directory says, and a forward pass on a held-out batch with a finite loss
(`held_out_probe`; a model too large for this process runs with its blocks' weights read as they run:
training.checkpoint.streamed). The model is rebuilt from what the checkpoint records about itself
(`load_model`, which evaluate uses too), not from the spec. A checkpoint that fails is quarantined
(`<checkpoints>/quarantine/`, with its reason) and the newest one before it that passes takes its
place; with none left the task fails without retrying.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ballast.pipeline.context import RunContext
from ballast.errors import CheckpointError
from ballast.records import CheckedCheckpoint, VerifyResult


def load_model(path: Path, *, budget: int | None = None, log: Callable[[str], Any] | None = None) -> Any:
    """The checkpoint's model with its weights loaded, in eval mode: built from the model section its
    trainer.json records (training.checkpoint.recorded_model), not from the spec, which may have been
    edited since. A CheckpointFailure (missing or damaged file, weights of another model) goes up as it
    is: the runner translates it (class data, no retry); a model whose package fails to build it is a
    ConfigFailure naming the package (class config). The weights are read whole when they fit `budget`
    bytes (default: training.checkpoint.streamed.memory_budget()), else block by block as the model
    runs (`training.checkpoint.streamed`)."""
    from ballast.training.checkpoint import streamed

    return streamed.load(path, recorded_section(path), log=log,
                         budget=streamed.memory_budget() if budget is None else budget)


def recorded_section(path: Path) -> Any:
    """The checkpoint's recorded model section, typed (`ModelConfig`); CheckpointError when it is not one."""
    from pydantic import ValidationError

    from ballast.training import checkpoint as ckpt
    from ballast.training.config.run import ModelConfig

    recorded = ckpt.recorded_model(path)
    try:
        return ModelConfig.model_validate(recorded)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CheckpointError(f"{path / ckpt.TRAINER_STATE}: recorded model section is not buildable:"
                              f" {'.'.join(map(str, first['loc']))}: {first['msg']}") from exc


def build_recorded(section: Any) -> Any:
    """The model a recorded section describes, untrained."""
    from ballast.training.models import build_configured_model

    return build_configured_model(section)


PROBE_ROWS = 64


def held_out_probe(cache_dir: str, fmt: str) -> Callable[[Path, dict], float]:
    """A forward pass of a checkpoint's model on the first held-out batch (the validation split's first
    cached block, or the first cached training block while the validation set is not in the cache: a
    cluster try's nodes warm the later phases in their own caches, the worker holds the first): its
    task's loss."""
    import torch

    from ballast.training.dataset.format import blocks_of, read_manifest
    from ballast.training.dataset.reader import BlockDecoder, read_block
    from ballast.training.tasks import ops as task_ops

    data_dir = Path(cache_dir)
    manifest = read_manifest(data_dir)
    blocks = [b for split in ("validation", "train")
              for b in [c for c in blocks_of(manifest, split, fmt) if (data_dir / c.path).is_file()][:1]]
    if not blocks:
        raise CheckpointError(f"{data_dir}: no cached validation or training block to probe checkpoints with")
    x, y = read_block(data_dir, blocks[0], fmt, BlockDecoder(manifest, fmt))
    x, y = task_ops.as_tensors(task_ops.take(x, 0, PROBE_ROWS)), task_ops.as_tensors(task_ops.take(y, 0, PROBE_ROWS))

    def probe(path: Path) -> float:
        # The weights read whole, or block by block as the model runs where they are larger than this
        # process may hold (training.checkpoint.streamed).
        model = load_model(path)
        section = recorded_section(path)
        task = task_ops.TaskOps(section.task, num_classes=section.data.get("num_classes"))
        inputs, target = task.prepare(x, y)
        with torch.no_grad():
            return float(task.loss(model(inputs), target))

    return probe


def describe(path: Path) -> CheckedCheckpoint:
    """The record of a checkpoint that passed the gate."""
    from ballast.training import checkpoint as ckpt

    state = ckpt.read_trainer_state(path)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    # The recorded model's parameters: tied weights (a language model's embedding and output layer), two
    # entries of the weights file, count once. Counted on the meta device (nothing allocated) where the
    # model builds there.
    from ballast.training.models import build_on_meta

    section = recorded_section(path)
    model = build_on_meta(section)[0]
    if model is None:  # its factory reads weights, or its constructor needs values: built on the CPU
        model = build_recorded(section)
    n_params = int(sum(p.numel() for p in model.parameters()))
    return CheckedCheckpoint(path=str(path), step=state["step"], files=len(manifest["files"]), parameters=n_params)


def gated(path: Path, probe, ckpt_dir: Path, log) -> tuple[Path, list[str]]:
    """`path` if it passes the gate; else it is quarantined and the newest checkpoint that passes is
    returned in its place (those failing on the way are quarantined too)."""
    from ballast.training import checkpoint as ckpt
    from ballast.training.checkpoint import gate

    try:
        gate.check(path, probe=probe)
        return path, []
    except ckpt.CheckpointFailure as exc:
        moved = gate.quarantine(path, str(exc))
        log.warning("checkpoint quarantined: %s (moved to %s)", exc, moved)
        first = str(exc)
    quarantined = [path.name]
    before = len(gate.quarantined(ckpt_dir))
    replacement = gate.latest_passing(ckpt_dir, probe=probe, log=log.warning)
    quarantined += [q["checkpoint"] for q in gate.quarantined(ckpt_dir)[before:]]
    if replacement is None:
        raise CheckpointError(f"{first}; no earlier checkpoint under {ckpt_dir} passes the verification gate"
                              f" either (quarantined under {ckpt_dir / gate.QUARANTINE_DIR})")
    log.warning("using %s in place of %s", replacement.name, path.name)
    return replacement, quarantined


def run(ctx: RunContext) -> VerifyResult:
    train = ctx.result("train")
    cache = ctx.result("warm_cache")
    ckpt_dir = Path(train.checkpoint_dir)
    probe = held_out_probe(cache.cache_dir, cache.format)
    trained_last = Path(train.last_checkpoint)
    trained_best = Path(train.best_checkpoint) if train.best_checkpoint else trained_last
    last, q_last = gated(trained_last, probe, ckpt_dir, ctx.log)
    # The best one (when it is another checkpoint) passes the gate too, or the newest that does stands in.
    best, q_best = (last, []) if trained_best == trained_last else gated(trained_best, probe, ckpt_dir, ctx.log)
    checked_last = describe(last)
    checked_best = describe(best) if best != last else checked_last
    ctx.log.info("checkpoints verified: best %s (step %d), last %s (step %d), %d parameters", checked_best.path,
                 checked_best.step, checked_last.path, checked_last.step, checked_best.parameters)
    return VerifyResult(last=checked_last, best=checked_best, quarantined=[*q_last, *q_best])
