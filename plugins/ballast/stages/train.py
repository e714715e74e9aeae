"""Stage 4: distributed training through torchrun, resuming from the newest checkpoint that passes
the verification gate.

A try begins by ending whatever an earlier try of this task left running (its lease), completing that
try's record if it was killed before writing it, and adapting to the tries before it
(`ballast.recovery.adapt`: a smaller micro-batch after out-of-memory, the on-demand pool after
preemptions, an avoid list after a host's failure). It records itself in the attempt history
(`ballast.recovery.history`) when it starts and when it ends. The try itself runs on the spec's backend
through the one driver (`ballast.stages.train_try`, `ballast.launch.driver`): a training process that
shows no progress for `execution.hang_timeout_seconds` is ended and reported as a hang. Whether a failure gets
a new try is the recovery policy's call (`ballast.recovery.policy`, per failure class).
"""

from __future__ import annotations

import os
from pathlib import Path

from ballast.storage import cache_dir as cachedir
from ballast.pipeline.context import RunContext
from ballast.errors import Cancelled, CheckpointError, ConfigError, LaunchError, SpecError, failure_class
from ballast.launch.config import run_config
from ballast.records import RoundResult, TrainResult
from ballast.recovery import adapt, history
from ballast.recovery.policy import decide_unseen
from ballast.launch import driver


def run(ctx: RunContext) -> TrainResult:
    spec = ctx.spec
    cache = ctx.result("warm_cache")
    work = ctx.work_dir
    out_dir, ckpt_dir = work / "train", work / "checkpoints"
    out_dir.mkdir(parents=True, exist_ok=True)
    task_id = ctx.task_id or "train"
    start = _after_previous_round(ctx)

    hist = _close_earlier_try(ctx, history.load(ctx, task_id), out_dir, ckpt_dir)
    settings, notes = adapt.next_settings(spec, [a for a in hist.attempts if a.try_number < ctx.try_number],
                                          start=start)
    for note in notes:
        ctx.log.warning("adapting: %s", note)
    if spec.execution.backend == "local" and (settings.capacity != "default" or settings.avoid_hosts):
        ctx.log.info("local backend: capacity %s, hosts to avoid %s recorded (it trains on this machine)",
                     settings.capacity, list(settings.avoid_hosts) or "none")
    _archive_failure_record(out_dir)
    with cachedir.in_use(Path(cache.cache_dir)):  # no other run's warm-up evicts what this try gates on and reads
        rewarm_if_evicted(ctx, cache)
        return _try(ctx, cache, hist, settings, notes, out_dir, ckpt_dir)


def rewarm_if_evicted(ctx: RunContext, cache) -> None:
    """Between the warm_cache task and this one nothing holds the dataset: another run's warm-up may have
    evicted it (an eviction moves the whole directory away, its manifest with it). Warm its first phase
    again, now under this try's hold; the train task warms the rest beside training as always."""
    if not (Path(cache.cache_dir) / "manifest.json").is_file():
        from ballast.stages.warm_cache import warm

        ctx.log.warning("the cached dataset %s is gone (evicted for another run's?): warming it again",
                        cache.cache_dir)
        warm(ctx, [0])


def _try(ctx: RunContext, cache, hist, settings, notes, out_dir: Path, ckpt_dir: Path) -> TrainResult:
    """The checkpoint gate, then training, recorded in the attempt history whatever happens."""
    _gate_checkpoints(ctx, cache, ckpt_dir)
    attempt = history.begin(ctx.try_number, settings=settings.as_dict(), adaptation=notes)
    hist = history.put(hist, attempt)
    history.save(ctx, hist)
    try:
        result = _train(ctx, cache, out_dir, ckpt_dir, settings)
    except BaseException as exc:
        # The task is being stopped (SIGTERM -> on_kill, an interrupt) or training was cancelled under it.
        cancelled = isinstance(exc, Cancelled) or not isinstance(exc, Exception) or driver.was_cancelled(out_dir)
        done = history.finish(attempt, out_dir, ckpt_dir, outcome="cancelled" if cancelled else "failed",
                              failure_class=None if cancelled else failure_class(exc),
                              reason=" ".join(str(exc).split()) or type(exc).__name__,
                              exit_code=getattr(exc, "exit_code", None), host=getattr(exc, "host", None),
                              step=getattr(exc, "step", None))
        history.save(ctx, history.put(hist, done))
        try:  # for the retry policy: whether tries still make progress (recovery.stalled_tries)
            exc.step_reached = done.step_reached  # type: ignore[attr-defined]
        except AttributeError:
            pass
        raise
    done = history.finish(attempt, out_dir, ckpt_dir, outcome="success")
    history.save(ctx, history.put(hist, done))
    return result


