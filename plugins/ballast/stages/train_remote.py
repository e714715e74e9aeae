"""The train stage's try on a cluster backend (Slurm, Kubernetes): the try's job file to storage, the
job started and followed through the one driver (`ballast.backends.driver`), its outcome read back.

The nodes warm their own caches and train (`ballast.node`); their failure record and summary reach the
task through storage (on a shared file system they are written where the task reads them). How the
try ended is decided as a local try's is, by `training.failure_patterns.classify_exit`, which also weighs
the platform's reason where it has one (OOMKilled, a preemption, a node failure).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from ballast.backends import Ending, driver, job_key, job_ref, launch_for
from ballast.context import RunContext
from ballast.errors import Cancelled, training_error
from ballast.node import NodeJob, outputs_prefix
from ballast.records import TrainResult
from ballast.recovery.adapt import TrySettings

TAIL_LINES = 200


def train_remote(ctx: RunContext, cfg, out_dir: Path, ckpt_dir: Path, settings: TrySettings) -> TrainResult:
    from ballast import checkpoint_sync
    from ballast.stages.train import failure, result
    from ballast.training.failure import read_record
    from ballast.training.failure_patterns import classify_exit

    spec = ctx.spec
    shared = ctx.storage.local_path(ctx.run_key) is not None
    root = getattr(ctx.storage, "root", None) if shared else None  # a LocalStorage: its directory
    launch = launch_for(spec, settings, dag_id=ctx.dag_id, run_id=ctx.run_id, task_id=ctx.task_id or "train",
                        try_number=ctx.try_number, job_ref=job_ref(ctx, ctx.try_number),
                        python=spec.execution.slurm.python if spec.execution.slurm else "python",
                        shared_path=str(root) if root is not None else None)
    data = spec.model_dump(mode="json")
    if root is not None:  # the path as the workers resolve it: the nodes see the same file system there
        data["storage"] = {**data["storage"], "uri": str(root)}
    elif data["storage"].get("conn_id"):
        # A node has no Airflow connections: its backend gives it S3's credentials in its environment
        # (Slurm: the connection's; Kubernetes: execution.kubernetes.storage_secret).
        data["storage"] = {**data["storage"], "conn_id": None}
    job = NodeJob(spec=data, spec_file=ctx.spec_file, dag_id=ctx.dag_id, run_id=ctx.run_id,
                  task_id=ctx.task_id or "train", try_number=ctx.try_number, name=launch.name,
                  run_config=cfg.model_dump(mode="json"), out_dir=str(out_dir), checkpoint_dir=str(ckpt_dir))
    ctx.storage.write_bytes(job_key(ctx.run_key, ctx.try_number), job.model_dump_json(indent=1).encode())
    backend = driver.backend_for(spec, out_dir, ctx.log)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    end = driver.run(backend, launch, out_dir, ctx.log, hang_timeout=spec.execution.hang_timeout_seconds + 60,
                     heartbeat=shared, tail=tail)
    hung = end.hung
    if not shared:
        _fetch_outputs(ctx, out_dir)
        from ballast.outputs_sync import copy_outputs

        copy_outputs(ctx, out_dir)  # where the stability view reads them
    if end.cancelled:
        raise Cancelled(f"training cancelled ({spec.execution.backend} job {launch.name}: {end.reason})")
    if end.ok:
        # The stages after training (verify, evaluate) read the checkpoints here, as after a local try.
        pulled = [] if shared else checkpoint_sync.pull(ctx, ckpt_dir)
        return result(ctx, cfg, out_dir, ckpt_dir,
                      uploaded=[ctx.storage.describe(f"{ctx.run_key}/checkpoints/{n}") for n in pulled])
    record = read_record(out_dir)
    rc, log_tail = end.exit_code if end.exit_code is not None else 1, "\n".join(tail)
    # The one classification (training.failure_patterns.classify_exit) weighs the platform's ending
    # against the record and the log; when the platform's word decides, the message names the job.
    outcome = classify_exit(rc, record=record, log_tail=log_tail, hung=hung, platform_class=end.failure_class,
                            platform_reason=end.reason)
    if outcome.by == "platform":
        raise platform_failure(spec, end, launch.name)
    err = failure(spec, rc, record, log_tail, hung=hung, cancelled=False)
    if getattr(err, "host", None) is None:
        err.host = end.host  # the node the platform reports, for the avoid list
    raise err


def platform_failure(spec, end: Ending, name: str) -> BaseException:
    """The error of a try the platform ended (classify_exit decided by its reason): preempted, OOM-killed,
    a node lost."""
    err = training_error(f"{spec.execution.backend} job {name} ended: {end.reason} (class {end.failure_class};"
                         f" exit code {end.exit_code}; node {end.host})", end.failure_class)
    err.exit_code, err.host, err.step = end.exit_code, end.host, None
    return err


def _fetch_outputs(ctx: RunContext, out_dir: Path) -> None:
    """The node's failure record(s) and summary, from storage into the task's `out_dir`."""
    prefix = outputs_prefix(ctx.run_key, ctx.try_number)
    for key in ctx.storage.list(prefix):
        name = key[len(prefix):]
        if "/" not in name and name.endswith((".json", ".jsonl")):
            ctx.storage.download(key, out_dir / name)
