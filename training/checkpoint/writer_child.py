"""The checkpoint writer process's own side (started by writer_process.WriterProcess as
`python -c "...writer_child import main; main(argv)"`): map the trainer's shared regions, write the plans
that come over the socket (writer_process.run_plan: O_DIRECT, hashed, fsynced), answer with each file's
digest, size and CPU time, and end when the trainer does. Importing this module does not import torch."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import socket
import sys
import time
from pathlib import Path

from ballast.training.checkpoint import fileio
from ballast.training.checkpoint.writer_process import recv_message, run_plan, send_message


def serve(sock: socket.socket) -> None:
    """Write the plans that come over `sock` until it closes."""
    maps: dict[int, mmap.mmap] = {}
    views: dict[int, memoryview] = {}
    staging = fileio.staging_buffer()
    send_message(sock, {"ready": True})
    while True:
        try:
            head, payload, fds = recv_message(sock)
        except EOFError:
            return
        if head["op"] == "map":
            rid, size = int(head["id"]), int(head["size"])
            try:
                maps[rid] = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
                views[rid] = memoryview(maps[rid])
            finally:
                for fd in fds:
                    os.close(fd)
            continue
        c0 = time.process_time()  # with the hashing threads'
        try:
            w = run_plan(Path(head["path"]), head["items"], payload, staging,
                         lambda rid, off, n: views[rid][off:off + n])
            reply = {"ok": True, "sha256": w.digest.hexdigest(), "size": w.size}
        except OSError as exc:
            reply = {"ok": False, "errno": exc.errno, "error": exc.strerror or str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported to the trainer, which raises it for this save
            reply = {"ok": False, "errno": None, "error": f"{type(exc).__name__}: {exc}"}
        reply["cpu"] = time.process_time() - c0
        send_message(sock, reply)


def main(argv: list[str] | None = None) -> None:
    """The writer process: lives and dies with its trainer, quietly. A trainer that ends (or closes the
    socket) at any point, even before the greeting, ends it without a word; anything else that stops it
    is one line on stderr, never a traceback in the task log."""
    fd, parent, priority = (argv if argv is not None else sys.argv[1:])[:3]
    from ballast.training.parentdeath import die_with_parent, ignore_stop_signals

    ignore_stop_signals()  # blocked since the fork (WriterProcess): one sent meanwhile is dropped here
    die_with_parent(signal.SIGKILL, int(parent))  # never outlives the trainer
    if priority == "idle":
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        serve(socket.socket(fileno=int(fd)))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the trainer is gone or done: nothing was left to write
    except Exception as exc:  # noqa: BLE001 - the trainer's thread writes what this process did not
        print(f"ballast checkpoint writer process: stopped ({type(exc).__name__}: {exc}); "
              "the trainer writes its saves itself", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
