"""Ending with the parent: Linux's parent-death signal (prctl PR_SET_PDEATHSIG), which a process sets on itself.

A process asks the kernel to send it `sig` the moment its parent dies. Three things about it decide
how it is used here:

- It is cleared in a forked child and kept across execve, so every process sets its own (the torchrun
  agent, each rank, each loader worker), and a wrapper can set it and exec the real program:
  `python -m ballast.training.parentdeath --parent PID --signal TERM -- program args...` (`ballast ui` starts
  Airflow's processes so).
- "Parent" is the thread that forked the child: when that thread ends, the signal comes although the
  parent process lives on. Every user here forks from a thread that outlives its child: the task's
  `supervise` waits for its torchrun before it returns, the forkserver is single-threaded, a rank
  iterates its DataLoader on its main thread, `ballast ui` starts and waits on its main thread.
- The parent can die before the child asks. The child then checks that its parent is still the one
  it expects (and, where the parent is an intermediary such as the forkserver, that the parent's parent
  is), and if not ends at once by the same signal.

Not Linux: a no-op (the functions return False); the orchestrator's lease (ballast.launch.process) still
ends a leftover group before the next try starts.

A helper process that must end only with its parent (a loader worker, the checkpoint writer) also
ignores the group's stop signals: its parent starts it inside `stop_signals_blocked` (a forked or
exec'd child inherits the mask) and the child calls `ignore_stop_signals` first thing, so a SIGTERM
sent to the group between the fork and that call waits and is dropped, instead of killing the helper
with the handlers it inherited.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import stat
import sys

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
"""What a group is sent to stop it (a preemption notice, the end of a stalled group, an interrupt)."""


@contextlib.contextmanager
def stop_signals_blocked():
    """STOP_SIGNALS blocked on this thread meanwhile: start helper processes inside it. This thread's
    own process still gets the signal through another thread, or here once the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals() -> None:
    """In a helper started inside `stop_signals_blocked`: ignore STOP_SIGNALS, then unblock them (one
    sent meanwhile is dropped here)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def set_parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) on the calling process; False where there is no such call."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return True


def die_with_parent(sig: int, parent: int | None = None, *, grandparent: int | None = None) -> bool:
    """Be sent `sig` when the parent dies. `parent`: the pid the parent must have (default: the parent
    now); `grandparent`: the pid the parent's parent must have. If either is already not so (it died
    before this call), end now by `sig`. False where parent-death signals do not exist."""
    expected = os.getppid() if parent is None else parent
    if not set_parent_death_signal(sig):
        return False
    if os.getppid() != expected or (grandparent is not None and parent_of(expected) != grandparent):
        end_by(sig)
    return True


def end_by(sig: int) -> None:
    """End this process as the signal `sig` would by default (no handler, no cleanup)."""
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught, ignored or blocked
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default action is not to end the process


def proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, starttime in clock ticks since boot) of a live process, from /proc/<pid>/stat;
    None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime
    # cstime priority nice threads itrealvalue starttime ..."; comm may hold spaces and parentheses.
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def parent_of(pid: int) -> int | None:
    st = proc_stat(pid)
    return st[1] if st else None


def output_orphaned() -> bool:
    """True when nobody reads this process's output any more: stdout or stderr is a pipe whose reading
    end is closed (the task that relayed the log has died). A failure noticed then ends an abandoned
    try, and recording it would only mislead the next try."""
    poll = select.poll()
    for fd in (1, 2):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                poll.register(fd, select.POLLOUT)
        except OSError:
            continue
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _signal(name: str) -> int:
    name = name.upper()
    return int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])


def main(argv: list[str] | None = None) -> None:
    """`python -m ballast.training.parentdeath --parent PID --signal TERM -- program args...`: exec the program
    with its parent-death signal set (kept across exec), after checking the parent is still PID."""
    parser = argparse.ArgumentParser(prog="python -m ballast.training.parentdeath", description=main.__doc__)
    parser.add_argument("--parent", type=int, required=True, help="the pid the parent must have")
    parser.add_argument("--signal", type=_signal, default=signal.SIGTERM, help="signal name (default TERM)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program args...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no program to run (after --)")
    die_with_parent(args.signal, args.parent)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
