"""The failure classes and their exit codes: the vocabulary both the trainer's record
(`training.failure`) and the pattern table (`training.failure_patterns`) are written in.

Its own module so that those two import it and not each other.
"""

from __future__ import annotations

EXIT_CODES: dict[str, int] = {
    "config": 64,
    "data": 65,
    "user_code": 70,
    "divergence": 71,
    "communication": 72,
    "oom": 73,
    "hardware": 74,
    "preempted": 75,
    "hang": 76,
}
# The one list of failure classes: the trainer's (EXIT_CODES) and the orchestrator's own conclusions,
# which no trainer exits with: `lost` (a rank or the try's process ended without a record: SIGKILL from
# outside, a node gone) and `unknown` (nothing known at all).
FAILURE_CLASSES: tuple[str, ...] = ("oom", "preempted", "hang", "communication", "hardware", "lost", "data",
                                    "divergence", "config", "user_code", "unknown")
ORCHESTRATOR_CLASSES = frozenset({"lost", "unknown"})
"""Classes the orchestrator concludes from what it sees (no exit code: no trainer records them)."""
CANCELLED = "cancelled"
"""Not a failure class: the orchestrator stopped the process itself (task cancelled, run marked failed)."""
