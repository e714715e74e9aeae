"""The faults the goodput bench and its tests throw at a run, drawn as they come in the field: arrivals
a Poisson process at the declared MTBF (exponential gaps, so faults cluster as real ones do), and a
`Chaos` thread that SIGKILLs a random training rank at each arrival. A kill that finds no rank to hit
(between tries, a group restarting) is tried again a moment later, never dropped: a fault process
whose faults vanish when the run is down measures a kinder world than the one it stands for.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ballast.recovery.history import events

RETRY_SECONDS = 0.2
"""How soon a kill that found no live rank is tried again."""


def poisson_times(mtbf: float, horizon: float, seed: int) -> list[float]:
    """Arrival times in [0, horizon) of a Poisson process of mean gap `mtbf` seconds (exponential gaps):
    how many faults a run meets is itself random, and some come close together."""
    rng = random.Random(seed)
    times, t = [], rng.expovariate(1.0 / mtbf)
    while t < horizon:
        times.append(round(t, 3))
        t += rng.expovariate(1.0 / mtbf)
    return times


def stratified_times(mtbf: float, horizon: float, seed: int) -> list[float]:
    """One arrival at a uniformly random time in each `mtbf`-long window up to `horizon`: the Poisson
    stream's mean rate without its spread in how many faults a short run meets. For checking a model of
    the mean (the planner's) against one short run, never for goodput (where clusters are the point):
    seed 7's Poisson stream put 7 kills in 18 s at a mean gap of 6 s."""
    rng = random.Random(seed)
    return [round(k * mtbf + rng.uniform(0.0, mtbf), 3) for k in range(int(horizon // mtbf))]


class Chaos(threading.Thread):
    """SIGKILLs a random training rank at the given times (seconds after the run's first training step),
    finding the ranks by the pid files the trainer writes (`pid-rank<R>`); a kill that finds none alive
    is tried again every RETRY_SECONDS until one is hit or the run ends. `kills`: each kill's time, rank,
    pid, the step known done when it was sent, and how late it came (`delayed_seconds`)."""

    def __init__(self, runs_dir: Path, times: list[float], seed: int, *, ranks: int = 2):
        super().__init__(daemon=True, name="chaos")
        self.runs_dir, self.times, self.rng, self.ranks = runs_dir, list(times), random.Random(seed + 1), ranks
        self.kills: list[dict[str, Any]] = []
        self.unhit: list[float] = []  # arrivals still waiting for a rank when the run ended
        self.stop = threading.Event()

    def out(self) -> Path | None:
        found = sorted(self.runs_dir.glob("*/train/metrics.jsonl"))
        return found[0].parent if found else None

    def run(self) -> None:
        t0 = None
        while not self.stop.is_set() and self.times:
            out = self.out()
            if t0 is None:
                t0 = first_event_time(out, "first_step") if out else None
                time.sleep(0.2)
                continue
            due = t0 + self.times[0]
            if time.time() < due:
                time.sleep(min(0.05, due - time.time()))
                continue
            rank = self.rng.randrange(self.ranks)
            try:
                pid = int((out / f"pid-rank{rank}").read_text())
                if not _is_rank(pid):
                    raise ProcessLookupError(pid)
                os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                time.sleep(RETRY_SECONDS)  # no live rank now (between tries, restarting): again in a moment
                continue
            self.times.pop(0)
            self.kills.append({"time": time.time(), "rank": rank, "pid": pid, "step": step_at(out),
                               "delayed_seconds": round(time.time() - due, 3)})
        self.unhit = list(self.times)


def _is_rank(pid: int) -> bool:
    """Whether `pid` still runs (a pid file outlives its process: a killed rank stays a zombie until
    torchrun reaps it, and a kill sent to it would hit nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def first_event_time(out: Path, name: str) -> float | None:
    for e in events(out):
        if e.get("event") == name:
            return float(e["time"])
    return None


def step_at(out: Path) -> int | None:
    """The last step known to be done: the heartbeat (about once a second) or the last step event
    (every 10 steps), whichever is newer."""
    steps = [e["step"] for e in events(out) if e.get("event") == "step"][-1:]
    beat = heartbeat(out)
    known = [s for s in (*steps, beat) if s is not None]
    return max(known) if known else None


def heartbeat(out: Path) -> int | None:
    from ballast.training.outputs import read_heartbeat

    beat = read_heartbeat(out)
    return beat.step if beat is not None else None
