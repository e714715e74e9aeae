"""The `local` backend: torchrun on the Airflow worker that runs the train task.

The process group, its lease, parent death, the hang guard and cancel are `ballast.supervise`'s; this
is that supervision behind the interface the cluster backends share (`start`, `wait` with the log
relayed, `stop`, an `Ending`). The platform here is the kernel: its only termination reason is a signal.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ballast import supervise
from ballast.backends import Ending, Launch


class LocalBackend:
    name = "local"

    def __init__(self, out_dir: Path, log: Any, *, hang_timeout: float):
        self.out_dir, self.log, self.hang_timeout = Path(out_dir), log, hang_timeout

    def start(self, launch: Launch) -> supervise._Group:
        if launch.nodes != 1:
            raise ValueError(f"the local backend trains on one node, not {launch.nodes}")
        return supervise.start(list(launch.command), self.out_dir, self.log, try_number=launch.try_number,
                               env=launch.env)

    def wait(self, handle: supervise._Group, *, on_line: Callable[[str], Any],
             should_stop: Callable[[], Any] | None = None) -> Ending:
        rc, hung = supervise.wait(handle, self.log, hang_timeout=self.hang_timeout, on_line=on_line,
                                  should_stop=should_stop)
        return ending(rc, hung=hung, cancelled=handle.cancelled or supervise.was_cancelled(self.out_dir))

    def stop(self, handle: supervise._Group, *, reason: str) -> bool:
        supervise.stop(handle, reason)  # SIGKILL to the whole group; supervise's own lease guards what outlives it
        return True


def ending(rc: int, *, hung: bool = False, cancelled: bool = False) -> Ending:
    """torchrun's exit as an `Ending`: a negative code is the signal that ended it; which failure class
    it was is the failure record's and the log's to say (`ballast.stages.train.failure`)."""
    if cancelled:
        reason = "cancelled (by Ballast)"
    elif hung:
        reason = "hang: no progress, ended by the supervisor"
    elif rc < 0:
        reason = f"killed by {_signal_name(-rc)}"
    else:
        reason = "exited" if rc == 0 else f"exit code {rc}"
    return Ending(rc, host=socket.gethostname(), reason=reason, cancelled=cancelled, hung=hung)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
