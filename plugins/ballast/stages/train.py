"""Stage 4: distributed training through torchrun, resuming from the newest checkpoint that passes
the verification gate.

A try begins by ending whatever an earlier try of this task left running (its lease), completing that
try's record if it was killed before writing it, and adapting to the tries before it
(`ballast.recovery.adapt`: a smaller micro-batch after out-of-memory, the on-demand pool after
preemptions, an avoid list after a host's failure). It records itself in the attempt history
(`ballast.recovery.history`) when it starts and when it ends. A training process that shows no
progress for `execution.hang_timeout_seconds` is ended and reported as a hang. Whether a failure gets
a new try is the recovery policy's call (`ballast.recovery.policy`, per failure class).
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from pathlib import Path

from ballast import cachedir
from ballast.context import RunContext
from ballast.errors import Cancelled, CheckpointError, ConfigError, LaunchError, SpecError, failure_class, training_error
from ballast.launch_spec import run_config, torchrun_argv
from ballast.records import BestValidation, RoundResult, TrainResult
from ballast.recovery import adapt, history
from ballast.recovery.policy import FAILURES_KEY, decide
from ballast.backends import Launch, driver, job_name


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
        return _try(ctx, cache, hist, settings, notes, out_dir, ckpt_dir)


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
    failures = dict(ctx.state.get(FAILURES_KEY) or {}) if ctx.state is not None else {}
    failures.setdefault(str(closed.try_number), closed.failure_class or "unknown")
    if ctx.state is not None:
        ctx.state.set(FAILURES_KEY, failures)
    decision = decide(ctx.spec.recovery, failures[str(closed.try_number)], failures,
                      try_number=closed.try_number, stage=ctx.task_id or "train")
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
    resume = gate.latest_passing(ckpt_dir, probe=held_out_probe(cache.cache_dir, cache.format), min_step=floor,
                                 log=ctx.log.warning)
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


def _warm_start(ctx: RunContext, ckpt_dir: Path) -> str | None:
    """With evaluation.warm_start, the last published model's weights (when there is no checkpoint to
    resume: a resume always wins); its model must be the one this spec trains."""
    from ballast.training import checkpoint as ckpt
    from ballast.training.config.run import ModelConfig

    if not ctx.spec.evaluation.warm_start or ckpt.committed(ckpt_dir) or (ctx.round or 1) > 1:
        return None
    from ballast import registry

    published = registry.latest(ctx)
    if published is None:
        ctx.log.info("evaluation.warm_start: %s has published no model yet; starting from scratch", ctx.spec.name)
        return None
    fields = ("model", "input_shape", "num_classes", "hidden_size")
    ours = run_config_model(ctx)
    theirs = ModelConfig.model_validate(published.model_section).model_dump(include=set(fields))
    if ours != theirs:
        diff = ", ".join(f"{k} {theirs.get(k)!r} vs {ours.get(k)!r}" for k in fields if theirs.get(k) != ours.get(k))
        raise ConfigError(f"{ctx.spec_file or ctx.spec.name}: evaluation.warm_start: the published model"
                          f" {published.version} is another model than this spec trains ({diff}); set"
                          f" warm_start: false for this change, or train the published architecture")
    path = registry.weights(ctx, published, ctx.work_dir / "warm_start")
    ctx.log.info("warm start from the published model %s (%s)", published.version, path)
    return str(path)


def _warmed_before(ctx: RunContext) -> str | None:
    """An earlier try or round started from a published model: training still descends from it."""
    found = sorted((ctx.work_dir / "warm_start").glob("*.pt")) if (ctx.work_dir / "warm_start").is_dir() else []
    return found[-1].stem if found else None


def run_config_model(ctx: RunContext) -> dict:
    """The spec's model section as the trainer would build it (model, input_shape, num_classes, hidden_size)."""
    cfg = run_config(ctx.spec, data_dir=".", data_format=ctx.spec.train_format, checkpoint_dir=".", output_dir=".")
    return cfg.model.model_dump(include={"model", "input_shape", "num_classes", "hidden_size"})


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
    return run_config(spec, data_dir=cache.cache_dir, data_format=cache.format, checkpoint_dir=str(ckpt_dir),
                      output_dir=str(out_dir), micro_batch_size=micro,
                      data_wait_seconds=spec.cache.wait_seconds if cache.pending_phases else 0.0,
                      faults=rehearsal_faults(ctx, steps_planned(ctx)),
                      epochs=ctx.round * spec.training.epochs_per_round if ctx.round else None,
                      init_weights=_warm_start(ctx, ckpt_dir), identity=_identity(ctx))


