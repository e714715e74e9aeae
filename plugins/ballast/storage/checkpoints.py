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

Several nodes, each with a checkpoint directory of its own (`checkpoint.node_local`): each node's disk
holds its own ranks' files and the whole manifest (`training.checkpoint.commit`). Every node pushes the
files it holds (data first), then `PUSHED-node<k>.json` (the sha256 of the manifest it pushed for, and
its files); node 0 alone writes manifest.json, then COMMITTED, and only once every file the manifest
names is in storage with its size and every one of them came with a node's PUSHED record for this very
manifest (a file of an earlier save of the same step does not count). Until then the checkpoint stays
uncommitted in storage: a crash between two nodes' pushes leaves the previous checkpoint the newest
committed one. Node 0 takes a replaced checkpoint's marker down first; another node does not push over
a committed checkpoint with another manifest, it waits for that.

A node of several resuming pulls every file but DCP's shard files (`pull_for_resume(shards=False)`):
a node-local directory of the files it holds. Its ranks, once the rendezvous says which ranks they are,
plan their loads (DCP's load plan: the shard files each reads, at this run's world size) and one of
them runs the launcher's `fetch` for the files the node's ranks read and it lacks, each checked against
the manifest's sha256 before it takes its place. Each node then checks the files it holds, and the
nodes agree (`training.checkpoint.gate`): a node reads from storage what its ranks read, not the whole
checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ballast.pipeline.context import RunContext
from ballast.errors import StorageError
from ballast.storage import Storage, safe_join


PULLING = ".pulling"  # where a pulled checkpoint waits for its check, beside the checkpoints
PUSHED = "PUSHED-node{node}.json"  # a node's record that its files of a checkpoint are in storage
PULLED = "pulled"  # local-files.json's key marking a node's share pulled from storage (not its own save)


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
    if any("/" in f or (f.startswith(".") and f != ckpt.DCP_METADATA) or f in (ckpt.MANIFEST, ckpt.COMMIT_MARKER)
           or not _present(storage, base, f, present) for f in listed):
        return None
    return [*listed, ckpt.MANIFEST, ckpt.COMMIT_MARKER]


def _present(storage: Storage, base: str, name: str, listing: set[str]) -> bool:
    """Whether checkpoint file `name` is in storage: in the listing, or (DCP's `.metadata`, which
    listings leave out as they leave out every dot name) found by its key."""
    return name in listing or (name.startswith(".") and storage.exists(base + name))


def pull_for_resume(ctx: RunContext, ckpt_dir: Path, *, shards: bool = True) -> list[str]:
    """What a node resumes from, and nothing else: the newest checkpoint in storage that passes the
    trainer's resume gate here (`training.checkpoint.gate.check` without a probe; the last
    `resume_average_last` of them when resuming from their average); none without resume.

    `shards` false (one node of several, `checkpoint.node_local`): every file but DCP's shard files,
    which the trainer's ranks fetch once they know which of them they read (`fetch`); the directory is
    then this node's share of the checkpoint (`local-files.json`), checked on the files it holds."""
    from ballast.training.checkpoint import gate

    settings = ctx.spec.training.checkpoint
    return pull(ctx, ckpt_dir, newest=max(1, settings.resume_average_last) if settings.resume else 0,
                check=gate.check if shards else functools.partial(gate.check, held_only=True), shards=shards)


def pull(ctx: RunContext, ckpt_dir: Path, *, newest: int | None = None,
         check: Callable[[Path], object] | None = None, shards: bool = True) -> list[str]:
    """Copy the committed checkpoints in storage that this disk lacks, newest first, until `newest` of
    them are here (None: all); the names pulled, oldest first. Each is downloaded beside its final place
    and moved there only once it passes `check` (default: `training.checkpoint.verify`, on the files held
    without `shards`); one that does not is logged and skipped. `shards` false: without DCP's shard files
    (`pull_for_resume`)."""
    from ballast.training import checkpoint as ckpt

    prefix = _prefix(ctx)
    have = {p.name for p in ckpt.committed(ckpt_dir)}
    pulled, ready = [], 0
    for name in reversed(stored(ctx.storage, prefix)):
        if newest is not None and ready >= newest:
            break
        check = check or (ckpt.verify if shards else functools.partial(ckpt.verify, held_only=True))
        if name in have or _pull_one(ctx, prefix, name, ckpt_dir, check, shards=shards):
            ready += 1
            pulled += [] if name in have else [name]
    return sorted(pulled)


