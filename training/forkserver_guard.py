"""Imported first in training.launch's forkserver (a multiprocessing forkserver preload module): the
forkserver lives and dies with the agent.

- SIGKILL when the agent (its parent) dies: otherwise a forkserver still importing torch when the agent
  died would notice only once its imports were done.
- SIGTERM ignored: a SIGTERM to the whole process group (a preemption notice, or the orchestrator
  ending a stalled group) killed the forkserver, and with it, by their parent-death signal, every rank
  in the middle of committing its preemption checkpoint. The forkserver ends when the agent does.
  Forked ranks inherit the ignored SIGTERM; training.launch.worker restores it first thing.
"""

import os
import signal

from ballast.training.parentdeath import die_with_parent

signal.signal(signal.SIGTERM, signal.SIG_IGN)
_agent = os.environ.get("BALLAST_AGENT_PID")
die_with_parent(signal.SIGKILL, int(_agent) if _agent else None)