def _identity(ctx: RunContext):
    """Who this try trains for (its metrics' labels), and its task's failed tries before it by class."""
    from ballast.training.config.run import RunIdentity

    failed: dict[str, int] = {}
    for a in history.load(ctx, ctx.task_id or "train").attempts:
        if a.try_number < ctx.try_number and a.outcome == "failed":
            failed[a.failure_class or "unknown"] = failed.get(a.failure_class or "unknown", 0) + 1
    return RunIdentity(pipeline=ctx.spec.name, run=ctx.run_id, try_number=ctx.try_number, failures_before=failed)


def _train(ctx: RunContext, cache, out_dir: Path, ckpt_dir: Path, settings: adapt.TrySettings) -> TrainResult:
    from ballast.training.failure import read_record

    spec = ctx.spec
    micro = settings.micro_batch_size
    cfg = _run_config(ctx, cache, out_dir, ckpt_dir, micro)
    if spec.execution.backend != "local":
        from ballast.stages.train_remote import train_remote

        # The nodes warm caches of their own; this worker warms the rest of its cache beside the job, for
        # the stages after training that read it here (verify's probe, evaluate's test split).
        warmer = _Warmer(ctx) if cache.pending_phases else None
        try:
            trained = train_remote(ctx, cfg, out_dir, ckpt_dir, settings)
        finally:
            if warmer:
                warmer.join()
        if warmer and warmer.error:
            raise warmer.error
        return trained
    config_path = out_dir / "run.json"
    cfg.dump(config_path)
    argv = torchrun_argv(spec, config_path, run_id=f"{ctx.dag_id}-{ctx.run_id}")
    ctx.log.info("launching: %s", " ".join(argv))
    backend = driver.backend_for(spec, out_dir, ctx.log)
    launch = Launch(name=job_name(ctx.dag_id, ctx.run_id, ctx.try_number), try_number=ctx.try_number, nodes=1,
                    command=tuple(argv), micro_batch_size=micro)
    warmer = _Warmer(ctx) if cache.pending_phases else None
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    targets = uploader = None
    try:
        targets = _publish_targets(ctx, out_dir)
        if ctx.storage.local_path(ctx.run_key) is None:  # S3: the stability view reads progress from storage
            from ballast.outputs_sync import OutputsUpload

            uploader = OutputsUpload(ctx, out_dir)
            uploader.start()
        # The trainer's own watchdog (same timeout) fires first and classifies the hang; the driver's
        # guard catches what it cannot see, such as a group stuck in rendezvous before the first step.
        end = driver.run(backend, launch, out_dir, ctx.log, hang_timeout=spec.execution.hang_timeout_seconds + 60,
                         tail=tail, should_stop=(lambda: warmer.error and f"the cache warm-up failed ({warmer.error})")
                         if warmer else None)
    finally:
        if uploader is not None:
            uploader.finish()
        if targets is not None:
            from ballast import prometheus_sd

            prometheus_sd.withdraw(targets)
        if warmer:
            warmer.join()
    if warmer and warmer.error:
        raise warmer.error  # a damaged shard or a full disk: training could not have finished on this cache
    if end.exit_code != 0:
        raise failure(spec, end.exit_code, read_record(out_dir), "\n".join(tail), hung=end.hung,
                      cancelled=end.cancelled)
    return result(ctx, cfg, out_dir, ckpt_dir, uploaded=upload_checkpoints(ctx, ckpt_dir))