def _after_previous_round(ctx: RunContext) -> adapt.TrySettings | None:
    """In round k > 1: skip when early stopping ended training in round k - 1 (this task and the later
    rounds show as skipped); else carry the micro-batch the previous round ended with."""
    k = ctx.round
    if k is None or k == 1:
        return None
    key = ctx.result_key("evaluate_round", k - 1)
    prev = RoundResult.model_validate_json(ctx.storage.read_bytes(key))
    if prev.stop:
        from airflow.sdk.exceptions import AirflowSkipException

        ctx.log.info("round %d skipped: %s", k, prev.reason)
        raise AirflowSkipException(f"early stopping ended training in round {k - 1}: {prev.reason}")
    trained = TrainResult.model_validate_json(ctx.storage.read_bytes(ctx.result_key("train", k - 1)))
    return adapt.TrySettings(micro_batch_size=trained.micro_batch_size)


def _close_earlier_try(ctx: RunContext, hist, out_dir: Path, ckpt_dir: Path):
    """End what an earlier try left running; complete its record if it was killed before writing it,
    and count its failure against its class's budget (the retry policy never saw it)."""
    lease = driver.end_leftovers(lambda: driver.backend_for(ctx.spec, out_dir, ctx.log), out_dir, ctx.log)
    hist, closed = history.close_unfinished(hist, out_dir, ckpt_dir, lease=lease)
    if closed is None:
        return hist
    history.save(ctx, hist)
    ctx.log.warning("try %d ended without recording itself: %s (class %s)", closed.try_number, closed.reason,
                    closed.failure_class)
    decision = decide_unseen(ctx.spec.recovery, ctx.state, closed.try_number, closed.failure_class or "lost",
                             stage=ctx.task_id or "train", step=closed.step_reached, at=closed.ended)
    if not decision.retry:
        raise LaunchError(decision.reason, failure_class="config")  # no budget left: fail, do not retry
    return hist


def _gate_checkpoints(ctx: RunContext, cache, ckpt_dir: Path) -> Path | None:
    """The checkpoint this try resumes from: the newest that passes the verification gate, a forward
    pass included; newer ones that fail are quarantined (the trainer's ranks only skip). In round k > 1
    the step must not go back behind what round k - 1 verified."""
    from ballast.training import checkpoint as ckpt

    if not ckpt.committed(ckpt_dir):
        return None
    from ballast.stages.verify_checkpoint import held_out_probe
    from ballast.training.checkpoint import gate

    floor = None
    if (ctx.round or 1) > 1:
        floor = _verified_step(ctx, ctx.round - 1)
    # A sharded (FSDP) checkpoint gets no forward pass here: it would read the whole model again in this one
    # process before every try (block by block where it is larger than the process may hold: checkpoint.
    # streamed). Its hashes and every tensor's values are checked, a bounded batch at a time.
    resume = gate.latest_passing(ckpt_dir, probe=held_out_probe(cache.cache_dir, cache.format), min_step=floor,
                                 log=ctx.log.warning, probe_sharded=False)
    if resume is None and floor is not None:
        raise CheckpointError(f"{ckpt_dir}: no checkpoint at or after step {floor}, which round {ctx.round - 1}"
                              f" verified, passes the verification gate (see {ckpt_dir / gate.QUARANTINE_DIR});"
                              f" this round cannot continue from it")
    ctx.log.info("resuming from %s", resume if resume is not None else "scratch (no checkpoint passes the gate)")
    return resume


def _verified_step(ctx: RunContext, round_: int) -> int:
    from ballast.records import VerifyResult

    return VerifyResult.model_validate_json(ctx.storage.read_bytes(ctx.result_key("verify_checkpoint", round_))).last.step


