"""Stability monitors and metrics: loss-spike detection, gradient statistics, the hang watchdog, and the
per-rank Prometheus endpoint plus JSON-lines event log."""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from ballast.training.outputs import EVENTS


class SpikeDetector:
    """Flags a loss more than `zscore` standard deviations above the mean of the trailing window.

    `check` only looks; the caller decides what enters the window with `add`: a spike that training
    keeps (alert) enters it, so that a lasting change of level stops alerting once the window has seen
    it; a spike that is rolled back or skipped does not.
    """

    def __init__(self, *, window: int = 50, zscore: float = 3.0, min_points: int = 10):
        self.window: deque[float] = deque(maxlen=window)
        self.zscore = zscore
        self.min_points = min_points

    def check(self, loss: float) -> float | None:
        """The z-score if `loss` is a spike, else None."""
        if len(self.window) >= self.min_points:
            mean = sum(self.window) / len(self.window)
            var = sum((x - mean) ** 2 for x in self.window) / (len(self.window) - 1)
            std = math.sqrt(var)
            if std > 0:
                z = (loss - mean) / std
                if z > self.zscore:
                    return z
        return None

    def add(self, loss: float) -> None:
        self.window.append(loss)

    def state(self) -> list[float]:
        return list(self.window)

    def load(self, values: list[float]) -> None:
        self.window.clear()
        self.window.extend(values)


