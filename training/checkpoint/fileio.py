"""Checkpoint file I/O: the O_DIRECT writer that hashes as it writes, and the tensor-only loader.

Kept apart from the commit protocol (commit.py): this module knows how bytes reach the disk and come
back, not which files make a checkpoint or when it may be trusted. Importing it does not import torch.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

from ballast.training.failure import CheckpointFailure


def sha256_file(path: Path, chunk: int = 1 << 20, *, regular_only: bool = False) -> str:
    """The sha256 of a file, read in chunks (a checkpoint file may not fit in memory twice).
    `regular_only`: opened without following a link or waiting on a FIFO, and an OSError unless it is a
    regular file (a checkpoint's file, which anyone who can write to storage can swap)."""
    h = hashlib.sha256()
    flags = os.O_RDONLY | os.O_CLOEXEC | ((os.O_NOFOLLOW | os.O_NONBLOCK) if regular_only else 0)
    with os.fdopen(os.open(path, flags), "rb") as fh:
        if regular_only and not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OSError(f"{path}: not a regular file")
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def load_tensors(path: Path, *, mmap: bool = False) -> Any:
    """Load a tensor file without unpickling arbitrary objects: safetensors (`.safetensors`, what publish
    writes; or the index of a sharded one, `model.safetensors.index.json`, its shards beside it) or a
    torch file read with `weights_only` (checkpoints); `mmap`: a torch file's tensors are views of the
    file mapped in (pages read as they are used, clean pages the kernel can take back), not copies."""
    import torch

    if Path(path).name.endswith(".safetensors.index.json"):
        from ballast.training.checkpoint.published import load_sharded

        return load_sharded(Path(path))
    try:
        if Path(path).suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError... for a bad file
        raise CheckpointFailure(f"{path}: cannot load as a tensor file ({type(exc).__name__}: {exc})") from exc


class _FileWriter:
    """Writes one checkpoint file, hashing (sha256) and counting what goes through it.

    The bytes go through a reused, page-aligned staging buffer and reach the file with O_DIRECT where
    the filesystem takes it: a checkpoint of ~1 GB then neither allocates ~1 GB of page cache (on a
    small VM here, the first buffered write of 0.55 GB cost 1.3 s of kernel time against 0.01 s direct)
    nor pushes the data shards a staged cache keeps warm out of it. Each slice of HASH_APART bytes or more
    is hashed in a thread of its own while the same slice is written (hashlib and os.write both release
    the GIL): a save takes the longer of the two where a core is free, not their sum. A large tensor whose memory is page-aligned (the snapshot buffers are) and
    whose record starts on a block boundary in the file (`Writer.write_tensors` aligns records to
    4096) skips the staging copy: its blocks go from the snapshot to the disk. Where O_DIRECT is
    refused (tmpfs, some network filesystems, macOS) the same slices go through ordinary buffered
    writes. The file is fsynced at close. It is also the stream DCP writes a shard through
    (`checkpoint.dcp`: write, tell, fileno for DCP's own fsync, close, which DCP calls itself).

    `size`: the file's expected size where the caller knows it (a plan's, a rank's shard's), reserved
    at open (`fallocate`) and the file truncated to what was written at close. O_DIRECT writes
    bypass the filesystem's delayed allocation, so without it the ranks saving side by side get their
    blocks in turns, 8 MiB each (ext4 here: 23-34 extents per 270 MiB shard of 4 ranks saving at once,
    3-11 reserved), and every later read of a shard skips over the other ranks' blocks.
    """

    BLOCK = 4096  # O_DIRECT offsets and lengths: a multiple of the device's logical block size
    HASH_APART = 1 << 20  # smaller slices (a file's last, the JSON files) are hashed inline

    def __init__(self, path: Path, staging: Any, size: int = 0):
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
        self.reserved = size > 0 and _reserve(self.fd, size)
        self.closed = False
        self.error: BaseException | None = None  # what a write raised (torch.save reports only its effect)

    def write(self, data) -> int:
        try:
            return self._write(data)
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.fd

    def _write(self, data) -> int:
        src = memoryview(data).cast("B")
        n, at = src.nbytes, 0
        if self.direct and n >= len(self.view) and (self.written + self.pos) % self.BLOCK == 0 \
                and _address(src) % self.BLOCK == 0:
            if self.pos:
                self._drain(self.pos)  # what is staged: whole blocks, as the record starts on a block
            if self.direct:  # still: a filesystem that refused that first write made this file buffered
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
        """Hash the first `length` bytes of `out` (all of it by default) and write `out`; both at once
        for a large slice (the caller reuses `out` once this returns: the hash is done by then)."""
        length = out.nbytes if length is None else length
        hasher, spent = None, []
        if length >= self.HASH_APART:
            def hash_slice(view: memoryview = out[:length]) -> None:
                c0 = time.thread_time()
                self.digest.update(view)
                spent.append(time.thread_time() - c0)

            hasher = threading.Thread(target=hash_slice, name="ckpt-hash", daemon=True)
            hasher.start()
        else:
            self.digest.update(out[:length])
        try:
            self._write_out(out, length)
        finally:
            if hasher is not None:
                hasher.join()
                _HELPERS.seconds = helper_cpu_seconds() + sum(spent)

    def _write_out(self, out: memoryview, length: int) -> None:
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

    def abandon(self) -> None:
        """Close the descriptor without completing the file (a failed save: the directory is discarded)."""
        if not self.closed:
            self.closed = True
            os.close(self.fd)

    def close(self) -> None:
        """The last slice, the truncation, fsync; the descriptor is closed whatever happens. Once."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.pos:
                self._drain(self.pos)
            if self.direct or self.reserved:  # the last block's padding, what was reserved and not written
                os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)


_HELPERS = threading.local()
_OFFLOAD = threading.local()


class offloading:
    """Within it, the checkpoint files this thread opens (`open_file`) are written by `process`, a
    checkpoint.writer_process.WriterProcess (None: by this thread)."""

    def __init__(self, process: Any):
        self.process = process

    def __enter__(self) -> None:
        self.before = getattr(_OFFLOAD, "process", None)
        _OFFLOAD.process = self.process

    def __exit__(self, *exc: Any) -> None:
        _OFFLOAD.process = self.before


def open_file(path: Path, staging: Any, size: int = 0) -> Any:
    """A checkpoint file's stream, hashed as it is written: a _FileWriter, or within `offloading` a
    writer_process.PlanWriter (the same interface), whose bytes the writer process writes (the plan's
    size reserved there). `size`: the expected size, reserved at open (_FileWriter)."""
    process = getattr(_OFFLOAD, "process", None)
    if process is not None and process.alive():
        return process.open(path, staging)
    return _FileWriter(path, staging, size)


@functools.cache
def _fallocate() -> Any:
    """libc's fallocate(2), or None (not Linux). Not `os.posix_fallocate`: where a filesystem has no
    fallocate (NFS v3, some FUSE), glibc's posix_fallocate writes a byte into every block instead,
    a second pass over the whole file."""
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate64
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


def _reserve(fd: int, size: int) -> bool:
    """Reserve `size` bytes of blocks for the file at `fd` (it grows to `size`); whether it was done. A
    filesystem without it (EOPNOTSUPP) or a full disk leaves it unreserved: the writes then say."""
    call = _fallocate()
    return call is not None and call(fd, 0, 0, size) == 0


def expected_bytes(obj: Any, *, per_tensor: int) -> int:
    """About the size of a file that torch.saves the tensors in `obj` (nested dicts, lists): their bytes
    (a DTensor's local shard's) and `per_tensor` for each record's zip headers and alignment, for
    _FileWriter's `size`. A tensor that only rank 0 writes (DCP's deduplicated ones) counts on every
    rank: small, and the file is truncated to what was written."""
    total = 0
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "untyped_storage"):
            local = item.to_local() if hasattr(item, "to_local") else item
            total += local.numel() * local.element_size() + per_tensor
    return total


def helper_cpu_seconds() -> float:
    """The CPU time the hashing threads this thread started have used so far: with its own
    `time.thread_time()`, what its writes cost (the saver's `write_cpu_seconds`)."""
    return getattr(_HELPERS, "seconds", 0.0)


def _address(buf: memoryview) -> int:
    """Where a (possibly read-only) buffer's bytes start in memory."""
    import numpy as np

    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def staging_buffer(size: int = 8 << 20) -> Any:
    """A page-aligned buffer (anonymous mmap) for _FileWriter; keep one per saver and reuse it."""
    import mmap

    return mmap.mmap(-1, size)