def _pull_one(ctx: RunContext, prefix: str, name: str, ckpt_dir: Path, check: Callable[[Path], object], *,
              shards: bool = True) -> bool:
    from ballast.training import checkpoint as ckpt

    files = stored_files(ctx.storage, prefix, name)
    if files is None:
        return False
    kept = files if shards else [f for f in files if not f.endswith(ckpt.SHARD_SUFFIX)]
    # Downloaded under its own name (what the checks read) in a directory no reader of ckpt_dir lists.
    staging, final = safe_join(ckpt_dir, PULLING), safe_join(ckpt_dir, name)
    tmp = staging / name
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for f in kept[:-1]:  # the marker (last) once the rest is here
            ctx.storage.download(f"{prefix}{name}/{f}", tmp / f)
        if len(kept) < len(files):  # this node's share of it: what it holds, pulled (never pushed back)
            held = [f for f in kept if f not in (ckpt.MANIFEST, ckpt.COMMIT_MARKER)]
            (tmp / ckpt.LOCAL_FILES).write_text(json.dumps({"files": held, PULLED: True}))
        ctx.storage.download(f"{prefix}{name}/{kept[-1]}", tmp / kept[-1])
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


def fetch(ctx: RunContext, path: Path, names: list[str]) -> int:
    """Copy the files `names` of the node-local checkpoint directory `path` from storage: only from the
    checkpoint committed there under this very manifest, each downloaded beside its place and moved
    there once its size and sha256 match the manifest; then `local-files.json` names them too. Returns
    the bytes copied. What a node's ranks run (`checkpoint.fetch`) for the shard files they read."""
    from ballast.training import checkpoint as ckpt

    path = Path(path)
    base = f"{_prefix(ctx)}{path.name}/"
    try:
        files = json.loads((path / ckpt.MANIFEST).read_text())["files"]
        held = ckpt.held_files(path)
    except (OSError, ValueError, KeyError, TypeError, ckpt.CheckpointFailure) as exc:
        raise StorageError(f"{path}: not a checkpoint directory to fetch into ({exc})") from exc
    if held is None:
        raise StorageError(f"{path}: holds the whole checkpoint (no {ckpt.LOCAL_FILES}); nothing to fetch")
    unknown = sorted(n for n in names if n not in files)
    if unknown:
        raise StorageError(f"{path / ckpt.MANIFEST}: does not list {', '.join(unknown[:3])}; only its files"
                           " are fetched")
    if not _pushed(ctx.storage, base, path):
        raise StorageError(f"{ctx.storage.describe(base.rstrip('/'))}: not committed in storage with this"
                           " checkpoint's manifest; the files of its other nodes are not all there")
    wanted, copied = sorted(set(names) - held), 0
    for name in wanted:
        final = safe_join(path, name)
        part = final.with_name(f".fetch-{name}")
        ctx.storage.download(base + name, part)
        try:
            if part.stat().st_size != files[name]["size"] or ckpt.sha256_file(part) != files[name]["sha256"]:
                raise StorageError(f"{ctx.storage.describe(base + name)}: size or sha256 does not match"
                                   f" {path / ckpt.MANIFEST}")
            os.replace(part, final)
        finally:
            part.unlink(missing_ok=True)
        copied += files[name]["size"]
    if wanted:
        listing = path / f".{ckpt.LOCAL_FILES}.tmp"
        record = json.loads((path / ckpt.LOCAL_FILES).read_text())
        listing.write_text(json.dumps({**record, "files": sorted(held | set(wanted))}))
        os.replace(listing, path / ckpt.LOCAL_FILES)
    return copied


def push(ctx: RunContext, ckpt_dir: Path, *, node: int = 0, wait: float = 0.0) -> list[str]:
    """Committed checkpoints of this disk not yet in storage, each once it verifies: files first, then
    manifest.json, then COMMITTED. One that storage holds with another manifest (the same step saved
    again after a resume) is replaced, its marker in storage removed first. Then storage is pruned.

    A node-local directory (several nodes): this node's files and its PUSHED record; node 0 commits once
    every node's share is there, waiting up to `wait` seconds for it (0: look once, the next push looks
    again). Returns the checkpoints committed in storage by this call."""
    from ballast.training import checkpoint as ckpt

    prefix, done, deadline = _prefix(ctx), [], time.monotonic() + wait
    for path in ckpt.committed(ckpt_dir):
        base = f"{prefix}{path.name}/"
        if _pushed(ctx.storage, base, path):
            continue
        try:
            manifest = ckpt.verify(path, held_only=True)
            held = ckpt.held_files(path)
        except ckpt.CheckpointFailure as exc:
            ctx.log.warning("checkpoint not uploaded: %s", exc)
            continue
        files = sorted(manifest["files"])
        if held is None and node != 0:
            continue  # a whole checkpoint pulled here: node 0 holds it too, and it alone commits in storage
        if held is not None and _pulled(path):
            continue  # a node's share pulled from storage: in storage already, or removed there on purpose
        if held is None:  # the whole checkpoint on this disk (one node, or a pulled one)
            _remove(ctx.storage, base, keep=set(files))
            for name in files + [ckpt.MANIFEST, ckpt.COMMIT_MARKER]:
                ctx.storage.upload(path / name, base + name)
        elif not _push_share(ctx, base, path, sorted(held), node=node, deadline=deadline):
            continue
        done.append(ctx.storage.describe(base.rstrip("/")))
        ctx.log.info("checkpoint uploaded: %s", ctx.storage.describe(base.rstrip("/")))
    if done:
        prune(ctx)
    return done


