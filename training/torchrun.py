"""torchrun with the trainer preloaded: `python -m ballast.training.torchrun [torchrun options] --module ballast.training --config F`.

Same options, rendezvous and restart policy as `torchrun` (torch.distributed.run's own parser and
elastic agent), but workers are forked from a forkserver that imported torch and the trainer once.
A plain torchrun starts every worker, and every restarted worker, as a fresh interpreter that imports
torch again: seconds of a group restart on a busy machine. Here a restart forks a warm process.

Nothing outlives the task that started it (see training.parentdeath for the mechanism):

- The agent (this process), when the orchestrator names its pid in BALLAST_PARENT_PID, is sent SIGHUP
  when that process dies. It stops as torch's agent stops on a signal (a SignalException): it sends
  the same signal to its workers, which have no SIGHUP handler and end at once, without a checkpoint
  or a failure record; then it ends its forkserver and exits 129 at once (an interpreter that imported
  torch takes a second or two to tear down, and nobody is left to wait for it). SIGHUP rather than
  SIGTERM because SIGTERM is the trainers' preemption notice: forwarded, it would have every rank try to
  agree on and commit a checkpoint for up to `recovery.preempt_grace_seconds` (a rank whose peer had
  already gone waited that long) for a try whose orchestrator is gone. The next try resumes from the
  last committed checkpoint, and an uncommitted one is never trusted, so ending without one loses only
  the steps since. SIGKILL for the agent would leave the ranks to their own parent-death signals a
  moment later, and the multiprocessing resource tracker no chance to clean up; SIGHUP keeps the
  agent's orderly path. The SIGHUP handler is ours, not torch's, because it must act once: the kernel
  sends the parent-death signal again as each remaining thread of a dying multi-threaded parent exits
  (the task relays the log on a thread), and torch's handler, raising again in the middle of the
  shutdown, turned it into a second shutdown by SIGTERM, with a 30 s wait.
- Each rank (`worker`, forked by the forkserver) is sent SIGKILL when its parent dies. The forkserver
  dies with the agent (training.forkserver_guard), so a rank whose agent died for any reason, SIGKILL
  included, ends with it instead of training on unsupervised. The forkserver ignores SIGTERM, so that a
  SIGTERM to the whole group reaches the ranks as the preemption notice it is, not as their end.
- A rank's loader workers die with the rank the same way (training.dataset.loader).

A group restart (`--max-restarts`, recovery.max_restarts) happens only for what a restart fixes: a rank
killed outright, and its peers' broken connections (RESTART_IN_TRY). A failure of any other class ends
the launch with its record, for a new try that can adapt (a smaller micro-batch, the skip list,
another host) or for no retry at all.

The orchestrator's lease (ballast.launch.process) is the second line: the next try ends whatever a
previous try left in its process group before starting.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
import uuid
from pathlib import Path

PARENT_ENV = "BALLAST_PARENT_PID"  # set by the orchestrator: the process whose death ends this launch
AGENT_ENV = "BALLAST_AGENT_PID"  # set here, for the workers: the agent their forkserver belongs to


def worker(*argv: str) -> None:
    """One rank: what `python -m ballast.training --config F` does, inside a forked worker."""
    from ballast.training.parentdeath import die_with_parent

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the forkserver ignores it (training.forkserver_guard)
    # The parent is the forkserver; it must still be the agent's (it exits when the agent does).
    agent = os.environ.get(AGENT_ENV)
    die_with_parent(signal.SIGKILL, grandparent=int(agent) if agent else None)
    from ballast.training.__main__ import main

    code = main(list(argv))
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    parent = os.environ.pop(PARENT_ENV, None)
    if parent:  # bound now, importing torch takes seconds: until the handler below, SIGHUP simply ends us
        from ballast.training.parentdeath import die_with_parent

        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # not an inherited SIG_IGN (nohup)
        die_with_parent(signal.SIGHUP, int(parent))
    os.environ[AGENT_ENV] = str(os.getpid())
    _start_forkserver()

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

    args = get_args_parser().parse_args(argv if argv is not None else sys.argv[1:])
    if args.training_script != "ballast.training":
        raise SystemExit("training.launch runs the trainer only: pass --module ballast.training --config FILE")
    # As torch.distributed.run.run() does before building the config.
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    if parent:
        config.signals_to_handle = ",".join(s for s in config.signals_to_handle.split(",") if s.strip() != "SIGHUP")

        def on_parent_death(signum, frame):
            signal.signal(signum, signal.SIG_IGN)  # once (see the module docstring)
            raise SignalException(f"process {os.getpid()}: its parent {parent} died", sigval=signal.Signals(signum))

        signal.signal(signal.SIGHUP, on_parent_death)
    _restart_only_what_a_restart_fixes(_output_dir(args.training_script_args))
    _format_tracebacks_here()
    try:
        elastic_launch(config=config, entrypoint=worker)(*args.training_script_args)
        code = 0
    except ChildFailedError as exc:  # as torchrun: a summary of the failed ranks, exit 1
        print(exc.format_msg(), file=sys.stderr)
        code = 1
    except NewTryNeeded as exc:
        print(f"training.launch: {exc}; not restarting the group", file=sys.stderr)
        code = exc.code
    except SignalException as exc:  # the agent has already ended its workers with the same signal
        code = 128 + int(exc.sigval)
    finally:
        _end_forkserver()
    _exit_now(code)


def _start_forkserver() -> None:
    """Start the forkserver, with its imports of torch and the trainer, before this process imports
    torch: the two imports (seconds each on a busy machine) then overlap, instead of the forkserver's
    starting only when the agent first starts its workers. The workers' own environment (rank, world,
    OMP_NUM_THREADS, ...) reaches them from the agent when they are forked, not from the forkserver's."""
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(["ballast.training.forkserver_guard", "ballast.training.worker_preload"])
    forkserver.ensure_running()  # returns at once; the forkserver accepts its first fork once preloaded


