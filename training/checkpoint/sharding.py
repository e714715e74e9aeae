"""The optimizer state in parts: which rank writes which parameters' state, and the merge at load.

Under DDP every rank holds the same optimizer state, so each writes a share of it (balanced by bytes)
and a save costs every rank about 1/world of the write; under FSDP rank 0 writes one part from the
gathered state. Part 0 also holds the parameter groups. Importing this module does not import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ballast.training.checkpoint.fileio import load_tensors
from ballast.training.failure import CheckpointFailure


def _state_bytes(entry: Any) -> int:
    if hasattr(entry, "element_size"):
        return entry.numel() * entry.element_size()
    if isinstance(entry, dict):
        return sum(_state_bytes(v) for v in entry.values())
    return 0


def optimizer_shares(optim_sd: dict[str, Any], world: int, *, rank0_bytes: int = 0) -> list[list[Any]]:
    """Parameter ids of an optimizer state dict assigned to `world` writers, balanced by bytes, largest
    first, to the least loaded (rank 0 starts with `rank0_bytes`, the model it writes). The same on every
    rank: it depends on shapes only."""
    load = [rank0_bytes] + [0] * (world - 1)
    shares: list[list[Any]] = [[] for _ in range(world)]
    sizes = sorted(((_state_bytes(v), k) for k, v in optim_sd["state"].items()), key=lambda x: (-x[0], x[1]))
    for size, key in sizes:
        r = min(range(world), key=lambda i: (load[i], i))
        shares[r].append(key)
        load[r] += size
    return shares


def optimizer_part(optim_sd: dict[str, Any], keys: list[Any], *, first: bool) -> dict[str, Any]:
    """The part of an optimizer state dict holding `keys`' state (and, for the first part, the groups)."""
    part: dict[str, Any] = {"state": {k: optim_sd["state"][k] for k in keys}}
    if first:
        part["param_groups"] = optim_sd["param_groups"]
    return part


def load_optimizer(path: Path, parts: int) -> dict[str, Any]:
    """The optimizer state merged from a checkpoint's `parts` part files."""
    path = Path(path)
    merged: dict[str, Any] = {"state": {}, "param_groups": None}
    for r in range(parts):
        f = path / f"optim-part{r}.pt"
        if not f.is_file():
            raise CheckpointFailure(f"{f}: missing; this checkpoint's optimizer state is in {parts} parts")
        part = load_tensors(f)
        if not isinstance(part, dict) or not isinstance(part.get("state"), dict):
            raise CheckpointFailure(f"{f}: not an optimizer state part")
        overlap = merged["state"].keys() & part["state"].keys()
        if overlap:
            raise CheckpointFailure(f"{f}: parameters {sorted(overlap)[:5]} are also in another part")
        merged["state"].update(part["state"])
        if r == 0:
            merged["param_groups"] = part.get("param_groups")
    if merged["param_groups"] is None:
        raise CheckpointFailure(f"{path / 'optim-part0.pt'}: no parameter groups")
    return merged
