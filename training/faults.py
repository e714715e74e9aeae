"""Fault injection for tests and rehearsals: make a run crash, run out of memory, produce a NaN, hang or
be preempted at a given step on a given rank.

Faults come from the run config (`faults: [{kind, step, rank}]`) or the environment
(`BALLAST_FAULTS='[{"kind": "oom", "step": 12}]'`). Each fires once: a marker file in the output
directory stops it from firing again when a restarted group replays the same step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("crash", "oom", "nan", "spike", "hang", "sigterm", "error", "comm")
_LOSS_FAULTS = {"nan": float("nan"), "spike": 1000.0}


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank

    def marker(self, out_dir: Path, rank: int) -> Path:
        return out_dir / f".fault-{self.kind}-step{self.step}-rank{rank}.fired"


def load_faults(configured: list[dict]) -> list[Fault]:
    raw = list(configured)
    env = os.environ.get("BALLAST_FAULTS")
    if env:
        raw += json.loads(env)
    faults = []
    for f in raw:
        if f.get("kind") not in KINDS:
            raise ValueError(f"faults: unknown kind {f.get('kind')!r}; known: {', '.join(KINDS)}")
        faults.append(Fault(kind=f["kind"], step=int(f["step"]), rank=f.get("rank")))
    return faults


class Injector:
    def __init__(self, faults: list[Fault], *, rank: int, out_dir: Path):
        self.rank = rank
        self.out_dir = out_dir
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]

    def due(self, step: int, kind: str | None = None) -> Fault | None:
        for f in self.faults:
            if f.step == step and (kind is None or f.kind == kind) and not f.marker(self.out_dir, self.rank).exists():
                return f
        return None

    def fire(self, step: int) -> None:
        """Fire the non-numeric faults due at this step (called before the step's forward pass)."""
        fault = self.due(step)
        if fault is None or fault.kind in _LOSS_FAULTS:
            return
        fault.marker(self.out_dir, self.rank).write_text(str(time.time()))
        if fault.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind == "oom":
            import torch

            raise torch.OutOfMemoryError(f"injected out-of-memory at step {step} (fault injection)")
        elif fault.kind == "error":
            raise RuntimeError(f"injected error at step {step} (fault injection)")
        elif fault.kind == "comm":
            raise RuntimeError(f"Gloo connectFullMesh failed: injected communication failure at step {step}")
        elif fault.kind == "hang":
            while True:
                time.sleep(3600)

    def loss_factor(self, step: int) -> float | None:
        """A factor to multiply this step's loss by (NaN, or a spike), or None."""
        for kind, factor in _LOSS_FAULTS.items():
            fault = self.due(step, kind)
            if fault is not None:
                fault.marker(self.out_dir, self.rank).write_text(str(time.time()))
                return factor
        return None
