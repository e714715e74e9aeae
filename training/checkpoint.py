"""Committed checkpoints: the one predicate for "this checkpoint may be trusted".

Layout of a checkpoint directory `step-00000040/`:
    model.pt               the model's weights (tensors only; loaded with weights_only=True), from rank 0
    optim-part<R>.pt       the optimizer state in parts: under DDP every rank holds the same state and
                           rank R writes a share of it balanced by bytes (rank 0's share counts the
                           model), so the write is spread over the ranks; under FSDP rank 0 writes one
                           part from the gathered state. Part 0 holds the parameter groups.
    rng-rank<R>.pt         every rank's RNG state
    trainer.json           step, epoch, position in the epoch, metric history, early-stopping state
    manifest.json          size and sha256 of every file above
    COMMITTED              written last, after the directory got its final name

A save writes into `.step-00000040.tmp/`, fsyncs every file, writes the manifest, renames the
directory and then writes COMMITTED. A directory without COMMITTED, or whose files do not match its
manifest, is invisible to `latest_valid` and refused by `verify`: a kill at any moment of a save
leaves the previous checkpoint as the latest valid one.

Importing this module does not import torch (the verification stage uses it at DAG-run time).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from training.failure import CheckpointFailure

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


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


def verify(path: Path) -> dict[str, Any]:
    """Full check: committed, and every file matches the manifest's size and sha256. Returns the manifest."""
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
    for name, meta in files.items():
        f = path / name
        if "/" in name or name.startswith("."):
            raise CheckpointFailure(f"{path / MANIFEST}: file name {name!r} is not allowed")
        if not f.is_file():
            raise CheckpointFailure(f"{f}: listed in the manifest but missing")
        if f.stat().st_size != meta["size"]:
            raise CheckpointFailure(f"{f}: size {f.stat().st_size} does not match the manifest ({meta['size']}); truncated?")
        if sha256_file(f) != meta["sha256"]:
            raise CheckpointFailure(f"{f}: sha256 does not match the manifest; the file was changed or corrupted")
    return manifest


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under root, oldest first (cheap check only)."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if is_committed(p)]
    return sorted(dirs, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_valid(root: Path, log=print) -> Path | None:
    """Newest checkpoint that is committed and verifies; damaged ones are reported and skipped."""
    for path in reversed(committed(root)):
        try:
            verify(path)
            return path
        except CheckpointFailure as exc:
            log(f"checkpoint skipped: {exc}")
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "trainer.json").read_text())


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


def load_tensors(path: Path) -> Any:
    """Load a tensor file without unpickling arbitrary objects."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError... for a bad file
        raise CheckpointFailure(f"{path}: cannot load as a tensor file ({type(exc).__name__}: {exc})") from exc


class _FileWriter:
    """Writes one checkpoint file, hashing (sha256) and counting what goes through it.

    The bytes go through a reused, page-aligned staging buffer and reach the file with O_DIRECT where
    the filesystem takes it: a checkpoint of ~1 GB then neither allocates ~1 GB of page cache (on a
    small VM here, the first buffered write of 0.55 GB cost 1.3 s of kernel time against 0.01 s direct)
    nor pushes the data shards a staged cache keeps warm out of it. Each staged slice is hashed while it
    is in the CPU cache. A large tensor whose memory is page-aligned (the snapshot buffers are) and
    whose record starts on a block boundary in the file (`Writer.write_tensors` aligns records to
    4096) skips the staging copy: its blocks go from the snapshot to the disk. Where O_DIRECT is
    refused (tmpfs, some network filesystems, macOS) the same slices go through ordinary buffered
    writes. The file is fsynced at close.
    """

    BLOCK = 4096  # O_DIRECT offsets and lengths: a multiple of the device's logical block size

    def __init__(self, path: Path, staging: Any):
        self.path = path
        self.view = memoryview(staging)
        self.digest, self.size, self.pos, self.written = hashlib.sha256(), 0, 0, 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = False
        if hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError:
                pass
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)

    def write(self, data) -> int:
        src = memoryview(data).cast("B")
        n, at = src.nbytes, 0
        if self.direct and n >= len(self.view) and (self.written + self.pos) % self.BLOCK == 0 \
                and _address(src) % self.BLOCK == 0:
            if self.pos:
                self._drain(self.pos)  # what is staged: whole blocks, as the record starts on a block
            at = n - n % self.BLOCK
            for lo in range(0, at, len(self.view)):
                self._emit(src[lo:min(lo + len(self.view), at)])
        while at < n:
            k = min(n - at, len(self.view) - self.pos)
            self.view[self.pos:self.pos + k] = src[at:at + k]
            self.pos += k
            at += k
            if self.pos == len(self.view):
                self._drain(self.pos)
        self.size += n
        return n

    def flush(self) -> None:
        pass  # torch.save flushes; the staging buffer is drained in whole blocks, the rest at close

    def _drain(self, length: int) -> None:
        end = length
        if self.direct and length % self.BLOCK:  # the last slice: zero-padded, the file truncated after
            end = -(-length // self.BLOCK) * self.BLOCK
            self.view[length:end] = bytes(end - length)
        self._emit(self.view[:end], length)
        self.pos = 0

    def _emit(self, out: memoryview, length: int | None = None) -> None:
        """Hash the first `length` bytes of `out` (all of it by default) and write `out`."""
        length = out.nbytes if length is None else length
        self.digest.update(out[:length])
        while out.nbytes:
            try:
                done = os.write(self.fd, out)
            except OSError:
                if not self.direct or self.written:
                    raise
                # Accepted at open, refused at the first write (some FUSE and network filesystems):
                # nothing is on disk yet, so start again with buffered writes.
                os.close(self.fd)
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self.direct = False
                out = out[:length]
                continue
            out = out[done:]
            self.written += done

    def close(self) -> None:
        try:
            if self.pos:
                self._drain(self.pos)
            if self.direct:
                os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)


def _address(buf: memoryview) -> int:
    """Where a (possibly read-only) buffer's bytes start in memory."""
    import numpy as np

    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def staging_buffer(size: int = 8 << 20) -> Any:
    """A page-aligned buffer (anonymous mmap) for _FileWriter; keep one per saver and reuse it."""
    import mmap

    return mmap.mmap(-1, size)


