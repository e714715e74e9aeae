"""What a background checkpoint write costs a training loop that needs Python's interpreter lock.

A GPU's training loop spends its CPU time in Python, launching kernels: each op comes back to the
interpreter and needs its lock. This measures that directly and with little noise, in one process on
two cores: a loop of small torch ops (one torch thread) runs alone, then while a background save of a
snapshot (~`state_mib` MiB in DCP's format, through `checkpoint.dcp.write`, hashed) is written by a thread
of the same process (`thread`) and by the checkpoint writer process (`process`); the loop's speed during
each save over its speed alone, medians of `repeats` alternated saves. Part of `ballast bench
sharded-checkpoint`'s JSON (`training_loop_during_save`).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any


def loop_speed_during_saves(*, state_mib: int = 280, repeats: int = 6) -> dict[str, Any]:
    import torch

    from ballast.training.checkpoint import arena, dcp, fileio, writer_process
    from ballast.training.checkpoint.snapshot import Snapshot

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    modes = ["thread", "process"] if arena.available() else ["thread"]
    per = max(1, state_mib // 10) << 20
    states = {mode: Snapshot(shared=mode == "process").copy(
        {f"w{i}": torch.randn(per // 4 + 13 * i) for i in range(10)}) for mode in modes}
    proc = writer_process.WriterProcess(idle=False) if "process" in modes else None
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def ops() -> None:
        for _ in range(100):
            a.add_(b).mul_(0.5)

    def alone(seconds: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            ops()
            n += 100
        return n / (time.perf_counter() - t0)

    root = Path(tempfile.mkdtemp(prefix="ballast-bench-gil-"))
    speed: dict[str, list[float]] = {m: [] for m in modes}
    save_seconds: dict[str, list[float]] = {m: [] for m in modes}
    base: list[float] = []
    before = sys.getswitchinterval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: torch.distributed uninitialized (one process)
            for rep in range(repeats):
                for mode in (modes if rep % 2 == 0 else modes[::-1]):
                    base.append(alone(0.5))
                    out = root / f"{mode}-{rep}"
                    out.mkdir()
                    took: list[float] = []

                    def save(mode: str = mode, out: Path = out, took: list[float] = took) -> None:
                        t0 = time.perf_counter()
                        with fileio.offloading(proc if mode == "process" else None):
                            dcp.write({"model": states[mode]}, out, rank=0, group=None)
                        took.append(time.perf_counter() - t0)

                    sys.setswitchinterval(0.0005)  # as the saver sets it for a background write
                    writer = threading.Thread(target=save, name="bench-ckpt", daemon=True)
                    n, t0 = 0, time.perf_counter()
                    writer.start()
                    while writer.is_alive():
                        ops()
                        n += 100
                    speed[mode].append(n / (time.perf_counter() - t0))
                    sys.setswitchinterval(before)
                    save_seconds[mode].append(took[0])
                    shutil.rmtree(out)
    finally:
        sys.setswitchinterval(before)
        torch.set_num_threads(threads)
        shutil.rmtree(root, ignore_errors=True)
        if proc is not None:
            proc.close()
    alone_speed = statistics.median(base)
    return {"state_bytes": 10 * per, "repeats": repeats, "loop_ops_per_second_alone": round(alone_speed),
            **{mode: {"speed_ratio": round(statistics.median(speed[mode]) / alone_speed, 4),
                      "save_seconds_median": round(statistics.median(save_seconds[mode]), 4)} for mode in modes}}
