"""What a new try changes because of the tries before it.

Each rule reads the task's attempt history (oldest first) and the spec; the settings carry from try to
try and the notes go to the task log and into the try's record:

- out of memory: the micro-batch shrinks by `recovery.oom_micro_batch_factor` (to a divisor of the
  per-process batch) and gradient accumulation grows, so the global batch stays fixed; at a
  micro-batch of 1 there is nothing left to shrink and the task fails with that said;
- preempted: after `recovery.on_demand_after_preemptions` preemptions the backend is asked for the
  on-demand pool (`capacity`);
- hang, communication, hardware: the failed host goes on the avoid list the backend receives
  (`recovery.avoid_failed_hosts`);
- divergence: nothing here: the trainer checkpointed the last good state with the batch on its skip
  list, and the next try resumes from it (as every try resumes from the newest checkpoint that passes
  the verification gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ballast.errors import LaunchError
from ballast.records import Attempt
from ballast.spec import Spec

AVOID_CLASSES = frozenset({"hang", "communication", "hardware"})


def adapt_micro_batch(spec: Spec, current: int, factor: float) -> int:
    """A smaller micro-batch after an out-of-memory failure that still divides the per-process batch,
    so the global batch stays fixed (gradient accumulation makes up the difference)."""
    per_process = spec.training.per_process_batch
    target = max(1, math.floor(current * factor))
    return max(d for d in range(1, target + 1) if per_process % d == 0)


@dataclass(frozen=True)
class TrySettings:
    micro_batch_size: int
    capacity: str = "default"
    """`default` (what the backend uses: spot where it has it) or `on-demand`."""
    avoid_hosts: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {"micro_batch_size": self.micro_batch_size, "capacity": self.capacity,
                "avoid_hosts": list(self.avoid_hosts)}

    @classmethod
    def from_dict(cls, data: dict, default_micro: int) -> TrySettings:
        return cls(micro_batch_size=int(data.get("micro_batch_size") or default_micro),
                   capacity=str(data.get("capacity") or "default"),
                   avoid_hosts=tuple(data.get("avoid_hosts") or ()))


def next_settings(spec: Spec, history: list[Attempt], *, start: TrySettings | None = None
                  ) -> tuple[TrySettings, list[str]]:
    """The settings of the next try and what changed, from the task's earlier tries."""
    base = start or TrySettings(micro_batch_size=spec.training.micro_batch_size)
    if not history:
        return base, []
    last = history[-1]
    settings = TrySettings.from_dict(last.settings, base.micro_batch_size) if last.settings else base
    notes: list[str] = []
    rec = spec.recovery
    cls = last.failure_class if last.outcome == "failed" else None
    if cls == "oom":
        micro = settings.micro_batch_size
        if micro <= 1:
            raise LaunchError(f"out of memory at micro_batch_size 1 (try {last.try_number}): there is no smaller"
                              f" micro-batch; use a smaller model, fewer parameters per process (FSDP), a machine"
                              f" with more memory, or lower training.global_batch_size", failure_class="config")
        smaller = adapt_micro_batch(spec, micro, rec.oom_micro_batch_factor)
        accum = spec.training.grad_accum_for(smaller)
        notes.append(f"out of memory in try {last.try_number}: micro-batch {micro} -> {smaller}, gradient"
                     f" accumulation {spec.training.grad_accum_for(micro)} -> {accum} (global batch"
                     f" {spec.training.global_batch_size} kept)")
        settings = replace(settings, micro_batch_size=smaller)
    elif cls == "preempted":
        n = sum(1 for a in history if a.outcome == "failed" and a.failure_class == "preempted")
        if n >= rec.on_demand_after_preemptions and settings.capacity != "on-demand":
            notes.append(f"{n} preemptions (recovery.on_demand_after_preemptions: {rec.on_demand_after_preemptions}):"
                         f" asking the backend for the on-demand pool")
            settings = replace(settings, capacity="on-demand")
        else:
            notes.append(f"preempted in try {last.try_number} ({n} so far): resuming from the last checkpoint")
    elif cls in AVOID_CLASSES and rec.avoid_failed_hosts and last.host not in settings.avoid_hosts:
        notes.append(f"{cls} failure on host {last.host} in try {last.try_number}: asking the backend to avoid it")
        settings = replace(settings, avoid_hosts=(*settings.avoid_hosts, last.host))
    elif cls == "divergence":
        notes.append(f"divergence in try {last.try_number}: resuming from the checkpoint before the anomaly,"
                     f" the offending batches skipped")
    return settings, notes
