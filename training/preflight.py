"""Preflight: before the first step of a try, each rank checks what a long run would otherwise find out
hours in. A failing check is a `hardware` failure naming the host and the check (the orchestrator puts
the host on the avoid list for the next try).

- devices: on a GPU machine, this rank's GPU is visible (CUDA_VISIBLE_DEVICES, a lost device);
- all-reduce: a small all-reduce over the whole job gives the expected sum (a broken link, a wrong
  NCCL interface, a rank in another job);
- disk: the checkpoint directory has room for two more checkpoints (one being written while the last
  committed one stays), estimated from the model and optimizer state's size.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from ballast.training.failure import TrainingFailure, host_name

CHECKPOINTS_OF_ROOM = 2


def state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of the weights plus the optimizer state (its tensors, or 2x the weights for Adam before its
    first step has created them)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tensors = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    moments = sum(t.numel() * t.element_size() for t in tensors) if tensors else 2 * weights
    return int(weights + moments)


def run_checks(dist: Any, *, checkpoint_dir: Path, need_bytes: int) -> dict[str, float]:
    """Run every check on this rank; raise a hardware TrainingFailure at the first that fails."""
    import torch

    host = host_name()
    t0 = time.monotonic()
    if dist.device.type == "cuda":
        visible = torch.cuda.device_count()
        if dist.local_rank >= visible:
            raise _failed(host, dist.rank, f"GPU {dist.local_rank} is not visible ({visible} visible)")
    if dist.enabled:
        import torch.distributed as tdist

        t = torch.full((1,), float(dist.rank + 1), device=dist.device)
        tdist.all_reduce(t)
        expected = dist.world * (dist.world + 1) / 2
        if float(t.item()) != expected:
            raise _failed(host, dist.rank, f"an all-reduce over {dist.world} ranks gave {t.item():g}, expected"
                                           f" {expected:g}")
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(checkpoint_dir).free
    if dist.local_rank == 0 and free < CHECKPOINTS_OF_ROOM * need_bytes:
        raise _failed(host, dist.rank, f"{checkpoint_dir}: {free / 1e9:.2f} GB free, {CHECKPOINTS_OF_ROOM} checkpoints"
                                       f" of {need_bytes / 1e9:.2f} GB need {CHECKPOINTS_OF_ROOM * need_bytes / 1e9:.2f} GB")
    return {"seconds": round(time.monotonic() - t0, 4), "free_bytes": float(free)}


def _failed(host: str, rank: int, what: str) -> TrainingFailure:
    return TrainingFailure(f"preflight failed on host {host} (rank {rank}): {what}", failure_class="hardware")
