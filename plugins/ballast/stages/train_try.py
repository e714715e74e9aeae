"""One try of the train stage on any backend: its launch, run by the one driver
(`ballast.launch.driver`), and its outcome read back into a train record or the error it ends with.

Where the trainers run decides only what is in the launch and where their outputs are read: on this
worker (`local`) the launch is torchrun over the run config in `out_dir`, the ranks write there, are
listed for Prometheus, and are ended when the background cache warm-up fails; on a cluster (Slurm,
Kubernetes) it is `ballast.node` on every node with the try's job file in storage, the nodes warm caches
of their own, and their failure record and summary reach `out_dir` through storage (on a shared file
system they are written there). How the try ended is decided for every backend alike by
`training.failure_patterns.classify_exit`, which also weighs the platform's reason where it has one
(OOMKilled, a preemption, a node failure).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from pathlib import Path

from ballast.launch import Ending, Launch, driver, job_key, job_name, job_ref, launch_for
from ballast.pipeline.context import RunContext
from ballast.errors import Cancelled, training_error
from ballast.launch.config import torchrun_argv
from ballast.node import outputs_prefix
from ballast.records import BestValidation, TrainResult
from ballast.recovery.adapt import TrySettings

TAIL_LINES = 200  # torchrun's last lines, read for known error messages when a try fails


def run(ctx: RunContext, cache, cfg, out_dir: Path, ckpt_dir: Path, settings: TrySettings) -> TrainResult:
    """Train this try on the spec's backend; its train record, or the error it failed with."""
    from ballast.training.failure import read_record
    from ballast.training.failure_patterns import classify_exit

    spec = ctx.spec
    backend = driver.backend_for(spec, out_dir, ctx.log)
    here = backend.name == "local"  # the trainers run on this worker, in `out_dir`
    shared = ctx.storage.local_path(ctx.run_key) is not None
    launch = _launch_here(ctx, cfg, out_dir) if here else _launch_on_nodes(ctx, cfg, out_dir, ckpt_dir, settings)
    # Here, the trainers read this worker's cache: its warm-up failing ends them. A cluster's nodes warm
    # caches of their own; this worker warms the rest of its cache beside the job, for the stages after
    # training that read it here (verify's probe, evaluate's test split).
    warmer = _Warmer(ctx) if cache.pending_phases else None
    stop = (lambda: warmer.error and f"the cache warm-up failed ({warmer.error})") if warmer and here else None
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    targets = uploader = None
    try:
        if here:
            targets = _publish_targets(ctx, out_dir)
            if not shared:  # S3: the stability view reads progress from storage
                from ballast.storage.outputs import OutputsUpload

                uploader = OutputsUpload(ctx, out_dir)
                uploader.start()
        # The trainer's own watchdog (same timeout) fires first and classifies the hang; the driver's
        # guard catches what it cannot see, such as a group stuck in rendezvous before the first step.
        end = driver.run(backend, launch, out_dir, ctx.log, hang_timeout=spec.execution.hang_timeout_seconds + 60,
                         heartbeat=here or shared, tail=tail, should_stop=stop)
    finally:
        if uploader is not None:
            uploader.finish()
        if targets is not None:
            from ballast.launch import prometheus_sd

            prometheus_sd.withdraw(targets)
        if warmer:
            warmer.join()
    if not here and not shared:
        _fetch_outputs(ctx, out_dir)
        from ballast.storage.outputs import copy_outputs

        copy_outputs(ctx, out_dir)  # where the stability view reads them
    if warmer and warmer.error and here:
        raise warmer.error  # a damaged shard or a full disk: training could not have finished on this cache
    if end.cancelled:
        raise Cancelled(f"training cancelled ({spec.execution.backend} job {launch.name}: {end.reason})")
    if end.ok:
        if warmer and warmer.error:
            raise warmer.error  # the stages after training read this worker's cache
        if here:
            uploaded = upload_checkpoints(ctx, ckpt_dir)
        else:  # the stages after training (verify, evaluate) read the checkpoints here, as after a local try
            from ballast.storage import checkpoints as checkpoint_sync

            pulled = [] if shared else checkpoint_sync.pull(ctx, ckpt_dir)
            uploaded = [ctx.storage.describe(f"{ctx.run_key}/checkpoints/{n}") for n in pulled]
        return result(ctx, cfg, out_dir, ckpt_dir, uploaded=uploaded)
    record = read_record(out_dir)
    rc, log_tail = end.exit_code if end.exit_code is not None else 1, "\n".join(tail)
    # The one classification (training.failure_patterns.classify_exit) weighs the platform's ending
    # against the record and the log; when the platform's word decides, the message names the job.
    outcome = classify_exit(rc, record=record, log_tail=log_tail, hung=end.hung, platform_class=end.failure_class,
                            platform_reason=end.reason)
    if outcome.by == "platform":
        raise platform_failure(spec, end, launch.name)
    err = failure(spec, rc, record, log_tail, hung=end.hung, cancelled=False)
    if getattr(err, "host", None) is None and not here:
        err.host = end.host  # the node the platform reports, for the avoid list
    raise err