def steps_planned(ctx: RunContext) -> int:
    """Optimizer steps the spec's training takes at most (epochs x steps per epoch, or max_steps)."""
    t = ctx.spec.training
    rows = ctx.result("convert").rows.get("train", 0)
    planned = t.epochs * max(1, rows // t.global_batch_size)
    return min(planned, t.rehearsal.max_steps) if t.rehearsal.max_steps else planned


def rehearsal_faults(ctx: RunContext, planned_steps: int) -> tuple:
    """The spec's rehearsal faults meant for this try: none unless rehearsal is on for this run (the
    `rehearsal` trigger parameter, or training.rehearsal.enabled), and none in a scheduled run unless
    training.rehearsal.scheduled says so."""
    r = ctx.spec.training.rehearsal
    if not r.faults:
        return ()
    if not r.enabled:
        ctx.log.info("rehearsal faults declared but off for this run (trigger with rehearsal: true to inject them)")
        return ()
    if ctx.run_id.startswith("scheduled__") and not r.scheduled:
        ctx.log.warning("rehearsal is on, but this is a scheduled run: no faults (training.rehearsal.scheduled)")
        return ()
    for i, f in enumerate(r.faults):
        if f.step is not None and f.step > planned_steps:
            raise SpecError(f"{ctx.spec_file or ctx.spec.name}: training.rehearsal.faults[{i}].step: {f.step} is past the end of"
                            f" training ({planned_steps} steps planned); the fault would never fire")
    faults = tuple(f for f in r.faults if f.on_try in (None, ctx.try_number))
    for f in faults:
        when = f"step {f.step}" if f.step is not None else f"{f.seconds:g}s in"
        ctx.log.warning("rehearsal: injecting %s at %s on %s in try %d", f.kind, when,
                        f"rank {f.rank}" if f.rank is not None else "every rank", ctx.try_number)
    return faults


def _warm_start(ctx: RunContext, ckpt_dir: Path, manifest: dict | None = None) -> str | None:
    """With evaluation.warm_start, the last published model's weights (when there is no checkpoint to
    resume: a resume always wins); its model must be the one this spec trains."""
    from ballast.training import checkpoint as ckpt
    from ballast.training.config.run import ModelConfig

    if not ctx.spec.evaluation.warm_start or ckpt.committed(ckpt_dir) or (ctx.round or 1) > 1:
        return None
    from ballast.storage import models as registry

    published = registry.latest(ctx)
    if published is None:
        ctx.log.info("evaluation.warm_start: %s has published no model yet; starting from scratch", ctx.spec.name)
        return None
    ours = run_config_model(ctx, manifest)
    theirs = ModelConfig.model_validate(published.model_section).model_dump(mode="json")
    fields = ("name", "options", "data")
    if any(ours[k] != theirs[k] for k in fields):
        diff = ", ".join(f"{k} {theirs[k]!r} vs {ours[k]!r}" for k in fields if theirs[k] != ours[k])
        raise ConfigError(f"{ctx.spec_file or ctx.spec.name}: evaluation.warm_start: the published model"
                          f" {published.version} is another model than this spec trains ({diff}); set"
                          f" warm_start: false for this change, or train the published architecture")
    path = registry.weights(ctx, published, ctx.work_dir / "warm_start")
    ctx.log.info("warm start from the published model %s (%s)", published.version, path)
    return str(path)


def run_config_model(ctx: RunContext, manifest: dict | None = None) -> dict:
    """The spec's model section as the trainer would build it ({name, options, data})."""
    cfg = run_config(ctx.spec, data_dir=".", data_format=ctx.spec.train_format, checkpoint_dir=".", output_dir=".",
                     manifest=manifest)
    return cfg.model.model_dump(mode="json")


def dataset_manifest(cache_dir: str) -> dict:
    """The packed dataset's manifest (what conversion found: a language model's tokenizer)."""
    from ballast.training.dataset.format import read_manifest

    return read_manifest(Path(cache_dir))


def _archive_failure_record(out_dir: Path) -> None:
    from ballast.training.failure import RECORD_NAME, read_record

    prev = read_record(out_dir)
    if prev is not None:  # the earlier try's records, kept beside the next one's
        stamp = int(prev["time"])
        os.replace(out_dir / RECORD_NAME, out_dir / f"failure-{stamp}.json")
        for other in out_dir.glob("failure-rank*.json"):
            os.replace(other, out_dir / f"failure-{stamp}-{other.name.removeprefix('failure-')}")


def _run_config(ctx: RunContext, cache, out_dir: Path, ckpt_dir: Path, micro: int):
    spec = ctx.spec
    manifest = dataset_manifest(cache.cache_dir)
    return run_config(spec, data_dir=cache.cache_dir, data_format=cache.format, checkpoint_dir=str(ckpt_dir),
                      output_dir=str(out_dir), micro_batch_size=micro,
                      data_wait_seconds=spec.cache.wait_seconds if cache.pending_phases else 0.0,
                      faults=rehearsal_faults(ctx, steps_planned(ctx)),
                      epochs=ctx.round * spec.training.epochs_per_round if ctx.round else None,
                      init_weights=_warm_start(ctx, ckpt_dir, manifest), identity=_identity(ctx), manifest=manifest)


def _identity(ctx: RunContext):
    """Who this try trains for (its metrics' labels), and its task's failed tries before it by class."""
    from ballast.training.config.run import RunIdentity

    failed: dict[str, int] = {}
    for a in history.load(ctx, ctx.task_id or "train").attempts:
        if a.try_number < ctx.try_number and a.outcome == "failed":
            failed[a.failure_class or "unknown"] = failed.get(a.failure_class or "unknown", 0) + 1
    return RunIdentity(pipeline=ctx.spec.name, run=ctx.run_id, try_number=ctx.try_number, failures_before=failed)


def _train(ctx: RunContext, cache, out_dir: Path, ckpt_dir: Path, settings: adapt.TrySettings) -> TrainResult:
    """This try's training, on the spec's backend through the one driver (`ballast.stages.train_try`)."""
    from ballast.stages import train_try

    cfg = _run_config(ctx, cache, out_dir, ckpt_dir, settings.micro_batch_size)
    return train_try.run(ctx, cache, cfg, out_dir, ckpt_dir, settings)