def grad_stats(parameters, *, lo: int = -40, hi: int = 8, chunk: int = 1 << 20) -> dict[str, Any]:
    """Gradient statistics in one streaming pass per gradient, without copying the gradients.

    The histogram counts |g| by power of two, read off the float32 exponent bits: bin i holds
    2^(lo+i) <= |g| < 2^(lo+i+1); the first bin also takes smaller non-zero values, the last larger
    finite ones. Also: the share of zeros, the share of float32 denormals (they slow CPU arithmetic and,
    under fp16, mean the loss scale is too low), the number of non-finite entries and the largest
    finite |g|. Costs ~0.15 s per 90M gradient entries on one core (concatenating the gradients and
    taking log10 of each, as before, took 4 s and a model-sized copy).
    """
    import torch

    # Per device the gradients are on (a GPU's are counted there, summed on the host once at the end): by
    # biased float32 exponent (0 zero/denormal, 255 inf/nan), and the chunk buffers.
    buffers: dict[Any, tuple[Any, Any, Any]] = {}
    total = zeros = 0
    max_abs = 0.0
    for p in parameters:
        if p.grad is None:
            continue
        # Under FSDP a gradient is a DTensor: this rank's shard is what it can see without a collective.
        g = (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().reshape(-1)
        if g.numel() == 0:
            continue
        if g.device not in buffers:
            buffers[g.device] = (torch.zeros(256, dtype=torch.int64, device=g.device),
                                 torch.empty(chunk, dtype=torch.int32, device=g.device),
                                 torch.empty(chunk, dtype=torch.float32, device=g.device))
        exponents, bits, as_f32 = buffers[g.device]
        total += g.numel()
        zeros += g.numel() - int(torch.count_nonzero(g))
        lo_v, hi_v = torch.aminmax(g)
        m = max(abs(float(lo_v)), abs(float(hi_v)))
        if not math.isfinite(m):  # the rare path: the largest finite value
            finite = g[torch.isfinite(g)]
            m = float(finite.abs().max()) if finite.numel() else 0.0
        max_abs = max(max_abs, m)
        for part in g.split(chunk):
            k = part.numel()
            if part.dtype != torch.float32:
                part = as_f32[:k].copy_(part)
            b = torch.bitwise_and(part.view(torch.int32), 0x7FFFFFFF, out=bits[:k])
            exponents += torch.bincount(b.bitwise_right_shift_(23), minlength=256)
    if not total:
        return {}
    counts = sum(e.cpu() for e, _, _ in buffers.values()).tolist()
    # Biased exponent e (1..254) holds 2^(e-127) <= |g| < 2^(e-126).
    first, last = lo + 127, hi + 127 - 1
    hist = [0] * (hi - lo)
    for e in range(1, 255):
        hist[min(max(e, first), last) - first] += counts[e]
    denormal = counts[0] - zeros
    hist[0] += denormal
    return {
        "entries": total, "histogram_log2_abs": hist, "range_log2": [lo, hi],
        "zero_fraction": zeros / total, "denormal_fraction": denormal / total,
        "nonfinite": counts[255], "max_abs": max_abs,
    }


class Watchdog:
    """Ends the process when no progress is reported for `timeout` seconds (a hang), after dumping
    every thread's stack to stderr and to `stacks-rank<R>.txt`."""

    def __init__(self, timeout: float, *, out_dir: Path, rank: int, on_hang: Callable[[], None]):
        self.timeout = timeout
        self.out_dir = out_dir
        self.rank = rank
        self.on_hang = on_hang
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ballast-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def beat(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                path = self.out_dir / f"stacks-rank{self.rank}.txt"
                with open(path, "w") as fh:
                    fh.write(f"no progress for {idle:.0f}s (hang timeout {self.timeout:.0f}s)\n")
                    faulthandler.dump_traceback(file=fh, all_threads=True)
                print(f"[train] rank {self.rank}: no progress for {idle:.0f}s; stacks in {path}", file=sys.stderr,
                      flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                self.on_hang()
                return


PORT_FILE = "metrics-port-rank{rank}"
"""In the output directory: the port a rank's metrics endpoint serves on (its own, where it was taken)."""

LABELS = ("pipeline", "run", "try", "node", "rank")
"""Every metric's labels, in this order (stable: dashboards and alert rules select on them)."""


class Metrics:
    """Per-rank Prometheus gauges (when a port is given) and rank 0's JSON-lines event log. Names:
    `ballast_train_*`; labels: `LABELS` (the pipeline, the DAG run, the train task's try, the node, the
    rank), from the run config's `identity`."""

    def __init__(self, *, out_dir: Path, rank: int, port: int | None, identity: Any = None):
        from ballast.training.failure import host_name

        self.out_dir = out_dir
        self.rank = rank
        self.events_path = out_dir / EVENTS
        self.curves: Any = None  # rank 0's bounded history of the curves (`training.curves`), for the view
        if rank == 0:
            from ballast.training.curves import CurveRecorder

            self.curves = CurveRecorder(out_dir)
        self.port = None
        self._server: Any = None
        self._g: dict[str, Any] = {}
        self._children: dict[tuple, Any] = {}
        self.labels = {"pipeline": getattr(identity, "pipeline", "") or "", "run": getattr(identity, "run", "") or "",
                       "try": str(getattr(identity, "try_number", 1)), "node": host_name(), "rank": str(rank)}
        if port is not None:
            from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

            self.registry = CollectorRegistry()
            labels = list(LABELS)
            for name, doc in (("step", "optimizer steps taken"), ("loss", "training loss (global mean)"),
                              ("grad_norm", "gradient norm before clipping"), ("loss_scale", "dynamic loss scale"),
                              ("samples_per_second", "training samples per second, all ranks"),
                              ("learning_rate", "current learning rate"),
                              ("memory_bytes", "resident memory of this process (GPU: allocated)"),
                              ("checkpoint_save_seconds", "time training was blocked by the last save"),
                              ("checkpoint_write_seconds", "time the last checkpoint took to write and commit"),
                              ("checkpoint_write_cpu_seconds", "CPU time the writing thread used for the last checkpoint"),
                              ("checkpoint_load_seconds", "time the last resume took"),
                              ("last_step_timestamp_seconds", "unix time of the last finished step"),
                              ("last_checkpoint_timestamp_seconds", "unix time of the last committed checkpoint"),
                              ("checkpoint_interval_seconds", "the longest time between checkpoints (every_seconds)"),
                              ("gpu_utilization_percent", "GPU utilisation (NVML)"),
                              ("gpu_temperature_celsius", "GPU temperature (NVML)"),
                              ("gpu_memory_used_bytes", "GPU memory in use on this rank's device (NVML)")):
                self._g[name] = Gauge(f"ballast_train_{name}", doc, labels, registry=self.registry)
            self._g["step_seconds"] = Gauge("ballast_train_step_seconds", "time per step by phase",
                                            [*labels, "phase"], registry=self.registry)
            self._g["failures_before"] = Gauge("ballast_train_failures_before",
                                               "failed tries of this task before this one, by failure class",
                                               [*labels, "failure_class"], registry=self.registry)
            self._g["anomalies"] = Counter("ballast_train_anomalies", "anomalies seen", [*labels, "kind"],
                                           registry=self.registry)
            for cls, n in (getattr(identity, "failures_before", None) or {}).items():
                self._child("failures_before", failure_class=cls).set(n)
            self.port = self._serve(start_http_server, port + rank)

    def _serve(self, start: Callable[..., Any], port: int) -> int | None:
        """Serve the registry on `port`, or on a free port where that one is taken (another pipeline's rank
        on this machine): a warning, never a crash. The port served is written to PORT_FILE, from which
        the orchestrator lists this rank for Prometheus."""
        addr = os.environ.get("BALLAST_METRICS_ADDR", "127.0.0.1")
        try:
            self._server, _ = start(port, addr=addr, registry=self.registry)
        except OSError as exc:
            try:
                self._server, _ = start(0, addr=addr, registry=self.registry)
            except OSError as again:
                print(f"[train] rank {self.rank}: no metrics endpoint: cannot serve on {addr} ({again})",
                      file=sys.stderr, flush=True)
                return None
            print(f"[train] rank {self.rank}: metrics port {port} is in use ({exc.strerror or exc}); serving on"
                  f" {self._server.server_port} instead", file=sys.stderr, flush=True)
        bound = self._server.server_port
        tmp = self.out_dir / f".{PORT_FILE.format(rank=self.rank)}.tmp"
        tmp.write_text(f"{bound}\n")
        os.replace(tmp, self.out_dir / PORT_FILE.format(rank=self.rank))
        return bound

    def close(self) -> None:
        """Write the curves' history; stop serving (the process's end does too)."""
        if self.curves is not None:
            self.curves.flush()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _child(self, name: str, **labels: str):
        """The labelled gauge, looked up once (labels() takes a lock and builds a key on every call)."""
        key = (name, *labels.values())
        child = self._children.get(key)
        if child is None and name in self._g:
            child = self._children[key] = self._g[name].labels(**self.labels, **labels)
        return child

    def set(self, **values: float) -> None:
        if not self._g:
            return
        for name, value in values.items():
            child = self._child(name)
            if child is not None and value is not None:
                child.set(value)

    def phases(self, **seconds: float) -> None:
        if not self._g:
            return
        for phase, value in seconds.items():
            self._child("step_seconds", phase=phase).set(value)

    def anomaly(self, kind: str) -> None:
        c = self._g.get("anomalies")
        if c is not None:
            c.labels(**self.labels, kind=kind).inc()

    def event(self, name: str, step: int, **fields: Any) -> None:
        if self.rank != 0 and name != "anomaly":
            return
        from ballast.training.outputs import Event, write_event

        at = time.time()
        write_event(self.events_path, Event.model_validate({"event": name, "time": at, "step": step,
                                                            "rank": self.rank, **fields}))
        if self.curves is not None:
            self.curves.event(name, step, at, fields)


def memory_bytes(device) -> int:
    try:
        import torch

        if device.type == "cuda":
            return int(torch.cuda.memory_allocated(device))
    except Exception:
        pass
    try:
        with open(f"/proc/{os.getpid()}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class Nvml:
    """GPU utilisation and temperature through NVML; absent (None) on machines without it."""

    def __init__(self, device: Any | None):
        """`device`: this process's torch CUDA device, or None."""
        self.handle = None
        if device is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv = pynvml
        except Exception:
            return
        try:
            # By UUID: CUDA's index counts the devices CUDA_VISIBLE_DEVICES leaves (in its order), NVML's
            # every device on the machine, so with CUDA_VISIBLE_DEVICES=2,3 index 0 is another GPU.
            import torch

            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        except Exception:
            try:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
            except Exception:
                self.handle = None

    def read(self) -> dict[str, float]:
        if self.handle is None:
            return {}
        try:
            util = self._nv.nvmlDeviceGetUtilizationRates(self.handle)
            temp = self._nv.nvmlDeviceGetTemperature(self.handle, self._nv.NVML_TEMPERATURE_GPU)
            mem = self._nv.nvmlDeviceGetMemoryInfo(self.handle)
            return {"gpu_utilization_percent": float(util.gpu), "gpu_temperature_celsius": float(temp),
                    "gpu_memory_used_bytes": float(mem.used)}
        except Exception:
            return {}
