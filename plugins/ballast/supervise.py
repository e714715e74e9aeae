"""Supervision of a training process group from the task that started it.

`supervise` runs torchrun in its own process group, relays its output into the task log, watches the
heartbeat and ends the group when it stalls or when the caller asks; `stop_running` ends every group
this process started (the operator's on_kill).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

_RUNNING: set[subprocess.Popen] = set()


def stop_running() -> None:
    """End every torchrun this process started (called from the operator's on_kill)."""
    for proc in list(_RUNNING):
        _kill_group(proc)


def supervise(argv: list[str], out_dir: Path, ctx: RunContext, *, hang_timeout: float,
               abort=None) -> tuple[int, bool]:
    """Run torchrun in its own process group, relaying its output; end it if the heartbeat stalls,
    or when `abort()` returns something (the background cache warm-up failed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    _RUNNING.add(proc)

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            ctx.log.info("%s", line.rstrip())

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    heartbeat = out_dir / "heartbeat"
    started = time.time()
    hung = False
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            last = max(started, heartbeat.stat().st_mtime if heartbeat.exists() else 0.0)
            if time.time() - last > hang_timeout:
                hung = True
                ctx.log.error("no training progress for %.0fs; ending the process group", hang_timeout)
                _kill_group(proc)
                break
            if abort is not None and abort() is not None:
                ctx.log.error("the cache warm-up failed; ending training")
                _kill_group(proc)
                break
    except BaseException:
        _kill_group(proc)  # the task itself is being stopped: take the trainers down with it
        raise
    finally:
        _RUNNING.discard(proc)
    rc = proc.wait()
    reader.join(timeout=5)
    return rc, hung


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # SIGTERM first: trainers checkpoint on it
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