class Writer:
    """Writes one checkpoint cooperatively from every rank (call the methods on all ranks in order)."""

    def __init__(self, root: Path, step: int, *, rank: int, barrier, staging: Any = None):
        self.root = Path(root)
        self.step = step
        self.rank = rank
        self.barrier = barrier
        self.staging = staging if staging is not None else staging_buffer()
        self.final = self.root / step_dir_name(step)
        self.tmp = self.root / f".{step_dir_name(step)}.tmp"

    def begin(self) -> None:
        if self.rank == 0:
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
        with self._open(name) as out, config.patch({"save.compute_crc32": zip_crc, "save.storage_alignment": 4096}):
            torch.save(obj, out)

    def write_json(self, name: str, obj: Any) -> None:
        with self._open(name) as out:
            out.write(json.dumps(obj, indent=2, sort_keys=True).encode())

    @contextlib.contextmanager
    def _open(self, name: str):
        """A file in the checkpoint, hashed while it is written (commit needs no second read of it);
        the digest goes to a sidecar that commit folds into the manifest and removes."""
        out = _FileWriter(self.tmp / name, self.staging)
        try:
            yield out
        except BaseException:
            os.close(out.fd)
            raise
        out.close()
        (self.tmp / f".{name}.sha256").write_text(f"{out.digest.hexdigest()} {out.size}\n")

    def commit(self) -> Path:
        self.barrier()  # every rank has written and fsynced its files
        if self.rank == 0:
            files = {}
            for p in sorted(self.tmp.iterdir()):
                if not p.is_file() or p.name.startswith("."):
                    continue
                side = self.tmp / f".{p.name}.sha256"
                digest, size = side.read_text().split() if side.exists() else (sha256_file(p), p.stat().st_size)
                if int(size) != p.stat().st_size:
                    raise CheckpointFailure(f"{p}: {p.stat().st_size} bytes on disk, {size} written; refusing to commit")
                files[p.name] = {"size": int(size), "sha256": digest}
                side.unlink(missing_ok=True)
            self.write_json(MANIFEST, {"step": self.step, "created": time.time(), "files": files})
            (self.tmp / f".{MANIFEST}.sha256").unlink(missing_ok=True)
            _fsync_dir(self.tmp)
            if self.final.exists():  # same step saved again after a resume: replace it
                shutil.rmtree(self.final)
            os.rename(self.tmp, self.final)
            marker = self.final / f".{COMMIT_MARKER}.tmp"
            marker.write_text(f"{self.step}\n")
            os.replace(marker, self.final / COMMIT_MARKER)
            _fsync_dir(self.final)
            _fsync_dir(self.root)
        self.barrier()
        return self.final


