"""Host-memory reuse for training processes (`training.reuse_freed_memory`, on by default), and its
opposite for a model streamed block by block.

glibc's malloc serves every block above its mmap threshold (at most 32 MiB by default) with a fresh
`mmap` and gives it back with `munmap` when freed. A training step allocates and frees the same
parameter-sized blocks every time (weight gradients, optimizer and clipping intermediates), so each
step the kernel maps, zeroes and faults in every page again: on the 90M-parameter CPU bench model,
~2 million page faults in 10 s over two ranks, with 40% of the CPU time in the kernel. Raising the
mmap threshold and the trim threshold keeps freed blocks in the heap for the next step (page faults
~500 in 10 s; 25 samples/s against 16-18 in the same 60 s run here). The cost: memory a step has
freed stays with the process, so its resident size stays at the step's peak.

A process that reads large blocks once each and frees them (a model streamed block by block:
`training.checkpoint.streamed`; the data stages' Parquet readers, `ballast.data`) wants the opposite,
`return_freed_memory`: the threshold fixed at glibc's
initial 128 KiB, so that freeing a block gives its pages back. Left sliding, glibc raises the threshold
to the size of the first block freed, and the next blocks come from the heap, which grows with each pass
(measured on a 100 MB gpt streamed in 12.6 MB blocks: 40 then 57 MB resident after two passes, against
19 MB with the threshold fixed; validating 512 MiB of 16 MiB row groups: the address space grew 28 MiB
on an idle machine and 160 MiB with two busy cores beside it, against 5 MiB fixed).

An explicit `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` in the environment wins; on a C library
other than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks larger than 1 GiB still come from (and go back to) the OS directly
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: free heap top above ~2 GiB is returned


RETURN_MMAP_THRESHOLD = 128 << 10  # glibc's initial threshold, held there


def keep_freed_memory() -> dict[str, int]:
    """Set glibc's thresholds for this process (and processes it forks); returns what was set."""
    return _mallopt((("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                     ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


def return_freed_memory() -> dict[str, int]:
    """Fix glibc's mmap threshold at its initial value for this process: blocks above it are mapped on
    their own and unmapped when freed. Returns what was set."""
    return _mallopt((("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, RETURN_MMAP_THRESHOLD),))


def _mallopt(settings: tuple[tuple[str, int, int], ...]) -> dict[str, int]:
    if platform.libc_ver()[0] != "glibc":
        return {}
    libc = ctypes.CDLL(None)
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done: dict[str, int] = {}
    for env, param, value in settings:
        if env not in os.environ and mallopt(param, value) == 1:
            done[env.strip("_").lower()] = value
    return done
