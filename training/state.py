"""The training loop's own progress, as one object that checkpoints save and resume restores.

Position in the data (epoch, batches consumed in it), the validation history and early-stopping
counters, and the batches never to train on again. `state_dict()` is plain JSON (it goes into the
checkpoint's trainer.json); `load_state_dict()` takes what it returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Current epoch (0-based)."""
    pos: int = 0
    """Batches of the current epoch consumed: optimizer steps or skipped batches."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One validation record per finished epoch."""
    best: dict[str, Any] | None = None
    """The best validation record so far: step, epoch, value."""
    bad_epochs: int = 0
    """Epochs since the best one (early stopping)."""
    skip: set[tuple[int, int]] = field(default_factory=set)
    """(epoch, batch) pairs never to train on again: the batches that diverged or spiked."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "pos": self.pos, "history": self.history,
                "best": self.best, "bad_epochs": self.bad_epochs, "skip": sorted(self.skip)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.pos = state["step"], state["epoch"], state["pos"]
        self.history, self.best, self.bad_epochs = state["history"], state["best"], state["bad_epochs"]
        self.skip = {tuple(x) for x in state.get("skip", [])}

    def end_epoch(self, record: dict[str, Any], *, value: float, improved: bool) -> None:
        """Record an epoch's validation result (`value`: its metric) and move to the next epoch."""
        self.history.append(record)
        self.epoch += 1
        self.pos = 0
        if improved:
            self.best = {"step": self.step, "epoch": self.epoch - 1, "value": value}
            self.bad_epochs = 0
        else:
            self.bad_epochs += 1
