"""The verification gate: whether a checkpoint may be resumed from or promoted, and what happens to one
that may not.

`check` is the one validity predicate: the commit marker, the manifest's sizes and sha256 (the
integrity check `commit.verify`, which pruning and the upload to storage use alone: they judge no
contents), the trainer state readable with a step equal to the directory's, every tensor file loadable
without unpickling (`weights_only`; a sharded checkpoint's DCP shards through DCP's reader, tensors
only), every floating-point tensor finite, the step not behind
`min_step`, and, given a `probe`, a forward pass on a held-out batch with a finite loss. The trainer's
resume path and a cluster node pulling a checkpoint run it without the probe; the trainer's ranks
split it (each hashes and reads its share of the files and tensors, and all agree on the outcome), so
a resume reads the checkpoint once for the gate however many ranks there are. The train stage before a
launch runs it with the probe for a whole-model checkpoint (a sharded one: hashes and values, no
forward pass, which would gather the model in the orchestrator); the verification stage before
promotion runs it with the probe.

A checkpoint that fails moves to `<checkpoints>/quarantine/<name>/` with `QUARANTINED.json` (the
reason, when, the step); the previous one that passes takes its place. Nothing is deleted.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from ballast.training.checkpoint.commit import (DCP_METADATA, _step_of, committed, held_files, read_trainer_state,
                                               share_of, verify)
from ballast.training.checkpoint.fileio import load_tensors
from ballast.training.failure import CheckpointFailure

QUARANTINE_DIR = "quarantine"
REASON_FILE = "QUARANTINED.json"

Probe = Callable[[Path], float]
"""checkpoint path -> the loss of a forward pass on a held-out batch (the probe reads the model)."""


def check(path: Path, *, probe: Probe | None = None, min_step: int | None = None,
          share: tuple[int, int] | None = None, probe_sharded: bool = True, held_only: bool = False,
          verified: dict[Path, str] | None = None) -> dict[str, Any]:
    """Raise CheckpointFailure naming the first thing wrong with `path`; return its trainer state.
    `share` (part, parts): check only this part of the files' hashes and tensors (`latest_passing`'s
    ranks split the check and agree on it). `probe(path)`: a forward pass's loss, the probe reading the
    model itself (whole, or block by block: checkpoint.streamed). `probe_sharded` false: a
    sharded checkpoint gets no forward pass (the trainer's gate), only its hashes and every tensor's values.
    `held_only`: a node-local directory (`local-files.json`) is checked on the files it holds, `share`
    splitting those; the others are other nodes' to check. `verified`: a sharded checkpoint that passes
    gets `verified[path]`, the sha256 of the DCP metadata checked, which its load then requires
    (`dcp.read_into`'s `digest`): the load reads the metadata the gate checked, not one swapped in since."""
    import torch

    path = Path(path)
    manifest = verify(path, share=share, held_only=held_only)
    held = held_files(path) if held_only else None
    present = sorted(held if held is not None else manifest["files"])
    mine = share_of(present, share)
    state = read_trainer_state(path)
    if state.get("step") != _step_of(path):
        raise CheckpointFailure(f"{path}: trainer.json records step {state.get('step')!r}, the directory says"
                                f" {_step_of(path)}")
    if min_step is not None and state["step"] < min_step:
        raise CheckpointFailure(f"{path}: step {state['step']} is behind step {min_step}, which an earlier"
                                f" stage already verified; the step must not go backwards")
    for name in present:
        if not name.endswith(".pt") or name not in mine:
            continue
        tensors = load_tensors(path / name, mmap=True)  # the file's pages, not a copy of them
        for key, value in _tensors(tensors):
            if torch.is_tensor(value) and torch.is_floating_point(value) and not torch.isfinite(value).all():
                raise CheckpointFailure(f"{path / name}: non-finite values in {key}")
        del tensors
    if DCP_METADATA in manifest["files"]:  # sharded (FSDP): DCP's shards, read a bounded batch at a time
        from ballast.training.checkpoint import dcp

        digest = dcp.check(path, share=share, files=None if held is None else held)
        if verified is not None:
            verified[path] = digest
        if not probe_sharded:
            probe = None
    if probe is not None:  # it reads the model itself (whole, or block by block: checkpoint.streamed)
        loss = probe(path)
        if not math.isfinite(loss):
            raise CheckpointFailure(f"{path}: a forward pass on a held-out batch gives loss {loss}")
    return state


def _tensors(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, tensor) for every tensor in a nested dict/list state."""
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _tensors(v, f"{prefix}{k}.")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _tensors(v, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), obj)]


def quarantine(path: Path, reason: str) -> Path:
    """Move `path` into its root's quarantine directory with a reason file; nothing is deleted."""
    path = Path(path)
    target_root = path.parent / QUARANTINE_DIR
    target_root.mkdir(exist_ok=True)
    target = target_root / path.name
    n = 1
    while target.exists():
        n += 1
        target = target_root / f"{path.name}.{n}"
    info = {"checkpoint": path.name, "reason": reason, "time": time.time()}
    try:
        info["step"] = _step_of(path)
    except (AttributeError, ValueError):
        pass
    # The reason first, inside the checkpoint; then the move (one rename), which takes it out of the
    # candidates: a reader sees the checkpoint either in place or quarantined with its reason.
    (path / REASON_FILE).write_text(json.dumps(info, indent=2))
    os.replace(path, target)
    return target


def latest_passing(root: Path, *, probe: Probe | None = None, min_step: int | None = None,
                   quarantine_failures: bool = True, log: Callable[[str], Any] = print,
                   share: tuple[int, int] | None = None, probe_sharded: bool = True,
                   agree: Callable[[Any], list[Any]] | None = None,
                   prepare: Callable[[Path], str | None] | None = None,
                   node_share: tuple[int, int] | None = None, verified: dict[Path, str] | None = None) -> Path | None:
    """The newest committed checkpoint under `root` that passes `check`; the newer ones that fail are
    quarantined (or only skipped, with `quarantine_failures=False`: the trainer's ranks read, the
    orchestrator moves). `share` and `agree`: the trainer's ranks each check their share of every
    checkpoint (its files hashed once, its shard files' pieces read once between them, not once per rank);
    `agree(value)` gives every rank each rank's value (collectively): first the checkpoints each rank
    sees (the ones all see are the candidates: a node's disk may hold one its peers lack), then each
    rank's failure (or None) for each candidate, so that all take the same one.

    A node-local directory (its node's share of the checkpoint, `local-files.json`) is a candidate only
    with `prepare`: `prepare(path)` (collective) makes it whole for what this node's ranks read (their
    files copied from storage) or says why not; then each node checks the files it holds, its ranks
    splitting them by `node_share` (local rank, ranks on the node). `verified`: as `check`'s."""
    candidates = list(reversed(committed(root)))
    if agree is not None:
        if prepare is None:
            candidates = [p for p in candidates if held_files(p) is None]  # a node's share: never resumed from
        seen = [set(names) for names in agree([p.name for p in candidates])]
        candidates = [p for p in candidates if all(p.name in names for names in seen)]
    for path in candidates:
        if min_step is not None and _step_of(path) < min_step:
            log(f"no checkpoint at or after step {min_step} passes the gate; {path.name} and older are behind it")
            return None  # older ones are not damaged, only too old: left where they are
        failure = agreed_failure(path, share=share, agree=agree, prepare=prepare, node_share=node_share,
                                 probe=probe, min_step=min_step, probe_sharded=probe_sharded, verified=verified)
        if failure is None:
            return path
        if quarantine_failures:
            moved = quarantine(path, failure)
            log(f"checkpoint quarantined: {failure} (moved to {moved})")
        else:
            log(f"checkpoint skipped: {failure}")
    return None


def node_local(path: Path) -> bool:
    """Whether `path` is a node-local directory (an unreadable `local-files.json` counts: the check names it)."""
    try:
        return held_files(path) is not None
    except CheckpointFailure:
        return True


def agreed_failure(path: Path, *, share: tuple[int, int] | None = None,
                   agree: Callable[[Any], list[Any]] | None = None,
                   prepare: Callable[[Path], str | None] | None = None, node_share: tuple[int, int] | None = None,
                   **check_options: Any) -> str | None:
    """Why `path` fails `check` (None: it passes); with `share` and `agree`, this rank's share of the
    check, and the first failure any rank found (collective: every rank gets the same answer). With
    `prepare`, a node-local directory (on any rank: all take the same path) is first `prepare`d, then
    checked on the files its node holds, split by `node_share` (`latest_passing`)."""
    held = prepare is not None and (any(agree(node_local(path))) if agree else node_local(path))
    if held:
        failure = prepare(path)  # already the same on every rank
        if failure:
            return failure
        share, check_options = node_share, {**check_options, "held_only": True}
    try:
        check(path, share=share, **check_options)
        failure = None
    except CheckpointFailure as exc:
        failure = str(exc)
    if agree is not None:
        failure = next((f for f in agree(failure) if f), None)
    return failure


def quarantined(root: Path) -> list[dict[str, Any]]:
    """The reason files of the checkpoints quarantined under `root`, oldest first."""
    out = []
    qdir = Path(root) / QUARANTINE_DIR
    for d in sorted(qdir.iterdir()) if qdir.is_dir() else []:
        try:
            out.append({**json.loads((d / REASON_FILE).read_text()), "path": str(d)})
        except (OSError, ValueError):
            out.append({"checkpoint": d.name, "reason": "no readable reason file", "path": str(d)})
    return sorted(out, key=lambda r: r.get("time", 0))

