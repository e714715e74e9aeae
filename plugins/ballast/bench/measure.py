"""What every benchmark measures with: a target's verdict, and a process's resident memory.

The benchmark modules take these from here rather than from `ballast.bench`, which imports them only
inside `run_benchmark`, by name: no import cycle.
"""

from __future__ import annotations

from typing import Any


def target(value: float, limit: float, *, lower_is_better: bool = True) -> dict[str, Any]:
    """One entry of a benchmark's `targets` map: the value, the limit it is held to, and whether it is met."""
    met = value <= limit if lower_is_better else value >= limit
    return {"value": value, "target": f"{'<=' if lower_is_better else '>='} {limit}", "met": bool(met)}


def rss_mb() -> float:
    """This process's resident set now, in MiB (0.0 where /proc is not there)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class RssSampler:
    """Largest RSS growth over the RSS at start, sampled every 5 ms (the imports are not counted)."""

    def __init__(self):
        import threading

        self.base = self.peak = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mb())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_mb()) - self.base
