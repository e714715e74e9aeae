"""Fault injection for tests and rehearsals: make a run crash, run out of memory, produce a NaN, hang or
be preempted at a given step on a given rank.

Faults come from the run config's rehearsal section (`rehearsal.faults: [{kind, step, rank}]`, also
`training.rehearsal.faults` in a spec) or the environment
(`BALLAST_FAULTS='[{"kind": "oom", "step": 12}]'`), the latter only where the run config says
`rehearsal.env_faults` (the orchestrator's rehearsal rules allowed faults in this try). Each fires once:
a marker file in the output directory stops it from firing again when a restarted group replays the
same step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from ballast.training.config.rehearsal import FaultKind, FaultSettings
from ballast.training.failure import ConfigFailure

KINDS: tuple[str, ...] = get_args(FaultKind)
_LOSS_FAULTS = {"nan": float("nan"), "spike": 1000.0}
Fault = FaultSettings  # kind, step, rank: declared once, in the run config's rehearsal section


def _marker(fault: Fault, out_dir: Path, rank: int) -> Path:
    when = f"step{fault.step}" if fault.step is not None else f"after{fault.seconds:g}s"
    return out_dir / f".fault-{fault.kind}-{when}-try{fault.on_try or 0}-rank{rank}.fired"


def load_faults(rehearsal: Any) -> list[Fault]:
    """The run config's faults (its `rehearsal` section) plus those in BALLAST_FAULTS (a JSON list of the
    same objects) where the section allows them (`env_faults`): an environment variable set on a node,
    by an operator or in a spec's execution.env, must not skip the rehearsal rules."""
    faults = list(rehearsal.faults)
    env = os.environ.get("BALLAST_FAULTS")
    if env and not getattr(rehearsal, "env_faults", False):
        print("[train] BALLAST_FAULTS ignored: this try is no rehearsal (the run config's rehearsal.env_faults is"
              " false)", file=sys.stderr, flush=True)
    elif env:
        try:
            raw = json.loads(env)
            faults += [FaultSettings.model_validate(f) for f in (raw if isinstance(raw, list) else [raw])]
        except (ValueError, ValidationError) as exc:
            raise ConfigFailure(f"BALLAST_FAULTS: not a JSON list of faults {{kind, step, rank}} with kind one of"
                                f" {', '.join(KINDS)} ({str(exc).splitlines()[0]})") from None
    return faults


class Injector:
    def __init__(self, faults: list[Fault], *, rank: int, out_dir: Path, checkpoint_dir: Path | None = None):
        self.rank = rank
        self.out_dir = out_dir
        self.checkpoint_dir = checkpoint_dir
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]
        self.started = time.monotonic()

    def due(self, step: int, kind: str | None = None) -> Fault | None:
        elapsed = time.monotonic() - self.started
        for f in self.faults:
            when = f.step == step if f.step is not None else elapsed >= f.seconds
            if when and (kind is None or f.kind == kind) and not _marker(f, self.out_dir, self.rank).exists():
                return f
        return None

    def fire(self, step: int, *, settle: Callable[[], Any] | None = None) -> None:
        """Fire the non-numeric faults due at this step (called before the step's forward pass). `settle`
        waits for the checkpoint save in flight: a corrupt fault damages the newest committed checkpoint,
        so which one that is must not depend on how far a background save had got."""
        fault = self.due(step)
        if fault is None or fault.kind in _LOSS_FAULTS:
            return
        _marker(fault, self.out_dir, self.rank).write_text(str(time.time()))
        if fault.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "corrupt":
            if settle is not None:
                settle()
            self._corrupt_newest_checkpoint()
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind == "oom":
            import torch

            raise torch.OutOfMemoryError(f"injected out-of-memory at step {step} (fault injection)")
        elif fault.kind == "error":
            raise RuntimeError(f"injected error at step {step} (fault injection)")
        elif fault.kind == "ecc":  # CUDA's own words; classified hardware by training.failure_patterns
            raise RuntimeError(f"CUDA error: uncorrectable ECC error encountered (injected at step {step})")
        elif fault.kind == "comm":
            raise RuntimeError(f"Gloo connectFullMesh failed: injected communication failure at step {step}")
        elif fault.kind == "hang":
            while True:
                time.sleep(3600)

    def _corrupt_newest_checkpoint(self) -> None:
        """Flip bytes in the middle of the newest committed checkpoint's model.pt, or its first shard (its
        size unchanged, so only its hash and contents tell)."""
        from ballast.training import checkpoint as ckpt

        if self.checkpoint_dir is None or self.rank != 0:
            return
        newest = ckpt.committed(self.checkpoint_dir)[-1:]
        if not newest:
            return
        shards = sorted(newest[0].glob("__*_0.distcp"))  # a sharded (FSDP) checkpoint has no model.pt
        target = newest[0] / "model.pt" if not shards else shards[0]
        with open(target, "r+b") as fh:
            fh.seek(target.stat().st_size // 2)
            chunk = fh.read(64)
            fh.seek(-len(chunk), os.SEEK_CUR)
            fh.write(bytes(b ^ 0xFF for b in chunk))

    def loss_factor(self, step: int) -> float | None:
        """A factor to multiply this step's loss by (NaN, or a spike), or None."""
        for kind, factor in _LOSS_FAULTS.items():
            fault = self.due(step, kind)
            if fault is not None:
                _marker(fault, self.out_dir, self.rank).write_text(str(time.time()))
                return factor
        return None
