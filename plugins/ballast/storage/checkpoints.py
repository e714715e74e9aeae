"""Checkpoints between a node's disk and the pipeline's object storage, with the commit protocol kept:
a checkpoint is pushed files first, then manifest.json, then COMMITTED, and pulled the same way, so a
reader on either side applies the same predicate. Nothing to do when storage is a path (a shared file
system): training commits there directly.

A checkpoint is pushed only once it passes the integrity check `training.checkpoint.verify` (the marker,
and every file matching the manifest's size and sha256) on this disk, and a pulled copy is used only once
it passes here: what a node resumes from, the one validity predicate as on resume
(`training.checkpoint.gate.check`), any other copy `verify`. In storage, where reading every file back would
cost a download, a checkpoint counts as committed when its marker and manifest are there and every
file the manifest lists is present (`stored_files`); the push verified it, the pull verifies it again.

Storage is pruned as the disk is (`checkpoint.keep_last`, besides the best one), and a node pulls only
what it resumes from (`pull_for_resume`): a long run neither fills the bucket nor a restarted pod's disk.
Removing or replacing a checkpoint in storage takes its marker away first.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from ballast.pipeline.context import RunContext
from ballast.errors import StorageError
from ballast.storage import Storage, safe_join


PULLING = ".pulling"  # where a pulled checkpoint waits for its check, beside the checkpoints


def _prefix(ctx: RunContext) -> str:
    return f"{ctx.run_key}/checkpoints/"


def stored(storage: Storage, prefix: str) -> list[str]:
    """The checkpoint directories (`step-NNNNNNNN`) under `prefix` in storage, oldest first."""
    from ballast.training import checkpoint as ckpt

    names = (n.rstrip("/") for n in storage.list_dir(prefix) if n.endswith("/"))
    return sorted((n for n in names if ckpt.step_of_name(n) is not None), key=ckpt.step_of_name)


def stored_files(storage: Storage, prefix: str, name: str) -> list[str] | None:
    """The files of checkpoint `name` in storage, the marker last, if it is committed there (its marker,
    its manifest and every file the manifest lists); None if it is not."""
    from ballast.training import checkpoint as ckpt

    base = f"{prefix}{name}/"
    present = set(storage.list_dir(base))
    if ckpt.COMMIT_MARKER not in present or ckpt.MANIFEST not in present:
        return None
    try:
        files = json.loads(storage.read_bytes(base + ckpt.MANIFEST))["files"]
        listed = sorted(files)
    except (StorageError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if any("/" in f or f.startswith(".") or f in (ckpt.MANIFEST, ckpt.COMMIT_MARKER) or f not in present
           for f in listed):
        return None
    return [*listed, ckpt.MANIFEST, ckpt.COMMIT_MARKER]


def pull_for_resume(ctx: RunContext, ckpt_dir: Path) -> list[str]:
    """What a node resumes from, and nothing else: the newest checkpoint in storage that passes the
    trainer's resume gate here (`training.checkpoint.gate.check` without a probe; the last
    `resume_average_last` of them when resuming from their average); none without resume."""
    from ballast.training.checkpoint import gate

    settings = ctx.spec.training.checkpoint
    return pull(ctx, ckpt_dir, newest=max(1, settings.resume_average_last) if settings.resume else 0,
                check=gate.check)


def pull(ctx: RunContext, ckpt_dir: Path, *, newest: int | None = None,
         check: Callable[[Path], object] | None = None) -> list[str]:
    """Copy the committed checkpoints in storage that this disk lacks, newest first, until `newest` of
    them are here (None: all); the names pulled, oldest first. Each is downloaded beside its final place
    and moved there only once it passes `check` (default: `training.checkpoint.verify`); one that does
    not is logged and skipped."""
    from ballast.training import checkpoint as ckpt

    prefix = _prefix(ctx)
    have = {p.name for p in ckpt.committed(ckpt_dir)}
    pulled, ready = [], 0
    for name in reversed(stored(ctx.storage, prefix)):
        if newest is not None and ready >= newest:
            break
        if name in have or _pull_one(ctx, prefix, name, ckpt_dir, check or ckpt.verify):
            ready += 1
            pulled += [] if name in have else [name]
    return sorted(pulled)


def _pull_one(ctx: RunContext, prefix: str, name: str, ckpt_dir: Path, check: Callable[[Path], object]) -> bool:
    from ballast.training import checkpoint as ckpt

    files = stored_files(ctx.storage, prefix, name)
    if files is None:
        return False
    # Downloaded under its own name (what the checks read) in a directory no reader of ckpt_dir lists.
    staging, final = safe_join(ckpt_dir, PULLING), safe_join(ckpt_dir, name)
    tmp = staging / name
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for f in files:
            ctx.storage.download(f"{prefix}{name}/{f}", tmp / f)
        check(tmp)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)  # no half-pulled directory stays on the disk
        if not isinstance(exc, ckpt.CheckpointFailure):
            raise  # storage unreachable: the try fails and is retried, rather than resuming from older
        ctx.log.warning("checkpoint in storage skipped: %s (%s)", ctx.storage.describe(f"{prefix}{name}"), exc)
        return False
    if final.exists():  # left by an earlier pull or save that did not finish: not trusted, replaced
        ckpt.uncommit(final)
        shutil.rmtree(final)
    tmp.rename(final)
    shutil.rmtree(staging, ignore_errors=True)
    return True


def push(ctx: RunContext, ckpt_dir: Path) -> list[str]:
    """Committed checkpoints of this disk not yet in storage, each once it verifies: files first, then
    manifest.json, then COMMITTED. One that storage holds with another manifest (the same step saved
    again after a resume) is replaced, its marker in storage removed first. Then storage is pruned."""
    from ballast.training import checkpoint as ckpt

    prefix, done = _prefix(ctx), []
    for path in ckpt.committed(ckpt_dir):
        base = f"{prefix}{path.name}/"
        if _pushed(ctx.storage, base, path):
            continue
        try:
            files = list(ckpt.verify(path)["files"])
        except ckpt.CheckpointFailure as exc:
            ctx.log.warning("checkpoint not uploaded: %s", exc)
            continue
        _remove(ctx.storage, base, keep=set(files))
        for name in sorted(files) + [ckpt.MANIFEST, ckpt.COMMIT_MARKER]:
            ctx.storage.upload(path / name, base + name)
        done.append(ctx.storage.describe(base.rstrip("/")))
        ctx.log.info("checkpoint uploaded: %s", ctx.storage.describe(base.rstrip("/")))
    if done:
        prune(ctx)
    return done


def _pushed(storage: Storage, base: str, path: Path) -> bool:
    """Whether storage holds this very checkpoint: its marker (pushed last), over the same manifest."""
    from ballast.training import checkpoint as ckpt

    try:
        return storage.exists(base + ckpt.COMMIT_MARKER) and \
            storage.read_bytes(base + ckpt.MANIFEST) == (path / ckpt.MANIFEST).read_bytes()
    except (StorageError, OSError):
        return False


def prune(ctx: RunContext) -> list[str]:
    """Delete the checkpoints in storage older than the newest `checkpoint.keep_last` committed there,
    except the best one (as the newest records it): what `training.checkpoint.prune` does on the disk."""
    from ballast.training import checkpoint as ckpt

    prefix, keep_last = _prefix(ctx), ctx.spec.training.checkpoint.keep_last
    names = stored(ctx.storage, prefix)
    kept: list[str] = []
    for name in reversed(names):
        if len(kept) >= keep_last:
            break
        if stored_files(ctx.storage, prefix, name) is not None:
            kept.append(name)
    if len(kept) < keep_last:
        return []
    best = _best_step(ctx.storage, f"{prefix}{kept[0]}/")
    removed = []
    for name in names[:names.index(kept[-1])]:
        if ckpt.step_of_name(name) != best:
            _remove(ctx.storage, f"{prefix}{name}/")
            removed.append(name)
    if removed:
        ctx.log.info("checkpoints pruned from storage (keep_last %d): %s", keep_last, ", ".join(removed))
    return removed


def _best_step(storage: Storage, base: str) -> int | None:
    from ballast.training import checkpoint as ckpt

    try:
        best = json.loads(storage.read_bytes(base + ckpt.TRAINER_STATE)).get("best")
        return int(best["step"]) if isinstance(best, dict) else None
    except (StorageError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _remove(storage: Storage, base: str, *, keep: set[str] = frozenset()) -> None:
    """Delete a checkpoint directory in storage (but the files in `keep`), its marker first: a reader
    never finds a marker over a partial directory."""
    from ballast.training import checkpoint as ckpt

    storage.delete(base + ckpt.COMMIT_MARKER)
    for key in list(storage.list(base)):
        if key[len(base):] not in keep:
            storage.delete(key)
