"""The node-local cache directory, shared by every run on the node: `<cache.directory>/<pipeline>/<dataset_id>/`.

Two runs of one pipeline (a backfill beside a scheduled run) warm the same dataset at once, so each
cached file has one writer at a time: `writing(dst)` holds an exclusive lock on `.<name>.lock` beside
it while the file is streamed in (the other writer waits, then finds it verified). A dataset directory
is in use while a try warms or reads it: the process holds a shared lock on its `.in-use` file
(`in_use`), which also marks the directory as a Ballast dataset. `cache.max_bytes` covers every
dataset in the cache directory: `make_room` evicts the least recently used datasets whose exclusive
lock it can take without waiting, never one a running try holds, and nothing that is not a dataset.

Locks are `flock`s: they end with the process that holds them (a killed try never pins a dataset).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

IN_USE = ".in-use"
_TRASH = ".evicting-"


def _is_bookkeeping(path: Path) -> bool:
    return path.name == IN_USE or path.name.endswith((".lock", ".part"))


@contextmanager
def _locked(path: Path, mode: int, *, remove: bool = False) -> Iterator[int]:
    """An flock on `path` (created if missing) that is still the file at `path` once held: an eviction
    may have moved the directory away, or the last holder removed the file (`remove`), between the open
    and the lock; a waiter then takes the lock again on the new file."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    yield fd
                finally:
                    if remove:
                        Path(path).unlink(missing_ok=True)
                return
        finally:
            os.close(fd)


@contextmanager
def in_use(dataset_dir: Path) -> Iterator[None]:
    """Hold `dataset_dir` against eviction while a try warms or reads it; marks it used now (LRU)."""
    with _locked(Path(dataset_dir) / IN_USE, fcntl.LOCK_SH):
        os.utime(dataset_dir)
        yield


def hold(dataset_dir: Path) -> int:
    """`in_use` for the rest of this process (a cluster node's launcher): the lock ends with it."""
    path = Path(dataset_dir) / IN_USE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.utime(dataset_dir)
    return fd


@contextmanager
def writing(dst: Path) -> Iterator[None]:
    """The one writer of cached file `dst` (and its `.part`) across threads and processes."""
    with _locked(dst.with_name(f".{dst.name}.lock"), fcntl.LOCK_EX, remove=True):
        yield


def usage(root: Path) -> int:
    """Bytes of files under `root` (locks and partial downloads not counted)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            if not _is_bookkeeping(path):
                try:
                    total += path.stat().st_size
                except FileNotFoundError:  # evicted or renamed meanwhile
                    pass
    return total


def datasets(root: Path) -> list[Path]:
    """Ballast's dataset directories under `root` (`<pipeline>/<dataset_id>/` that a warm-up marked with
    its `.in-use` file), least recently used first. Anything else there is not Ballast's (a user's
    folder, a cluster node's own cache root `node-<host>/`, which has its own budget) and is never
    counted or evicted."""
    root = Path(root)
    found = [d for p in root.iterdir() if p.is_dir() and not p.name.startswith(_TRASH)
             for d in p.iterdir() if (d / IN_USE).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda d: d.stat().st_mtime)


def make_room(root: Path, *, keep: Path, need: int, budget: int, log: logging.Logger) -> tuple[int, list[Path]]:
    """Evict least recently used datasets under `root` (never `keep`, never one in use) until `need` more
    bytes fit in `budget`. Returns the bytes Ballast's datasets use afterwards and those still in use."""
    found = datasets(root)
    sizes = {d: usage(d) for d in found}
    used, busy = sum(sizes.values()), []
    for d in found:
        if used + need <= budget:
            break
        if d.resolve() == Path(keep).resolve():
            continue
        try:
            fd = os.open(d / IN_USE, os.O_RDWR)  # never created here: only a warm-up marks a dataset
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy.append(d)
                continue
            trash = Path(root) / f"{_TRASH}{uuid.uuid4().hex}"
            os.rename(d, trash)  # at once: a warm-up starting now makes a fresh directory
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        used -= sizes[d]
        log.info("cache.max_bytes: evicted %s (%d bytes, least recently used)", d, sizes[d])
    return used, busy
