"""Committed checkpoints: the layout, the commit protocol, and the integrity check `verify` (the files
are the ones a finished save committed).

Layout of a checkpoint directory `step-00000040/`:
    model.pt               the model's weights (tensors only; loaded with weights_only=True), from rank 0
    optim-part<R>.pt       the optimizer state in parts: under DDP every rank holds the same state and
                           rank R writes a share of it balanced by bytes (rank 0's share counts the
                           model), so the write is spread over the ranks; under FSDP rank 0 writes one
                           part from the gathered state. Part 0 holds the parameter groups.
    rng-rank<R>.pt         every rank's RNG state
    trainer.json           step, epoch, position in the epoch, metric history, early-stopping state, and
                           the model section it was trained with (what `recorded_model` returns)
    __<R>_0.distcp,        instead of model.pt and optim-part<R>.pt under FSDP: the sharded model and
    .metadata              optimizer state through torch.distributed.checkpoint, each rank its own
                           shards, rank 0 the metadata (checkpoint.dcp), and optim_groups.json
    manifest.json          size and sha256 of every file above
    COMMITTED              written last, after the directory got its final name
    local-files.json       only in a node-local directory (below): the files of the manifest this node holds

A save writes into `.step-00000040.tmp/`, fsyncs every file, writes the manifest, renames the
directory and then writes COMMITTED. A directory without COMMITTED, or whose files do not match its
manifest, is refused by `verify`: a kill at any moment of a save leaves the previous checkpoint as the
newest that verifies.

Node-local directories (`node_local`: several nodes, each with a checkpoint directory of its own, as
on object storage): each node's disk holds only the files its own ranks wrote. Every rank hashes its
own files; the names, sizes and sha256 go to every rank (an all-gather on the checkpoint group), so
each node's leader (local rank 0) writes the same manifest, listing every file of every node, beside
its node's files, then `local-files.json` (what this node holds) and COMMITTED. Such a directory is
complete for the integrity check `verify(path, held_only=True)` (the files it holds match the manifest:
what pruning and the push to storage need), never for `verify` (the gate, a resume): the whole
checkpoint exists only in storage, once every node pushed its share (`ballast.storage.checkpoints`).

`verify` says only that the bytes are the ones committed; whether a checkpoint
may be resumed from or promoted is the verification gate's (`training.checkpoint.gate.check`, which
runs `verify` first, then reads what the files hold). Pruning and the upload to object storage need
no more than `verify`; `is_committed` only says which directories to ask. A checkpoint directory is
removed or replaced marker first, so a kill while its files go leaves no marker over what remains.

Importing this module does not import torch (the verification stage uses it at DAG-run time).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ballast.training.checkpoint.fileio import _FileWriter, expected_bytes, open_file, sha256_file, staging_buffer
from ballast.training.failure import CheckpointFailure

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
LOCAL_FILES = "local-files.json"
"""In a node-local checkpoint directory: {"files": [the manifest's files this node holds]}."""
TRAINER_STATE = "trainer.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
# What trainer.json must record for the model to be rebuilt from the checkpoint alone.
DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's index of a sharded checkpoint: the one file name allowed a leading dot."""
SHARD_SUFFIX = ".distcp"
"""DCP's shard files (`__<rank>_<n>.distcp`): what a node of several fetches only as its ranks read them."""
MODEL_KEY = "model"
"""trainer.json's key holding the model section {name, options, data} (run config version 2)."""


def step_dir_name(step: int) -> str:
    """The directory name of step `step`'s checkpoint (zero-padded, so names sort by step)."""
    return f"step-{step:08d}"


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def step_of_name(name: str) -> int | None:
    """The step of a checkpoint directory's name (`step-00000040`: 40); None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_committed(path: Path) -> bool:
    """Cheap check: the commit marker and the manifest are there."""
    path = Path(path)
    return bool(_STEP_DIR.match(path.name)) and (path / COMMIT_MARKER).is_file() and (path / MANIFEST).is_file()


def verify(path: Path, *, held_only: bool = False, share: tuple[int, int] | None = None) -> dict[str, Any]:
    """Full check: committed, and every file matches the manifest's size and sha256. Returns the manifest.

    `held_only`: a node-local directory (with `local-files.json`) passes when the files this node holds
    match the manifest; the others are on other nodes' disks (and in storage). `share` (part, parts):
    hash only this part's files (`share_of` the files checked), the
    others' sizes still checked: ranks that split a check and agree on the outcome read each file once."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointFailure(f"{path}: no such checkpoint directory")
    if not (path / COMMIT_MARKER).is_file():
        raise CheckpointFailure(f"{path}: no {COMMIT_MARKER} marker; the save never finished, so it is not trusted")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointFailure(f"{path / MANIFEST}: unreadable checkpoint manifest ({exc})") from exc
    held = held_files(path)
    if held is not None and not held_only:
        raise CheckpointFailure(f"{path}: holds only this node's files of the checkpoint ({LOCAL_FILES}); the"
                                f" whole checkpoint is in storage once every node pushed its share")
    mine = share_of(held if held is not None else files, share)
    for name, meta in files.items():
        f = path / name
        if "/" in name or (name.startswith(".") and name != DCP_METADATA):
            raise CheckpointFailure(f"{path / MANIFEST}: file name {name!r} is not allowed")
        if held is not None and name not in held:
            continue
        if f.is_symlink() or not f.is_file():  # a link could name another pipeline's file, or a FIFO
            raise CheckpointFailure(f"{f}: listed in the manifest but missing, or not a regular file")
        if f.stat().st_size != meta["size"]:
            raise CheckpointFailure(f"{f}: size {f.stat().st_size} does not match the manifest ({meta['size']});"
                                    " truncated?")
        if name in mine and _sha256_regular(f) != meta["sha256"]:
            raise CheckpointFailure(f"{f}: sha256 does not match the manifest; the file was changed or corrupted")
    if held is not None and not held <= set(files):
        raise CheckpointFailure(f"{path / LOCAL_FILES}: names files the manifest does not list"
                                f" ({', '.join(sorted(held - set(files))[:3])})")
    return manifest


def _sha256_regular(f: Path) -> str | None:
    """The sha256 of `f` if it is still a regular file when opened (never following a link, never
    waiting on a FIFO swapped in since the check); None otherwise."""
    try:
        return sha256_file(f, regular_only=True)
    except OSError:
        return None


def share_of(names: Any, share: tuple[int, int] | None) -> set[str]:
    """Part `share[0]` of `parts` = `share[1]` of a checkpoint's file names, for ranks that split a check:
    every `parts`-th of the sorted DCP shard files, and of the other files, each from `part`. The same
    rank hashes a shard file and reads its pieces (`dcp.check`), so a damaged one is named by its hash."""
    if share is None:
        return set(names)
    part, parts = share
    shards = sorted(n for n in names if n.endswith(SHARD_SUFFIX))
    rest = sorted(n for n in names if not n.endswith(SHARD_SUFFIX))
    return set(shards[part::parts]) | set(rest[part::parts])


def held_files(path: Path) -> set[str] | None:
    """The files a node-local checkpoint directory holds (its `local-files.json`); None for a whole one."""
    f = Path(path) / LOCAL_FILES
    if not f.is_file():
        return None
    try:
        names = json.loads(f.read_text())["files"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise TypeError("files is not a list of names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointFailure(f"{f}: unreadable ({exc})") from exc
    return set(names)


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under root, oldest first (cheap check only)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_committed(p)), key=_step_of)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The checkpoint's trainer.json (step, epoch, history, the model section...); a missing or broken
    file is a CheckpointFailure naming it, not a bare OSError or JSONDecodeError."""
    f = Path(path) / TRAINER_STATE
    try:
        state = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointFailure(f"{f}: unreadable trainer state ({exc}); is {Path(path).name} a checkpoint?") from exc
    if not isinstance(state, dict):
        raise CheckpointFailure(f"{f}: trainer state is a JSON {type(state).__name__}, expected an object")
    return state


def recorded_model(path: Path) -> dict[str, Any]:
    """What the checkpoint records about the model it holds: the run config's model section
    {name, options, data}, enough to rebuild it without the spec that trained it.

    The stages rebuild the model from this rather than from the spec, so a checkpoint loaded against a
    spec edited since (another width, another feature shape) fails here, naming the file, instead of in
    load_state_dict with a tensor-shape message. A checkpoint of a Ballast before models came from entry
    points (its trainer.json holds `model: "mlp"` and the shapes beside it) is refused, saying so."""
    state = read_trainer_state(path)
    section = state.get(MODEL_KEY)
    where = Path(path) / TRAINER_STATE
    if isinstance(section, str):
        raise CheckpointFailure(f"{where}: written by an earlier Ballast (model {section!r} without its options and"
                                f" data); this version cannot rebuild it: train again, or use that version")
    if not isinstance(section, dict) or not all(k in section for k in ("name", "options", "data")):
        raise CheckpointFailure(f"{where}: records no model section (name, options, data); the model cannot be"
                                " rebuilt from this checkpoint (save it again with the current trainer)")
    return {"name": section["name"], "options": section["options"], "data": section["data"]}


class Writer:
    """Writes one checkpoint cooperatively from every rank (call the methods on all ranks in order).

    `node_local`: every node has a checkpoint directory of its own (`local_rank` says who leads on this
    node); `gather` then is the all-gather of a JSON object over the ranks (the checkpoint group)."""

    def __init__(self, root: Path, step: int, *, rank: int, barrier: Callable[[], Any], staging: Any = None,
                 local_rank: int = 0, node_local: bool = False, gather: Callable[[Any], list[Any]] | None = None):
        self.root = Path(root)
        self.step = step
        self.rank = rank
        self.barrier = barrier
        self.staging = staging if staging is not None else staging_buffer()
        self.final = self.root / step_dir_name(step)
        self.tmp = self.root / f".{step_dir_name(step)}.tmp"
        if node_local and gather is None:
            raise ValueError("a node-local checkpoint directory needs the all-gather of the file lists")
        self.node_local, self.gather = node_local, gather
        self.leader = local_rank == 0 if node_local else rank == 0
        """Whether this rank prepares, commits and prunes its (node's) checkpoint directory."""
        self.written: list[str] = []  # the files this rank wrote (or adopted)

    def begin(self) -> None:
        if self.leader:
            self.root.mkdir(parents=True, exist_ok=True)
            if self.tmp.exists():
                shutil.rmtree(self.tmp)  # left by a save that was killed
            self.tmp.mkdir()
        self.barrier()

    def write_tensors(self, name: str, obj: Any, *, zip_crc: bool = True) -> None:
        """torch.save into the checkpoint. `zip_crc=False` skips the zip format's CRC32 of every record
        (~0.2 s of CPU per GB; the manifest's sha256 is what loads trust): for the files only resume
        reads. The published weights keep it, for tools that check zip members."""
        import torch
        from torch.utils.serialization import config

        # Records aligned to 4096 in the file: a page-aligned tensor then goes to disk without staging.
        with self._open(name, expected_bytes(obj, per_tensor=5120)) as out, \
                config.patch({"save.compute_crc32": zip_crc, "save.storage_alignment": 4096}):
            torch.save(obj, out)

    def write_json(self, name: str, obj: Any) -> None:
        with self._open(name) as out:
            out.write(json.dumps(obj, indent=2, sort_keys=True).encode())

    def adopt(self, name: str, digest: tuple[str, int] | None = None) -> None:
        """Take a file written into the checkpoint by another writer (DCP's shards) into the manifest,
        with the (sha256, size) it was hashed to as it was written, or hashed here: by the rank that
        wrote it, so that no rank reads another's shards to commit."""
        f = self.tmp / name
        sha, size = digest or (sha256_file(f), f.stat().st_size)
        (self.tmp / f".{name}.sha256").write_text(f"{sha} {size}\n")
        self.written.append(name)

    @contextlib.contextmanager
    def _open(self, name: str, size: int = 0) -> Iterator[_FileWriter]:
        """A file in the checkpoint, hashed while it is written (commit needs no second read of it);
        the digest goes to a sidecar that commit folds into the manifest and removes. `size`: its
        expected size, reserved at open (fileio._FileWriter)."""
        out = open_file(self.tmp / name, self.staging, size)
        try:
            yield out
        except BaseException:
            out.abandon()
            raise
        out.close()
        (self.tmp / f".{name}.sha256").write_text(f"{out.digest.hexdigest()} {out.size}\n")
        self.written.append(name)

    def _entry(self, p: Path) -> dict[str, Any]:
        """The manifest's entry of file `p` (from its sidecar, which goes), checked against the disk."""
        side = self.tmp / f".{p.name}.sha256"
        digest, size = side.read_text().split() if side.exists() else (sha256_file(p), p.stat().st_size)
        if int(size) != p.stat().st_size:
            raise CheckpointFailure(f"{p}: {p.stat().st_size} bytes on disk, {size} written; refusing to commit")
        side.unlink(missing_ok=True)
        return {"size": int(size), "sha256": digest}

    def commit(self) -> Path:
        self.barrier()  # every rank has written and fsynced its files
        if self.node_local:
            # Each rank lists its own files; every node's leader gets the whole list (the same manifest).
            mine = {"created": time.time(), "files": {n: self._entry(self.tmp / n) for n in self.written}}
            shares = self.gather(mine)
            files = {name: meta for share in shares for name, meta in share["files"].items()}
            if self.leader:
                held = sorted(n for n in files if (self.tmp / n).is_file())
                self._finish({"step": self.step, "created": shares[0]["created"], "files": files}, held)
        elif self.rank == 0:
            files = {p.name: self._entry(p) for p in sorted(self.tmp.iterdir())
                     if p.is_file() and not (p.name.startswith(".") and p.name != DCP_METADATA)}
            self._finish({"step": self.step, "created": time.time(), "files": files}, None)
        self.barrier()
        return self.final

    def _finish(self, manifest: dict[str, Any], held: list[str] | None) -> None:
        """The leader's part: the manifest (and what this node holds), the rename, the marker last."""
        self.write_json(MANIFEST, manifest)
        if held is not None:
            self.write_json(LOCAL_FILES, {"files": held})
        for name in (MANIFEST, LOCAL_FILES):
            (self.tmp / f".{name}.sha256").unlink(missing_ok=True)
        _fsync_dir(self.tmp)
        if self.final.exists():  # same step saved again after a resume: replace it, marker first
            uncommit(self.final)
            shutil.rmtree(self.final)
        os.rename(self.tmp, self.final)
        marker = self.final / f".{COMMIT_MARKER}.tmp"
        marker.write_text(f"{self.step}\n")
        os.replace(marker, self.final / COMMIT_MARKER)
        _fsync_dir(self.final)
        _fsync_dir(self.root)


def uncommit(path: Path) -> None:
    """Take a checkpoint out of the valid ones before its files are removed or replaced: its marker
    goes first, durably, so that a kill while the rest goes leaves nothing that looks committed."""
    path = Path(path)
    (path / COMMIT_MARKER).unlink(missing_ok=True)
    if path.is_dir():
        _fsync_dir(path)


def prune(root: Path, *, keep_last: int, keep: set[int] = frozenset(), log: Callable[[str], Any] = print,
          memo: dict[Path, tuple] | None = None) -> list[Path]:
    """Delete the checkpoints older than the newest `keep_last` that verify, except steps in `keep` (the
    best). One that fails `verify` is not counted: a damaged newer checkpoint never costs a good older
    one its place; newer than those kept, it is left for the verification gate to quarantine.

    `memo` (kept by the caller from prune to prune): checkpoints already verified, by the identity of
    their marker and manifest files, so that a save does not hash the last `keep_last` again (a
    preemption's synchronous save waits for its prune); a checkpoint saved again has new ones."""
    done = committed(root)
    kept, cut = 0, 0
    for i in range(len(done) - 1, -1, -1):
        if kept >= keep_last:
            cut = i + 1
            break
        try:
            _verify_once(done[i], memo)  # a node-local directory: the files this node holds
            kept += 1
        except CheckpointFailure as exc:
            log(f"checkpoint not counted towards keep_last: {exc}")
    removed = []
    for path in done[:cut]:
        if _step_of(path) in keep:
            continue
        uncommit(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _verify_once(path: Path, memo: dict[Path, tuple] | None) -> None:
    if memo is None:
        verify(path, held_only=True)
        return
    try:
        ident = tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in ((path / COMMIT_MARKER).stat(),
                                                                     (path / MANIFEST).stat()))
    except OSError:
        ident = None
    if ident is None or memo.get(path) != ident:
        verify(path, held_only=True)
        memo[path] = ident
