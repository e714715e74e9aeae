"""The attempt history of a task: `runs/<dag>/<run>/attempts/<task>.json`, one `Attempt` per try.

A try records itself twice: as `running` when it starts (what it resumes from, what it adapted) and
with its outcome when it ends. A try whose process was killed never writes the second half; the next
try completes it (`close_unfinished`) from what the earlier one left on disk: its failure record if a
rank wrote one, its heartbeat, its checkpoints. Times come from the trainer's files:

    heartbeat        "<step> <unix time>" of the latest step (rank 0, about once a second)
    metrics.jsonl    events with their unix time: first_step, resume (checkpoint path), checkpoint (saves)
    checkpoints      a committed checkpoint's COMMITTED marker: when it became trustworthy
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from ballast.pipeline.context import RunContext
from ballast.records import Attempt, AttemptHistory


def history_key(ctx: RunContext, task_id: str) -> str:
    return f"{ctx.run_key}/attempts/{task_id}.json"


def load(ctx: RunContext, task_id: str) -> AttemptHistory:
    key = history_key(ctx, task_id)
    if not ctx.storage.exists(key):
        return AttemptHistory(task_id=task_id)
    return AttemptHistory.model_validate_json(ctx.storage.read_bytes(key))


def save(ctx: RunContext, history: AttemptHistory) -> None:
    ctx.storage.write_bytes(history_key(ctx, history.task_id), history.model_dump_json(indent=2).encode())


def load_all(ctx: RunContext) -> list[AttemptHistory]:
    """Every task's attempt history in this run."""
    prefix = f"{ctx.run_key}/attempts/"
    keys = sorted(k for k in ctx.storage.list(prefix) if k.endswith(".json"))
    return [AttemptHistory.model_validate_json(ctx.storage.read_bytes(k)) for k in keys]


def put(history: AttemptHistory, attempt: Attempt) -> AttemptHistory:
    """`history` with `attempt` in place of the one with its try number (or appended)."""
    kept = [a for a in history.attempts if a.try_number != attempt.try_number]
    return history.model_copy(update={"attempts": sorted([*kept, attempt], key=lambda a: a.try_number)})


