"""What to do about a step's loss and gradient norm: the anomaly policy.

`AnomalyPolicy.judge` looks at one step's agreed loss and gradient norm and returns a `Verdict`; the
trainer carries out its action. The policy owns the spike detector (whose window a checkpoint saves),
the throttle on anomaly checkpoints and the count of rollbacks to each checkpoint.

- non-finite loss or gradients without a loss scaler: `diverged` (the last good state is checkpointed
  with the batch on the skip list, the process exits with the divergence code; the retry skips it).
  With fp16 loss scaling a non-finite step is the scaler's business: it skips the step and halves the
  scale, down to `training.loss_scale.minimum`; a step still non-finite at that scale is `diverged`
  (the loss scale cannot help what overflows even unscaled, and skipping it would skip every step).
- a loss spike (z-score over the trailing window): `rollback` to the last checkpoint with the batch
  skipped (spike_action: rollback), or `checkpoint` the last good state (alert), at most once per
  anomaly_checkpoint_min_steps; an alert whose save is throttled is `alert` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from ballast.training.config.sections import MonitorSettings
from ballast.training.monitor import SpikeDetector

Action = Literal["train", "diverged", "rollback", "checkpoint", "alert"]


@dataclass(frozen=True)
class Verdict:
    action: Action
    nonfinite: bool = False
    zscore: float | None = None
    detail: str = ""  # what a divergence message adds (the loss scale it happened at)


class AnomalyPolicy:
    def __init__(self, monitors: MonitorSettings, *, scaler: Any = None, min_loss_scale: float = 1.0):
        """`scaler`: the run's loss scaler (torch.amp.GradScaler), when fp16 enables it; judged before
        its `update()`, so its scale is the one this step's gradients were scaled by."""
        self.monitors = monitors
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.min_loss_scale = min_loss_scale
        self.spikes = SpikeDetector(window=monitors.spike_window, zscore=monitors.spike_zscore)
        self._saved_at: int | None = None       # step of the last anomaly checkpoint
        self._rollbacks: dict[str, int] = {}     # checkpoint name -> rollbacks to it in this process

    def judge(self, loss: float, grad_norm: float, *, step: int) -> Verdict:
        nonfinite = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if nonfinite and self.scaler is None:
            return Verdict("diverged", nonfinite=True)
        if nonfinite:
            scale = self.scaler.get_scale()
            if scale > self.min_loss_scale:
                return Verdict("train", nonfinite=True)
            return Verdict("diverged", nonfinite=True,
                           detail=f" at loss scale {scale:g} (training.loss_scale.minimum: {self.min_loss_scale:g})")
        z = self.spikes.check(loss)
        if z is None:
            return Verdict("train")
        if self.monitors.spike_action == "rollback":
            return Verdict("rollback", zscore=z)
        return Verdict(self._checkpoint_due(step), zscore=z)

    def _checkpoint_due(self, step: int) -> Action:
        every = self.monitors.anomaly_checkpoint_min_steps
        if self._saved_at is not None and every and step - self._saved_at < every:
            return "alert"
        self._saved_at = step
        return "checkpoint"

    def after_failed_rollback(self, step: int) -> Action:
        """No rollback after all (no checkpoint, or too many to it): the alert's checkpoint instead."""
        return self._checkpoint_due(step)

    def may_roll_back_to(self, checkpoint: str) -> bool:
        tries = self._rollbacks.get(checkpoint, 0)
        if tries >= self.monitors.max_rollbacks:  # a spike that keeps coming back is the data
            return False
        self._rollbacks[checkpoint] = tries + 1
        return True

    def rollbacks_to(self, checkpoint: str) -> int:
        return self._rollbacks.get(checkpoint, 0)

    def keep(self, loss: float, verdict: Verdict) -> None:
        """A step training keeps: its loss enters the spike window, unless the step was not finite."""
        if not verdict.nonfinite:
            self.spikes.add(loss)

    def state_dict(self) -> list[float]:
        return self.spikes.state()

    def load_state_dict(self, window: list[float]) -> None:
        self.spikes.load(window)