def prune(root: Path, *, keep_last: int, keep: set[int] = frozenset()) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep_last`, except steps in `keep` (the best)."""
    done = committed(root)
    removed = []
    for path in done[:-keep_last] if keep_last else done:
        step = int(_STEP_DIR.match(path.name).group(1))
        if step in keep:
            continue
        (path / COMMIT_MARKER).unlink(missing_ok=True)  # uncommit first: a partial delete is never trusted
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class AsyncSaver:
    """Writes checkpoint snapshots in a background thread, one save in flight at a time.

    Training is blocked only while the snapshot is taken (a CPU copy of the state). The writer's
    barriers run on a process group of their own (`barrier`), never on the training group, so its
    collectives cannot interleave with training's (the hang seen with async_save on the training group).

    With `idle`, the background writer runs in Linux's SCHED_IDLE class: it gets a core only when
    nothing else wants it, so hashing and serialising ~1 GB does not take CPU time from training (on
    a 2-core machine running two ranks, a save at normal priority cost each step loop ~0.5 s). A
    caller that waits for the write (the next save, the end of the run) leaves its own core idle,
    which the writer then gets; the writer is also put back to normal priority where the process is
    allowed to (raising a priority may need CAP_SYS_NICE). Synchronous saves run in the caller's
    thread at its priority.
    """

    def __init__(self, root: Path, *, rank: int, barrier, keep_last: int, log=print, idle: bool = False,
                 on_written=None):
        self.root = Path(root)
        self.rank = rank
        self.barrier = barrier
        self.keep_last = keep_last
        self.log = log
        self.idle = idle
        self.on_written = on_written  # (step, seconds), from the writer once a checkpoint is committed
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: Path | None = None
        self._staging = staging_buffer()  # one save at a time: the writer's staging buffer is reused

    def save(self, step: int, tensors: dict[str, Any], jsons: dict[str, Any], *, keep: set[int],
             asynchronous: bool = True) -> None:
        self.wait()
        args = (step, tensors, jsons, keep)
        if not asynchronous:
            self._write(*args)
            self.wait()
            return
        self._thread = threading.Thread(target=self._write, args=args, name=f"ckpt-{step}", daemon=True)
        self._thread.start()

    def _write(self, step: int, tensors: dict[str, Any], jsons: dict[str, Any], keep: set[int]) -> None:
        t0 = time.monotonic()
        if self.idle and threading.current_thread() is self._thread:
            _set_policy(0, "SCHED_IDLE")
        try:
            w = Writer(self.root, step, rank=self.rank, barrier=self.barrier, staging=self._staging)
            w.begin()
            for name, obj in tensors.items():
                w.write_tensors(name, obj, zip_crc=name == "model.pt")
            for name, obj in jsons.items():
                w.write_json(name, obj)
            self.last_path = w.commit()
            if self.rank == 0:
                prune(self.root, keep_last=self.keep_last, keep=keep)
            if self.on_written is not None:
                self.on_written(step, time.monotonic() - t0)
        except BaseException as exc:  # surfaced to the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        if self._thread is not None:
            if self.idle and self._thread.is_alive() and self._thread.native_id is not None:
                _set_policy(self._thread.native_id, "SCHED_OTHER")  # someone waits for it now
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            raise CheckpointFailure(f"{self.root}: checkpoint save failed: {exc}") from exc


def _set_policy(tid: int, policy: str) -> bool:
    """Set a thread's scheduling policy (Linux: per thread; 0 = the calling thread); False where the
    OS has no such policy or refuses the change."""
    try:
        os.sched_setscheduler(tid, getattr(os, policy), os.sched_param(0))
        return True
    except (AttributeError, OSError):
        return False


def average(paths: list[Path]) -> dict[str, Any]:
    """Mean of the model weights of several checkpoints (the seed documents' mean of the last 3)."""
    import torch

    if not paths:
        raise CheckpointFailure("no checkpoints to average")
    states = [load_tensors(Path(p) / "model.pt") for p in paths]
    keys = states[0].keys()
    for p, st in zip(paths, states):
        if st.keys() != keys:
            raise CheckpointFailure(f"{p}: holds other tensors than {paths[0]}; cannot average different models")
    out = {}
    for k in keys:
        t = states[0][k]
        out[k] = (torch.stack([st[k].double() for st in states]).mean(0).to(t.dtype)
                  if torch.is_floating_point(t) else t.clone())
    return out