def events(out_dir: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """The trainer's metrics.jsonl events from `since` (unix time) on, as their JSON objects (read
    through `training.outputs.read_events`: a line cut by a kill is skipped)."""
    from ballast.training.outputs import read_events

    return [e.model_dump() for e in read_events(out_dir, since)]


def _heartbeat(out_dir: Path) -> tuple[int, float] | None:
    from ballast.training.outputs import read_heartbeat

    beat = read_heartbeat(out_dir)
    return (beat.step, beat.time) if beat is not None else None


def _commits(ckpt_dir: Path, since: float) -> list[tuple[int, float]]:
    from ballast.training import checkpoint as ckpt

    out = []
    for path in ckpt.committed(ckpt_dir):
        try:
            at = (path / ckpt.COMMIT_MARKER).stat().st_mtime
            step = int(path.name.rsplit("-", 1)[-1])
        except (OSError, ValueError):
            continue
        if at >= since:
            out.append((step, at))
    return out


def observe(attempt: Attempt, out_dir: Path, ckpt_dir: Path) -> dict[str, Any]:
    """What the try's files say about it: first step, resume, last step, last commit."""
    evs = events(out_dir, attempt.started)
    first = next((e for e in evs if e.get("event") == "first_step"), None)
    resume = next((e for e in evs if e.get("event") == "resume"), None)
    beat = _heartbeat(out_dir)
    commits = _commits(ckpt_dir, attempt.started)
    saves = {e["step"]: e["time"] for e in evs if e.get("event") == "checkpoint" and "step" in e}
    last_commit = max(commits) if commits else None
    found: dict[str, Any] = {}
    if first is not None:
        found["first_step_at"] = float(first["time"])
    if resume is not None:
        found["resumed_from"] = Path(str(resume.get("path"))).name
        found["resumed_step"] = resume.get("step")
    steps = [e["step"] for e in evs if e.get("event") == "step" and isinstance(e.get("step"), int)]
    reached = [*steps[-1:], *([beat[0]] if beat is not None and beat[1] >= attempt.started else [])]
    if reached:
        found["step_reached"] = max(reached)  # the heartbeat is about a second behind, step events 10 steps
    if last_commit is not None:
        # The work a checkpoint keeps is the state when it was taken (its save event), not its commit.
        found["last_commit_step"] = last_commit[0]
        found["last_commit_at"] = float(saves.get(last_commit[0], last_commit[1]))
    lost, last_first = _group_restarts(evs, dict(commits))
    if lost:
        found["group_restarts"] = len(lost)
        found["group_restart_lost_seconds"] = round(sum(lost), 3)
        found["last_group_first_step_at"] = last_first
    # when each save was committed (the trainer's event: the directories of older ones are pruned by now)
    written = [float(e["time"]) for e in evs if e.get("event") == "checkpoint_written" and e.get("rank", 0) == 0]
    warmup = _warmups(evs, written, skip_first=attempt.try_number == 1)
    if warmup:
        found["warmup_lost_seconds"] = round(warmup, 3)
    return found


WARMUP_STEPS = 50
"""The steps after a group's first step over which its warm-up is measured against the steady pace."""


def _warmups(evs: list[dict[str, Any]], commits: list[float], *, skip_first: bool) -> float:
    """The time the groups of a try took over its steady pace for their first WARMUP_STEPS steps (from
    rank 0's step events, one every few steps), for the groups whose work a checkpoint committed after
    the warm-up kept (`commits`: the times saves were committed): the steady pace is the median seconds a step between
    step events that no group start falls between. `skip_first`: the try's first group is the run's
    start (a clean run has that warm-up too)."""
    import statistics

    marks = [(float(e["time"]), e["step"], e.get("event")) for e in evs if e.get("rank", 0) == 0
             and e.get("event") in ("first_step", "step") and isinstance(e.get("step"), int)]
    paces = [(t1 - t0) / (s1 - s0) for (t0, s0, _), (t1, s1, k1) in zip(marks, marks[1:])
             if k1 == "step" and s1 > s0]
    if not paces:
        return 0.0
    pace = statistics.median(paces)
    saves = sorted(commits)
    extra, starts = 0.0, [i for i, m in enumerate(marks) if m[2] == "first_step"]
    for n, i in enumerate(starts):
        if n == 0 and skip_first:
            continue
        t0, s0, _ = marks[i]
        end = next((m for m in marks[i + 1:] if m[2] == "first_step" or m[1] >= s0 + WARMUP_STEPS), None)
        if end is None or end[2] == "first_step" or end[1] <= s0:
            continue  # the group did not get that far: its time is counted as lost work instead
        following = marks[starts[n + 1]][0] if n + 1 < len(starts) else float("inf")
        if not any(end[0] <= t < following for t in saves):
            continue  # no commit kept the warm-up's work: it is in the next restart's lost work already
        extra += max(0.0, (end[0] - t0) - (end[1] - s0) * pace)  # a group faster than the median: no gain
    return extra


def _group_restarts(evs: list[dict[str, Any]], commits: dict[int, float]) -> tuple[list[float], float | None]:
    """What each of torchrun's group restarts inside the try cost (`recovery.max_restarts`): from the
    moment of the state it resumed from (that checkpoint's save, the last one before the resume: a
    restarted group may save the same step again) to its first step, which is the work lost since that
    checkpoint, the detection and the restart together; a restart from scratch lost everything since the
    try's first step. Also the last group's first step."""
    lost: list[float] = []
    saved: dict[int, float] = dict(commits)  # step -> when its state was taken, as of this point in the log
    start, last_first, resumed_at = None, None, None
    for e in evs:
        if e.get("rank", 0) != 0:
            continue
        kind = e.get("event")
        if kind == "checkpoint" and isinstance(e.get("step"), int):
            saved[e["step"]] = float(e["time"])
        elif kind == "resume":
            resumed_at = saved.get(e.get("step"))
        elif kind == "first_step":
            if start is None:
                start = float(e["time"])
            else:
                at = resumed_at if resumed_at is not None else start
                lost.append(max(0.0, float(e["time"]) - at))
            last_first, resumed_at = float(e["time"]), None
    return lost, last_first


def begin(try_number: int, *, settings: dict[str, Any], adaptation: list[str]) -> Attempt:
    return Attempt(try_number=try_number, outcome="running", host=socket.gethostname(), started=time.time(),
                   settings=settings, adaptation=adaptation)


def finish(attempt: Attempt, out_dir: Path, ckpt_dir: Path, *, outcome: str, failure_class: str | None = None,
           reason: str | None = None, exit_code: int | None = None, host: str | None = None,
           ended: float | None = None, step: int | None = None) -> Attempt:
    """The try's record with its outcome and its time split into restart, lost and productive; `step`:
    the step the failure record names (exact, where the files are a little behind)."""
    found = observe(attempt, out_dir, ckpt_dir)
    if step is not None:
        found["step_reached"] = max(step, found.get("step_reached") or 0)
    ended = ended if ended is not None else time.time()
    first = found.get("first_step_at")
    restart = (first - attempt.started) if (first is not None and attempt.try_number > 1) else 0.0
    lost = restart + found.get("group_restart_lost_seconds", 0.0) + found.get("warmup_lost_seconds", 0.0)
    if outcome != "success":
        if first is None:
            lost = ended - attempt.started  # not one step: the whole try
        else:
            since = found.get("last_group_first_step_at") or first  # the last group's restart is counted
            lost += max(0.0, ended - max(since, found.get("last_commit_at") or since))
    return attempt.model_copy(update={
        **found, "outcome": outcome, "failure_class": failure_class, "reason": reason, "exit_code": exit_code,
        "host": host or attempt.host, "ended": ended, "restart_seconds": round(max(0.0, restart), 3),
        "lost_seconds": round(max(0.0, lost), 3)})


def close_unfinished(history: AttemptHistory, out_dir: Path, ckpt_dir: Path, *, lease: dict | None
                     ) -> tuple[AttemptHistory, Attempt | None]:
    """An earlier try still `running` ended without recording itself (its task process was killed):
    complete its record from its failure record, heartbeat and checkpoints."""
    from ballast.training.failure import read_record

    open_ = [a for a in history.attempts if a.outcome == "running"]
    if not open_:
        return history, None
    attempt = open_[-1]
    record = read_record(out_dir)
    beat = _heartbeat(out_dir)
    ended = max(attempt.started, beat[1] if beat else attempt.started)
    if record is not None and record.get("time", 0) >= attempt.started:
        done = finish(attempt, out_dir, ckpt_dir, outcome="failed", failure_class=record["class"],
                      reason=f"{record['exception']} (rank {record['rank']}, recorded by the trainer; the task"
                             f" process ended without recording the try)",
                      exit_code=record.get("exit_code"), host=record.get("host"), ended=record["time"])
    else:
        where = f" (its process group {lease['pgid']} on {lease['host']})" if lease else ""
        done = finish(attempt, out_dir, ckpt_dir, outcome="failed", failure_class="lost",
                      reason=f"try {attempt.try_number} ended without a record{where}: its task process was"
                             f" killed, or its node lost", ended=ended)
    return put(history, done), done
