"""Where an asynchronous save's write goes slow on a GPU machine (README, `bench sharded-checkpoint
--device cuda`): ~1.1 GB written through Ballast's DCP writer from (a) the CUDA state, as a synchronous
save writes it, (b) a pinned snapshot (Snapshot(pin=True), what an asynchronous save writes on a GPU),
(c) a pageable page-aligned one (the CPU snapshot), (d) a snapshot in shared memory (page-locked with
cudaHostRegister on a GPU) written by the checkpoint writer process (what an asynchronous save does
now, training.checkpoint.writer_process); alone (wall and thread CPU seconds, twice each), and
in a thread beside a GPU loop (the loop's steps per second), at SCHED_IDLE as the saver runs it and at
normal priority.

Not a test: on the GPU machine, `python tests/gpu_checkpoint_write.py [DIR]` (writes under DIR, default
/tmp/ballast-write-probe; prints the figures as JSON). On a machine without a GPU it runs (a) and (c) on
a small state, a check of the script itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path


def main(root: Path) -> dict:
    import torch
    from ballast.training.checkpoint import dcp
    from ballast.training.checkpoint import arena, writer_process
    from ballast.training.checkpoint.fileio import helper_cpu_seconds, offloading, staging_buffer
    from ballast.training.checkpoint.saver import _set_policy
    from ballast.training.checkpoint.snapshot import Snapshot

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    state = {f"t{i}": torch.randn(2_850_000 if cuda else 100_000, device=dev) for i in range(100)}
    sync()
    out: dict = {"device": str(torch.cuda.get_device_name(0) if cuda else "cpu"), "torch": torch.__version__,
                 "state_bytes": sum(t.numel() * 4 for t in state.values())}
    block = bytes(512 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(block).digest()
    out["sha256_GB_per_s"] = round(0.5 / (time.perf_counter() - t0), 2)
    del block
    staging = staging_buffer()
    root.mkdir(parents=True, exist_ok=True)
    names = iter(range(1_000_000))

    def settle() -> None:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1")
        except OSError:
            pass

    proc = writer_process.WriterProcess(idle=False) if arena.available() else None

    def write(st: dict, idle: bool = False, by: object = None) -> tuple[float, float]:
        """(wall, CPU: this thread's and, for the writer process, its own) seconds."""
        d = root / f"w{next(names)}"
        d.mkdir()
        if idle:
            _set_policy(0, "SCHED_IDLE")
        if by is not None:
            by.set_idle(idle)
        t0, c0 = time.perf_counter(), time.thread_time() + helper_cpu_seconds()
        with offloading(by):
            dcp.write(st, d, rank=0, group=None, staging=staging)
        took = (round(time.perf_counter() - t0, 3), round(time.thread_time() + helper_cpu_seconds() - c0, 3))
        shutil.rmtree(d)
        return took

    kinds = {"pinned": (True, False), "pageable": (False, False)} if cuda else {"pageable": (False, False)}
    if proc is not None:
        kinds["shared_process"] = (cuda, True)
    snaps = {}
    for kind, (pin, shared) in kinds.items():
        snap = Snapshot(pin=pin, shared=shared)
        snap.copy(state)  # the buffers, allocated once as the saver keeps them
        sync()
        t0 = time.perf_counter()
        snaps[kind] = snap.copy(state)
        sync()
        out[f"snapshot_{kind}_seconds"] = round(time.perf_counter() - t0, 3)
        if shared:
            out["shared_snapshot_page_locked"] = cuda and not snap.unpinned
    by = {"shared_process": proc}
    for _ in range(2):
        for kind, st in [("from_device", state), *snaps.items()]:
            settle()
            out.setdefault(f"write_alone_{kind}_wall_cpu", []).append(write(st, by=by.get(kind)))

    x = torch.randn(*((8192, 8192) if cuda else (512, 512)), device=dev)

    def loop(seconds: float | None = None, stop: threading.Event | None = None) -> float:
        k, t0 = 0, time.perf_counter()
        while (stop is not None and not stop.is_set()) or (seconds is not None and time.perf_counter() - t0 < seconds):
            (x @ x).sum().item()
            k += 1
        return k / (time.perf_counter() - t0)

    loop(1.0)
    out["loop_steps_per_s_alone"] = round(loop(2.0), 2)
    for kind, st in snaps.items():
        for idle in (True, False):
            settle()
            took: dict = {}
            stop = threading.Event()

            def background(st: dict = st, idle: bool = idle, took: dict = took, stop: threading.Event = stop,
                           kind: str = kind) -> None:
                took["write"] = write(st, idle, by.get(kind))
                stop.set()

            thread = threading.Thread(target=background)
            thread.start()
            rate = loop(stop=stop)
            thread.join()
            out[f"write_beside_loop_{kind}_{'idle' if idle else 'normal'}"] = {
                "wall_cpu": took["write"], "loop_steps_per_s": round(rate, 2)}
    if proc is not None:
        proc.close()
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ballast-write-probe")
    try:
        print(json.dumps(main(root), indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