def _pulled(path: Path) -> bool:
    """Whether a node-local directory is a share pulled from storage (`local-files.json` says so)."""
    from ballast.training import checkpoint as ckpt

    try:
        return json.loads((path / ckpt.LOCAL_FILES).read_text()).get(PULLED) is True
    except (OSError, ValueError, AttributeError):
        return False


def _digest(path: Path) -> str:
    from ballast.training import checkpoint as ckpt

    return hashlib.sha256((path / ckpt.MANIFEST).read_bytes()).hexdigest()


def _push_share(ctx: RunContext, base: str, path: Path, held: list[str], *, node: int, deadline: float) -> bool:
    """This node's files of a node-local checkpoint, then its PUSHED record; on node 0 the commit in
    storage once every share is there (True: committed by this call)."""
    from ballast.training import checkpoint as ckpt

    storage, digest = ctx.storage, _digest(path)
    if storage.exists(base + ckpt.COMMIT_MARKER):  # committed with another manifest: an earlier save of this step
        if node != 0:
            return False  # node 0 takes that one's marker down first; pushed over it, a reader would see a mix
        storage.delete(base + ckpt.COMMIT_MARKER)
        storage.delete(base + ckpt.MANIFEST)
    record = base + PUSHED.format(node=node)
    if _record(storage, record) != digest:
        for name in held:
            storage.upload(path / name, base + name)
        storage.write_bytes(record, json.dumps({"manifest": digest, "files": held, "node": node}).encode())
        ctx.log.info("checkpoint share pushed: %d file(s) of %s from node %d", len(held),
                     storage.describe(base.rstrip("/")), node)
    if node != 0:
        return False
    while True:
        missing = _missing(storage, base, path, digest)
        if not missing:
            break
        if time.monotonic() >= deadline:
            ctx.log.info("checkpoint %s not committed in storage yet: %d file(s) of other nodes missing (%s)",
                         path.name, len(missing), ", ".join(missing[:4]))
            return False
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    storage.upload(path / ckpt.MANIFEST, base + ckpt.MANIFEST)
    storage.upload(path / ckpt.COMMIT_MARKER, base + ckpt.COMMIT_MARKER)
    return True


def _record(storage: Storage, key: str) -> str | None:
    """The manifest digest a PUSHED record was written for (None: no readable record)."""
    try:
        return json.loads(storage.read_bytes(key))["manifest"]
    except (StorageError, ValueError, KeyError, TypeError):
        return None


def _missing(storage: Storage, base: str, path: Path, digest: str) -> list[str]:
    """The files of the checkpoint's manifest that storage does not hold yet for this manifest: not
    named by a node's PUSHED record for it, or not there with the manifest's size."""
    from ballast.training import checkpoint as ckpt

    files = json.loads((path / ckpt.MANIFEST).read_text())["files"]
    present = set(storage.list_dir(base))
    covered: set[str] = set()
    for name in present:
        if name.startswith("PUSHED-node") and name.endswith(".json"):
            try:
                rec = json.loads(storage.read_bytes(base + name))
            except (StorageError, ValueError):
                continue
            if isinstance(rec, dict) and rec.get("manifest") == digest and isinstance(rec.get("files"), list):
                covered.update(f for f in rec["files"] if isinstance(f, str))
    missing = [f for f in sorted(files) if f not in covered or not _present(storage, base, f, present)]
    if missing:
        return missing
    return [f for f in sorted(files) if storage.size(base + f) != files[f]["size"]]


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
    for key in [*storage.list(base), base + ckpt.DCP_METADATA]:  # listings leave out dot names
        if key[len(base):] not in keep:
            storage.delete(key)
