"""What each node of a cluster try runs (a Kubernetes pod, a Slurm task): `python -m ballast.node --job REF`.

The train task writes the try's job file (`NodeJob`: the effective spec, the run's identity, the run
config) to the pipeline's storage. The run config is the only carrier of the trainer's settings to a
node, recovery's adaptations (a smaller micro-batch after an out-of-memory failure) included: a node
changes only its directories (`node_config`). Each node then, on its own:

1. warms its node-local cache from storage: the same staged, verified warm-up as on the worker
   (`ballast.stages.warm_cache.warm`), every stage before training starts;
2. finds the checkpoints: with a shared file system (storage is a path every node sees, as on a Slurm
   cluster) training commits straight into the run's checkpoint directory; with object storage the
   node pulls the checkpoint it resumes from (only that one; with several nodes, without its shard
   files, which its ranks fetch with `--fetch` as they plan their loads) and pushes each newly
   committed one back (files, then manifest, then the COMMITTED marker; storage pruned to keep_last),
   while training runs and once it ends. With several nodes each node's directory holds its own ranks'
   files (`checkpoint.node_local`): every node pushes its share, and node 0 writes the manifest and
   the marker once every share is in storage (`ballast.storage.checkpoints.push`), waiting at most
   COMMIT_WAIT_SECONDS for the other nodes' last shares once training ended;
3. runs the torchrun launcher (`ballast.training.torchrun`) with the c10d rendezvous endpoint of node 0
   ($BALLAST_RDZV_ENDPOINT) and exits with its exit code, after its failure record and summary are in
   storage.

Its node rank comes from $BALLAST_NODE_RANK (a Job's completion index) or $SLURM_NODEID.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ballast.storage import cache_dir as cachedir
from ballast.storage import checkpoints as checkpoint_sync
from ballast.launch import NODE_RANK_ENV, RDZV_ENV

log = logging.getLogger("ballast.node")
SYNC_SECONDS = 10.0
COMMIT_WAIT_SECONDS = 60.0
"""How long node 0 waits, once training ended, for the other nodes' last shares before it gives up
committing those checkpoints in storage (never a marker over a missing shard)."""


class NodeJob(BaseModel):
    """One try's instructions to every node (`train/try-N/job.json` in the run's storage)."""

    spec: dict[str, Any]
    spec_file: str = ""
    dag_id: str
    run_id: str
    task_id: str
    try_number: int
    name: str
    run_config: dict[str, Any]
    """The trainer's RunConfig; its directories are the worker's, replaced on the node where storage is remote."""
    out_dir: str
    checkpoint_dir: str


def node_rank() -> int:
    return int(os.environ.get(NODE_RANK_ENV) or os.environ.get("SLURM_NODEID") or 0)


def node_name() -> str:
    return os.environ.get("BALLAST_NODE_NAME") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _read_job(ref: str) -> NodeJob:
    from ballast.storage import open_storage

    if "://" in ref:
        root, _, key = ref.partition("://")[2].partition("/")
        bucket_uri = f"s3://{root}"
        storage = open_storage(bucket_uri, None)
        return NodeJob.model_validate_json(storage.read_bytes(key))
    return NodeJob.model_validate_json(Path(ref).read_bytes())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ballast.node", description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True, help="the try's job file: a path, or s3://bucket/key")
    p.add_argument("--fetch", nargs="+", metavar="ARG",
                   help="DIRECTORY NAME...: copy these files of the node-local checkpoint DIRECTORY from storage"
                        " (what the node's ranks run when they resume; `checkpoint.fetch`), then exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[node %(rank)s] %(message)s")
    rank = node_rank()
    logging.getLogger().handlers[0].addFilter(_RankFilter(rank))
    from ballast.errors import BallastError

    try:
        if args.fetch:
            return fetch(_read_job(args.job), Path(args.fetch[0]), args.fetch[1:])
        return run(_read_job(args.job), rank, job_ref=args.job)
    except BallastError as exc:
        log.error("%s", exc)
        from ballast.training.failure import EXIT_CODES

        return EXIT_CODES["config"] if getattr(exc, "failure_class", "config") == "config" else 1


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def _context(job: NodeJob, spec: Any = None) -> Any:
    from ballast.pipeline.context import RunContext
    from ballast.spec import Spec

    return RunContext(spec=spec or Spec.model_validate(job.spec), dag_id=job.dag_id, run_id=job.run_id,
                      try_number=job.try_number, log=log, task_id=job.task_id, spec_file=job.spec_file)


def fetch(job: NodeJob, directory: Path, names: list[str]) -> int:
    """`--fetch DIRECTORY NAME...`: the named files of a node-local checkpoint, from the run's storage."""
    import time

    t0 = time.monotonic()
    copied = checkpoint_sync.fetch(_context(job), directory, names)
    log.info("fetched %d file(s), %.1f MiB, of %s from storage in %.2fs", len(names), copied / 2**20,
             directory.name, time.monotonic() - t0)
    return 0