def _format_tracebacks_here() -> None:
    """torch's log formatter imports torch._dynamo to format the first record that carries a traceback
    (1.7 s here, measured with faulthandler): the agent's record of a failed rank, on the path of every
    group restart and every new try. Its handlers get the traceback already formatted, by logging's own
    formatter, so that the text is the same and the import never happens in this process."""
    import logging

    plain = logging.Formatter()

    class Preformatted(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.exc_info:
                record.exc_text = record.exc_text or plain.formatException(record.exc_info)
                record.exc_info = None
            return True

    for name in ("torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(Preformatted())


def _exit_now(code: int) -> None:
    """Exit without tearing down the interpreter: the workers and the forkserver are gone and the agent's
    records are written; an interpreter that imported torch takes a second or more to tear down, and
    the orchestrator (the next try, or the task's end) waits for this process."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


RESTART_IN_TRY = frozenset({"communication"})
"""Failure classes a group restart inside the try fixes (a rank killed outright writes no record; its
peers record the broken connection). Every other class needs what only a new try brings (a smaller
micro-batch, another host, the skip list, a fixed config) or no retry at all: the group is not
restarted and torchrun exits, leaving the record for the orchestrator."""


class NewTryNeeded(Exception):
    """The group is not restarted: its failure's class needs a new try; `code`: that class's exit code,
    the launch's (on Kubernetes the Job's pod failure policy fails the Job on it, instead of rerunning
    the pod as it would after a crash)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _output_dir(script_args: list[str]) -> Path | None:
    try:
        config = Path(script_args[script_args.index("--config") + 1])
        return Path(json.loads(config.read_text())["output_dir"])
    except (ValueError, IndexError, OSError, KeyError):
        return None


def _restart_only_what_a_restart_fixes(out_dir: Path | None) -> None:
    """Before torchrun's agent restarts a failed group (`--max-restarts`), read the group's first failure
    record: a class in RESTART_IN_TRY (or no record: a rank killed outright) is restarted, the record
    set aside so the next group's first failure is recorded anew; any other class ends the launch."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ballast.training.failure import EXIT_CODES, RECORD_NAME, read_record

    if out_dir is None or getattr(SimpleElasticAgent, "_ballast_patched", False):
        return
    restart, monitor = SimpleElasticAgent._restart_workers, LocalElasticAgent._monitor_workers
    classes = {code: cls for cls, code in EXIT_CODES.items()}

    def monitor_and_keep(self, worker_group):
        self._ballast_result = monitor(self, worker_group)
        return self._ballast_result

    def restart_or_stop(self, worker_group) -> None:
        record = read_record(out_dir)
        if record is not None and record.get("class") not in RESTART_IN_TRY:
            raise NewTryNeeded(f"rank {record.get('rank')} failed with class {record.get('class')}",
                               EXIT_CODES.get(str(record.get("class")), 1))
        if record is None:  # killed outright, or failed before it knew where to write (a config it cannot read)
            result = getattr(self, "_ballast_result", None)
            for rank, failure in sorted((result.failures if result is not None else {}).items()):
                cls = classes.get(failure.exitcode)
                if cls is not None and cls not in RESTART_IN_TRY:
                    raise NewTryNeeded(f"rank {rank} exited {failure.exitcode} (class {cls}) without a failure record",
                                       failure.exitcode)
        if record is not None:
            stamp = f"{time.time():.3f}"
            os.replace(out_dir / RECORD_NAME, out_dir / f"failure-restarted-{stamp}.json")
            for other in out_dir.glob("failure-rank*.json"):
                os.replace(other, out_dir / f"failure-restarted-{stamp}-{other.name.removeprefix('failure-')}")
        restart(self, worker_group)

    SimpleElasticAgent._restart_workers = restart_or_stop
    LocalElasticAgent._monitor_workers = monitor_and_keep
    SimpleElasticAgent._ballast_patched = True


def _end_forkserver() -> None:
    """SIGKILL the forkserver once the workers are gone: left to itself it exits when it notices this
    process has, after a second or two tearing down the torch it imported, and the supervisor waits for
    the whole process group to be gone."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    main()