def _publish_targets(ctx: RunContext, out_dir: Path) -> Path | None:
    """With execution.metrics_port, this try's rank endpoints in Prometheus' discovery directory, at the
    ports the ranks report in `out_dir` (a failure to write them is a warning: training does not depend
    on being watched)."""
    spec = ctx.spec
    if spec.execution.metrics_port is None:
        return None
    from ballast import prometheus_sd

    try:
        return prometheus_sd.publish(pipeline=spec.name, dag_id=ctx.dag_id, run_id=ctx.run_id,
                                     try_number=ctx.try_number, port=spec.execution.metrics_port,
                                     ranks=spec.training.processes_per_node, out_dir=out_dir)
    except OSError as exc:
        ctx.log.warning("could not list the ranks for Prometheus in %s: %s", prometheus_sd.sd_dir(), exc)
        return None


def result(ctx: RunContext, cfg, out_dir: Path, ckpt_dir: Path, *, uploaded: list[str]) -> TrainResult:
    """The train record of a try that trained to the end (its summary in `out_dir`)."""
    spec = ctx.spec
    summary = json.loads((out_dir / "summary.json").read_text())
    best = BestValidation.model_validate(summary["best"]) if summary["best"] else None
    ctx.log.info("training done: %d epochs, %d steps, best val %s %.4f at step %s%s", summary["epochs"],
                 summary["steps"], spec.evaluation.metric, best.value if best else float("nan"),
                 best.step if best else None, " (stopped early)" if summary["stopped_early"] else "")
    init = cfg.checkpoint.init_weights
    return TrainResult(summary=str(out_dir / "summary.json"), checkpoint_dir=str(ckpt_dir),
                       best_checkpoint=summary["best_checkpoint"], last_checkpoint=summary["last_checkpoint"],
                       epochs=summary["epochs"], steps=summary["steps"], stopped_early=summary["stopped_early"],
                       best=best, micro_batch_size=cfg.batch.micro_batch_size, uploaded_checkpoints=uploaded,
                       warm_started_from=Path(init).stem if init else _warmed_before(ctx))


TAIL_LINES = 200  # torchrun's last lines, read for known error messages when a try fails


def failure(spec, rc: int, record: dict | None, log_tail: str, *, hung: bool, cancelled: bool) -> BaseException:
    """The error a failed try ends with: its class from the failure record, torchrun's exit and the
    log's last lines, through the one table of known messages (training.failure_patterns)."""
    from ballast.training.failure_patterns import CANCELLED, classify_exit

    outcome = classify_exit(rc, record=record, log_tail=log_tail, hung=hung, cancelled=cancelled)
    if outcome.failure_class == CANCELLED:
        return Cancelled(f"training cancelled (torchrun exit {rc})")
    if hung and record is None:
        message = (f"training hung: no progress for {spec.execution.hang_timeout_seconds:.0f}s; ended"
                   f" (execution.hang_timeout_seconds)")
    elif record is not None:
        message = (f"training failed on rank {record['rank']} at step {record['step']}: {record['exception']}"
                   f" (class {outcome.failure_class}: {outcome.reason}; exit code {record['exit_code']})")
    else:
        message = f"torchrun exited {rc}: {outcome.reason}" + (f" [{outcome.line.strip()}]" if outcome.line else "")
    err = training_error(message, outcome.failure_class)
    err.exit_code, err.host, err.step = rc, (record or {}).get("host"), (record or {}).get("step")  # for the record
    return err


def upload_checkpoints(ctx: RunContext, ckpt_dir: Path) -> list[str]:
    """Copy committed checkpoints to remote storage (nothing to do when storage is this disk)."""
    from ballast import checkpoint_sync

    return [] if ctx.storage.local_path(ctx.run_key) is not None else checkpoint_sync.push(ctx, ckpt_dir)


class _Warmer(threading.Thread):
    """The cache's later warm-up phases, warmed beside training on this node; `error` once it failed."""

    def __init__(self, ctx: RunContext):
        super().__init__(name="warm-cache-rest", daemon=True)
        self.ctx, self.error, self.result = ctx, None, None
        self.start()

    def run(self) -> None:
        from ballast.stages.warm_cache import warm_rest

        try:
            self.result = warm_rest(self.ctx)
        except BaseException as exc:  # noqa: BLE001  (reported by the train task)
            self.ctx.log.error("warming the rest of the cache failed: %s", exc)
            self.error = exc