def run(job: NodeJob, rank: int, *, job_ref: str | None = None) -> int:
    from ballast.launch.config import torchrun_argv
    from ballast.spec import Spec
    from ballast.stages.warm_cache import dataset_dir, warm
    from ballast.storage import ballast_home

    data = dict(job.spec)
    host = node_name()
    # The node-local cache: $BALLAST_CACHE_DIR (a pod's cache volume), the spec's cache directory or the
    # default one, always in a directory of this node's own: nodes that share a disk (or the worker's
    # cache) never warm one directory at once (two nodes fetching one file into one .part file: CI).
    base = os.environ.get("BALLAST_CACHE_DIR") or (data.get("cache") or {}).get("directory") \
        or str(ballast_home() / "cache")
    data["cache"] = {**(data.get("cache") or {}), "directory": str(Path(base) / f"node-{host}")}
    spec = Spec.model_validate(data)
    ctx = _context(job, spec)
    log.info("node %d of %d on %s: try %d of %s", rank, spec.training.nodes, host, job.try_number, job.dag_id)
    cachedir.hold(dataset_dir(ctx))  # from its warm-up to the end of training: no other run's warm-up evicts it
    cache = warm(ctx, list(range(len(spec.cache.phases))), record_progress=False)
    shared = ctx.storage.local_path(ctx.run_key) is not None
    node_local = not shared and spec.training.nodes > 1  # this node's own checkpoint directory, one of several
    fetch_argv = [sys.executable, "-m", "ballast.node", "--job", job_ref, "--fetch"] if node_local and job_ref else None
    if shared:
        out_dir, ckpt_dir = Path(job.out_dir), Path(job.checkpoint_dir)
    else:
        # A directory of this try's own, as a pod's fresh volume is: what it resumes from is what storage holds.
        work = Path(os.environ.get("BALLAST_WORK_DIR") or ctx.work_dir) / f"try-{job.try_number}-node{rank}"
        out_dir, ckpt_dir = work / "train", work / "checkpoints"
        out_dir.mkdir(parents=True, exist_ok=True)
        fetched = fetch_argv is not None  # shard files: fetched by the ranks that read them
        pulled = checkpoint_sync.pull_for_resume(ctx, ckpt_dir, shards=not fetched)
        log.info("checkpoints from storage: %s (what this node resumes from, no more%s)", ", ".join(pulled) or "none",
                 "; its shard files as this node's ranks read them" if fetched else "")
        pulled_history = pull_history(ctx, out_dir)  # on every node: global rank 0 may be on any of them
    config_path = out_dir / f"run-node{rank}.json"
    node_config(job, out_dir=out_dir, checkpoint_dir=ckpt_dir, data_dir=cache.cache_dir, data_format=cache.format,
                node_local=node_local, fetch=fetch_argv).dump(config_path)
    argv = torchrun_argv(spec, config_path, rdzv_endpoint=os.environ.get(RDZV_ENV), run_id=job.name)
    log.info("launching: %s", " ".join(argv))
    env = {**os.environ, "BALLAST_HOST": host}
    proc = subprocess.Popen(argv, env=env)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))  # a preemption notice reaches the ranks
    syncer = None if shared else _Syncer(ctx, ckpt_dir, rank)
    rc = proc.wait()
    if syncer is not None:
        syncer.stop()
        finish(ctx, out_dir, ckpt_dir, node=rank, pulled_history=pulled_history)
    log.info("launcher exited %d", rc)
    return rc


