"""Shared memory for the snapshot buffers of asynchronous saves: page-aligned buffers carved from memfd
regions, which the checkpoint writer process maps too (checkpoint.writer_process). Linux only; importing
this module does not import torch."""

from __future__ import annotations

import bisect
import mmap
import os
import sys
import threading

from ballast.training.checkpoint import fileio

PAGE = 4096
REGION = 256 << 20
"""Bytes of shared memory per memfd region of the arena (a larger buffer gets a region of its own): a
~1 GiB state in ~4 descriptors, not one per tensor."""


class _Region:
    def __init__(self, rid: int, size: int):
        self.id, self.size, self.used = rid, size, 0
        self.fd = os.memfd_create(f"ballast-snapshot-{rid}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)  # MAP_SHARED: the writer process maps the same pages
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)
        self.start = fileio._address(self.view)


class Arena:
    """Page-aligned buffers in shared memory (memfd regions), kept for the life of the process (a
    Snapshot's buffers are reused from one save to the next); `find` tells which region a written
    range of bytes lies in."""

    def __init__(self) -> None:
        self.regions: list[_Region] = []  # by start address
        self._starts: list[int] = []
        self._current: _Region | None = None  # the REGION-sized one buffers are carved from
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> memoryview:
        size = -(-max(nbytes, 1) // PAGE) * PAGE
        with self._lock:
            if size > REGION:
                region = self._new(size)  # a region of its own
            else:
                if self._current is None or self._current.size - self._current.used < size:
                    self._current = self._new(REGION)
                region = self._current
            off = region.used
            region.used += size
        return region.view[off:off + nbytes]

    def _new(self, size: int) -> _Region:
        region = _Region(len(self.regions), size)
        at = bisect.bisect(self._starts, region.start)
        self._starts.insert(at, region.start)
        self.regions.insert(at, region)
        return region

    def find(self, address: int, nbytes: int) -> tuple[_Region, int] | None:
        """(the region, offset in it) holding [address, address + nbytes), or None."""
        at = bisect.bisect(self._starts, address) - 1
        if at < 0:
            return None
        region = self.regions[at]
        off = address - region.start
        return (region, off) if off + nbytes <= region.size else None

    def by_id(self, rid: int) -> _Region:
        return next(r for r in self.regions if r.id == rid)


_ARENA: Arena | None = None
_ARENA_LOCK = threading.Lock()


def available() -> bool:
    """Whether saves can be written by a writer process here (Linux's memfd_create)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


def arena() -> Arena | None:
    """This process's shared-memory arena (None where there is no memfd)."""
    global _ARENA
    if not available():
        return None
    with _ARENA_LOCK:
        if _ARENA is None:
            _ARENA = Arena()
        return _ARENA


def shared_buffer(nbytes: int) -> memoryview | None:
    """A page-aligned, writable buffer of `nbytes` in the shared arena; None where there is none."""
    a = arena()
    if a is None:
        return None
    try:
        return a.alloc(nbytes)
    except OSError:  # memfd refused (a seccomp profile, a full /dev/shm-like limit): private memory instead
        return None