def _launch_here(ctx: RunContext, cfg, out_dir: Path) -> Launch:
    """torchrun on this worker over the run config in `out_dir` (the adapted micro-batch is in it)."""
    config_path = out_dir / "run.json"
    cfg.dump(config_path)
    argv = torchrun_argv(ctx.spec, config_path, run_id=f"{ctx.dag_id}-{ctx.run_id}")
    ctx.log.info("launching: %s", " ".join(argv))
    return Launch(name=job_name(ctx.dag_id, ctx.run_id, ctx.try_number), try_number=ctx.try_number, nodes=1,
                  command=tuple(argv))


def _launch_on_nodes(ctx: RunContext, cfg, out_dir: Path, ckpt_dir: Path, settings: TrySettings) -> Launch:
    """`ballast.node` on every node of a cluster try, with the try's job file (the effective spec and run
    config) written to storage first."""
    from ballast.node import NodeJob

    spec = ctx.spec
    shared = ctx.storage.local_path(ctx.run_key) is not None
    root = getattr(ctx.storage, "root", None) if shared else None  # a FileStorage: its directory
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
    return launch


def platform_failure(spec, end: Ending, name: str) -> BaseException:
    """The error of a try the platform ended (classify_exit decided by its reason): preempted, OOM-killed,
    a node lost."""
    err = training_error(f"{spec.execution.backend} job {name} ended: {end.reason} (class {end.failure_class};"
                         f" exit code {end.exit_code}; node {end.host})", end.failure_class)
    err.exit_code, err.host, err.step = end.exit_code, end.host, None
    return err


def _fetch_outputs(ctx: RunContext, out_dir: Path) -> None:
    """The nodes' failure records, summary and events, from storage into the task's `out_dir`: each
    node's files as they are (rank 0's are on one node), except the failure records, where the first
    written on any node is `failure.json` and each other rank's is `failure-rank<R>.json`."""
    from ballast.training.outputs import FAILURE_RECORD, read_failure

    prefix = outputs_prefix(ctx.run_key, ctx.try_number)
    failures = []
    for key in ctx.storage.list(prefix):
        node, _, name = key[len(prefix):].partition("/")
        if not (node.startswith("node") and node[4:].isdigit() and name and "/" not in name
                and name.endswith((".json", ".jsonl"))):
            continue
        if name.startswith("failure"):
            staged = out_dir / f".{node}.{name}"
            ctx.storage.download(key, staged)
            failures.append(staged)
        else:
            ctx.storage.download(key, out_dir / name)
    records = [(r, f) for f in failures if (r := read_failure(f.parent, f.name)) is not None]
    for i, (record, staged) in enumerate(sorted(records, key=lambda rf: rf[0].time)):
        name = FAILURE_RECORD if i == 0 else f"failure-rank{record.rank}.json"
        os.replace(staged, out_dir / name)
    for staged in failures:
        staged.unlink(missing_ok=True)


def _publish_targets(ctx: RunContext, out_dir: Path) -> Path | None:
    """With execution.metrics_port, this try's rank endpoints in Prometheus' discovery directory, at the
    ports the ranks report in `out_dir` (a failure to write them is a warning: training does not depend
    on being watched)."""
    spec = ctx.spec
    if spec.execution.metrics_port is None:
        return None
    from ballast.launch import prometheus_sd

    try:
        return prometheus_sd.publish(pipeline=spec.name, dag_id=ctx.dag_id, run_id=ctx.run_id,
                                     try_number=ctx.try_number, port=spec.execution.metrics_port,
                                     ranks=spec.training.processes_per_node, out_dir=out_dir)
    except OSError as exc:
        ctx.log.warning("could not list the ranks for Prometheus in %s: %s", prometheus_sd.sd_dir(), exc)
        return None


def result(ctx: RunContext, cfg, out_dir: Path, ckpt_dir: Path, *, uploaded: list[str]) -> TrainResult:
    """The train record of a try that trained to the end (its summary in `out_dir`)."""
    from ballast.training.outputs import SUMMARY, read_summary

    spec = ctx.spec
    summary = read_summary(out_dir)
    best = BestValidation.model_validate(summary.best) if summary.best else None
    ctx.log.info("training done: %d epochs, %d steps, best val %s %.4f at step %s%s", summary.epochs,
                 summary.steps, spec.evaluation.metric, best.value if best else float("nan"),
                 best.step if best else None, " (stopped early)" if summary.stopped_early else "")
    init = cfg.checkpoint.init_weights
    return TrainResult(summary=str(out_dir / SUMMARY), checkpoint_dir=str(ckpt_dir),
                       best_checkpoint=summary.best_checkpoint, last_checkpoint=summary.last_checkpoint,
                       epochs=summary.epochs, steps=summary.steps, stopped_early=summary.stopped_early,
                       best=best, micro_batch_size=cfg.batch.micro_batch_size, uploaded_checkpoints=uploaded,
                       warm_started_from=Path(init).stem if init else _warmed_before(ctx))


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
    from ballast.storage import checkpoints as checkpoint_sync

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


def _warmed_before(ctx: RunContext) -> str | None:
    """An earlier try or round started from a published model: training still descends from it."""
    where = ctx.work_dir / "warm_start"
    found = sorted(p for p in where.iterdir() if p.suffix in (".safetensors", ".pt")) if where.is_dir() else []
    return found[-1].stem if found else None