def node_config(job: NodeJob, *, out_dir: Path, checkpoint_dir: Path, data_dir: str, data_format: str,
                node_local: bool = False, fetch: list[str] | None = None):
    """The job's run config with this node's directories (and the format its cache holds; `node_local`:
    the checkpoint directory is this node's own, one of several, and `fetch` the command its ranks copy
    checkpoint files from storage with): every setting, the try's adapted micro-batch included, is the
    one the train task wrote; nothing in the node's environment changes it."""
    from ballast.training.config.run import RunConfig

    cfg = RunConfig.model_validate(job.run_config)
    return cfg.model_copy(update={
        "output_dir": str(out_dir),
        "data": cfg.data.model_copy(update={"directory": data_dir, "format": data_format}),
        "checkpoint": cfg.checkpoint.model_copy(update={"directory": str(checkpoint_dir), "node_local": node_local,
                                                        "fetch": fetch})})


def outputs_prefix(run_key: str, try_number: int, node: int | None = None) -> str:
    """Where a try's nodes leave the trainer's failure record(s), summary and events (one try's own;
    each node under `node<k>/`: global rank 0, which writes the summary and events, is on whichever
    node torchrun's rendezvous ranks first, and every node may hold a failure record)."""
    prefix = f"{run_key}/train/try-{try_number}/out/"
    return prefix if node is None else f"{prefix}node{node}/"


def pull_history(ctx, out_dir: Path) -> dict[str, tuple[int, int]]:
    """The run's curve history so far (`training.curves`, bounded whatever the run's length), so that this
    try's rank 0 goes on with it rather than start the view's whole-run curves again. Not the event log:
    it grows with the run, and the view reads each try's own. What was pulled, by name: (size, mtime_ns),
    so that a node whose ranks did not write it (rank 0 ran elsewhere) does not push it back."""
    from ballast.training.curves import CURVES

    key, local = f"{ctx.run_key}/train/{CURVES}", out_dir / CURVES
    try:
        if ctx.storage.exists(key):
            ctx.storage.download(key, local)
            st = local.stat()
            return {CURVES: (st.st_size, st.st_mtime_ns)}
    except Exception as exc:  # the history is for the view: training goes on without it
        log.warning("could not pull the curve history %s: %s", ctx.storage.describe(key), exc)
    return {}


def finish(ctx, out_dir: Path, ckpt_dir: Path, *, node: int, pulled_history: dict[str, tuple[int, int]]) -> None:
    """Once training ended on this node: its outputs to storage, then its last checkpoint shares (node 0:
    the commits, waiting up to COMMIT_WAIT_SECONDS for the other nodes' shares). The outputs go first, a
    few small files: when a rank on another node failed, Slurm (srun --kill-on-bad-exit) kills this
    agent KillWait after that node's agent exited, which node 0's wait can outlast; pushed after it,
    rank 0's events and curve history were lost with the kill now and then."""
    push_outputs(ctx, out_dir, node=node, unchanged=pulled_history)
    checkpoint_sync.push(ctx, ckpt_dir, node=node, wait=COMMIT_WAIT_SECONDS if node == 0 else 0.0)


def push_outputs(ctx, out_dir: Path, *, node: int, unchanged: dict[str, tuple[int, int]] | None = None) -> None:
    """This node's trainer outputs (failure records; where global rank 0 ran, the summary, events and
    curve history), where the train task reads them (`stages.train_try`, which merges the nodes').
    `unchanged`: files pulled before training, (size, mtime_ns), left out while still as pulled."""
    for path in sorted(out_dir.iterdir()):
        if path.is_file() and path.suffix in (".json", ".jsonl"):
            st = path.stat()
            if (unchanged or {}).get(path.name) == (st.st_size, st.st_mtime_ns):
                continue  # pulled, and no rank here wrote it
            ctx.storage.upload(path, outputs_prefix(ctx.run_key, ctx.try_number, node) + path.name)


class _Syncer(threading.Thread):
    def __init__(self, ctx, ckpt_dir: Path, node: int):
        super().__init__(name="checkpoint-sync", daemon=True)
        self.ctx, self.ckpt_dir, self.node, self._done = ctx, ckpt_dir, node, threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.wait(SYNC_SECONDS):
            try:
                checkpoint_sync.push(self.ctx, self.ckpt_dir, node=self.node)
            except Exception as exc:  # noqa: BLE001  (the next round, or the final push, tries again)
                log.warning("checkpoint upload failed (will retry): %s", exc)

    def stop(self) -> None:
        self._done.set()
        self.join()


if __name__ == "__main__":
    sys.exit(main())
