"""Stage 4: distributed training through torchrun, resuming from the latest committed checkpoint.

Each try reads the previous try's failure record (training/failure.py) and adapts: after an
out-of-memory failure the micro-batch shrinks by `recovery.oom_micro_batch_factor` while the global
batch stays fixed. A training process that shows no progress for `execution.hang_timeout_seconds` is
ended and reported as a hang. Failures a retry cannot fix (bad config, bad data, a bug) fail the task
without retrying.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from ballast.context import RunContext
from ballast.errors import LaunchError, training_error
from ballast.launch_spec import adapt_micro_batch, run_config, torchrun_argv
from ballast.records import BestValidation, TrainResult
from ballast.supervise import supervise


def run(ctx: RunContext) -> TrainResult:
    from training.failure import read_record

    spec = ctx.spec
    cache = ctx.result("warm_cache")
    work = ctx.work_dir
    out_dir, ckpt_dir = work / "train", work / "checkpoints"
    out_dir.mkdir(parents=True, exist_ok=True)

    # Adapt to the previous try's failure.
    state_file = out_dir / "adapt.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    micro = state.get("micro_batch_size", spec.training.micro_batch_size)
    prev = read_record(out_dir)
    if prev is not None:
        ctx.log.warning("previous try failed: %s (class %s, rank %s, step %s)", prev["exception"], prev["class"],
                        prev["rank"], prev["step"])
        if prev["class"] == "oom":
            smaller = adapt_micro_batch(spec, micro, spec.recovery.oom_micro_batch_factor)
            ctx.log.warning("out of memory last time: micro-batch %d -> %d (global batch %d kept)", micro, smaller,
                            spec.training.global_batch_size)
            micro = smaller
        os.replace(out_dir / "failure.json", out_dir / f"failure-{int(prev['time'])}.json")
    state_file.write_text(json.dumps({"micro_batch_size": micro}))

    cfg = run_config(spec, data_dir=cache.cache_dir, data_format=cache.format, checkpoint_dir=str(ckpt_dir),
                     output_dir=str(out_dir), micro_batch_size=micro,
                     data_wait_seconds=spec.cache.wait_seconds if cache.pending_phases else 0.0)
    config_path = out_dir / "run.json"
    cfg.dump(config_path)
    argv = torchrun_argv(spec, config_path, run_id=f"{ctx.dag_id}-{ctx.run_id}")
    ctx.log.info("launching: %s", " ".join(argv))
    # The trainer's own watchdog (same timeout) fires first and classifies the hang; this outer guard
    # catches what it cannot see, such as a group stuck in rendezvous before the first step.
    warmer = _Warmer(ctx) if cache.pending_phases else None
    try:
        rc, hung = supervise(argv, out_dir, ctx, hang_timeout=spec.execution.hang_timeout_seconds + 60,
                              abort=(lambda: warmer.error) if warmer else None)
    finally:
        if warmer:
            warmer.join()
    if warmer and warmer.error:
        raise warmer.error  # a damaged shard or a full disk: training could not have finished on this cache
    if rc != 0:
        record = read_record(out_dir)
        if hung:
            raise LaunchError(f"training hung: no progress for {spec.execution.hang_timeout_seconds:.0f}s;"
                              f" ended (execution.hang_timeout_seconds)", failure_class="hang")
        if record is None:
            raise LaunchError(f"torchrun exited {rc} without a failure record (killed? see the log above)",
                              failure_class="unknown")
        cls = record["class"]
        raise training_error(f"training failed on rank {record['rank']} at step {record['step']}:"
                             f" {record['exception']} (class {cls}, exit code {record['exit_code']})", cls)
    summary = json.loads((out_dir / "summary.json").read_text())
    uploaded = upload_checkpoints(ctx, ckpt_dir)
    best = BestValidation.model_validate(summary["best"]) if summary["best"] else None
    ctx.log.info("training done: %d epochs, %d steps, best val %s %.4f at step %s%s", summary["epochs"],
                 summary["steps"], spec.evaluation.metric, best.value if best else float("nan"),
                 best.step if best else None, " (stopped early)" if summary["stopped_early"] else "")
    return TrainResult(summary=str(out_dir / "summary.json"), checkpoint_dir=str(ckpt_dir),
                       best_checkpoint=summary["best_checkpoint"], last_checkpoint=summary["last_checkpoint"],
                       epochs=summary["epochs"], steps=summary["steps"], stopped_early=summary["stopped_early"],
                       best=best, micro_batch_size=micro, uploaded_checkpoints=uploaded)


def upload_checkpoints(ctx: RunContext, ckpt_dir: Path) -> list[str]:
    """Copy committed checkpoints to remote storage (nothing to do when storage is this disk).

    Per checkpoint the files go first, then manifest.json, then COMMITTED: a reader of the storage copy
    applies the same predicate as on local disk.
    """
    from training import checkpoint as ckpt

    if ctx.storage.local_path(ctx.run_key) is not None:
        return []
    done = []
    for path in ckpt.committed(ckpt_dir):
        prefix = f"{ctx.run_key}/checkpoints/{path.name}"
        if ctx.storage.exists(f"{prefix}/{ckpt.COMMIT_MARKER}"):
            continue
        files = sorted(p.name for p in path.iterdir() if p.is_file())
        order = [f for f in files if f not in (ckpt.MANIFEST, ckpt.COMMIT_MARKER)] + [ckpt.MANIFEST, ckpt.COMMIT_MARKER]
        for name in order:
            ctx.storage.upload(path / name, f"{prefix}/{name}")
        done.append(ctx.storage.describe(prefix))
        ctx.log.info("checkpoint uploaded: %s", ctx.storage.describe(prefix))
    return done


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
