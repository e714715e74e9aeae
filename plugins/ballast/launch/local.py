"""The `local` backend: torchrun on the Airflow worker that runs the train task.

The process group, its lease and parent death are `ballast.launch.process`'s primitives; this puts them
behind the interface the cluster backends share (`start`, `wait` with the log relayed, `stop`, an
`Ending`), for the one driver (`ballast.launch.driver`). The platform here is the kernel: its only
termination reason is a signal.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ballast.launch import process
from ballast.launch import Ending, Launch


class LocalBackend:
    name = "local"

    def __init__(self, out_dir: Path, log: Any):
        self.out_dir, self.log = Path(out_dir), log

    def start(self, launch: Launch) -> process.Group:
        if launch.nodes != 1:
            raise ValueError(f"the local backend trains on one node, not {launch.nodes}")
        return process.start(list(launch.command), self.out_dir, self.log, try_number=launch.try_number,
                               env=launch.env)

    def wait(self, handle: process.Group, *, on_line: Callable[[str], Any],
             should_stop: Callable[[], Any] | None = None) -> Ending:
        rc = process.wait(handle, self.log, on_line=on_line, should_stop=should_stop)
        return ending(rc, cancelled=handle.killed)

    def stop(self, handle: process.Group, *, reason: str) -> bool:
        process.kill(handle)  # SIGKILL to the whole group; its lease stays while anything of it does
        return True

    def lease(self, handle: process.Group) -> None:
        return None  # the group's own lease (process.LEASE), written as it started

    def describe(self, handle: process.Group) -> dict[str, Any]:
        return {"pgid": handle.pgid}


def ending(rc: int, *, cancelled: bool = False) -> Ending:
    """torchrun's exit as an `Ending`: a negative code is the signal that ended it; which failure class
    it was is the failure record's and the log's to say (`ballast.stages.train_try`)."""
    if cancelled:
        reason = "cancelled (by Ballast)"
    elif rc < 0:
        reason = f"killed by {_signal_name(-rc)}"
    else:
        reason = "exited" if rc == 0 else f"exit code {rc}"
    return Ending(rc, host=socket.gethostname(), reason=reason, cancelled=cancelled)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
