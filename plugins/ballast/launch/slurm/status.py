"""How a Slurm job ended, read back from `scontrol show job -o` (or `sacct`), in recovery's classes
(the states' classes are the pattern table's, `training.failure_patterns.PLATFORM_ENDINGS`).

- OUT_OF_MEMORY (the job's cgroup hit --mem): `oom`;
- PREEMPTED (a higher-priority job took the nodes), TIMEOUT and DEADLINE (the time limit: training had
  its notice, `--signal`, and checkpointed): `preempted`, a new try resumes;
- NODE_FAIL and BOOT_FAIL (a node died or never came up): `hardware`, the node goes on the avoid list;
- FAILED with an exit code: nothing the platform knows (the failure record and the log decide);
- CANCELLED: ours (a cancel, a kill of the task) or someone else's (an administrator): not a failure
  class; the train task tells them apart.
"""

from __future__ import annotations

import re

from ballast.launch import Ending

TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "PREEMPTED", "NODE_FAIL",
                      "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"})
_FIELD = re.compile(r"(\w+(?::\w+)?)=(\S*)")


def parse_show_job(line: str) -> dict[str, str]:
    """`scontrol show job -o ID`: one line of Key=Value pairs."""
    return {m.group(1): m.group(2) for m in _FIELD.finditer(line)}


def first_node(nodelist: str) -> str | None:
    """The first host of a Slurm node list (`n[1-3],m2` -> n1)."""
    if not nodelist or nodelist in ("(null)", "None"):
        return None
    m = re.match(r"([^,\[]+)(?:\[(\d+)[^\]]*\])?", nodelist)
    return (m.group(1) + (m.group(2) or "")) if m else None


def ending(fields: dict[str, str]) -> Ending | None:
    """The ending of a job from its fields (JobState, Reason, ExitCode, NodeList); None while it runs. A job
    cancelled by someone else is the platform's ending (a cancel of Ballast's own is the driver's to say)."""
    state = fields.get("JobState", "").split()[0] if fields.get("JobState") else ""
    if state not in TERMINAL:
        return None
    from ballast.training.failure_patterns import platform_class  # its regexes compile at import: not at parse

    code_text, _, signal_text = fields.get("ExitCode", "0:0").partition(":")
    code, sig = int(code_text or 0), int(signal_text or 0)
    exit_code = -sig if sig and not code else code
    reason = fields.get("Reason", "None")
    host = first_node(fields.get("BatchHost", "") if state != "NODE_FAIL" else fields.get("NodeList", "")) \
        or first_node(fields.get("NodeList", ""))
    said = state + (f" ({reason})" if reason not in ("None", "") else "")
    if state == "COMPLETED":
        return Ending(exit_code, host=host, reason=said)
    return Ending(exit_code, host=host, reason=said, failure_class=platform_class("slurm", state))
