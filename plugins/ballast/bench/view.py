"""`ballast bench view`: the stability view's first paint for a run of 10^6 logged steps.

A run's `train/` is generated as the trainer leaves it, with the trainer's own writers: the event log
(`outputs.event_line`, a step event per logged step, an anomaly and a resume near the start) and the
curves' history (`curves.CurveRecorder`, fed the same events), plus the attempt history of a run that
restarted once. Then the view's data route, `GET /api/runs/<dag>/<run>`, through the app's ASGI stack
(FastAPI's test client; the API server's auth dependencies replaced, as in tests/test_ui_app.py), cold:
a new app each time (no cached summary), timed until the whole JSON the page draws from is received and
decoded. Target: first paint under a second. Reported beside it: the bytes the view read from storage
(at most the log's last 16 MiB plus the small records) against the log's size, and the payload's size.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ballast.bench.measure import target

DAG, RUN = "ballast_bench_view", "manual__2026-12-05T00_00_00"
LOGGED_STEPS = 10**6
EARLY_ANOMALY, EARLY_RESUME = 1_200, 2_000
COLD_RUNS = 3


class CountingStorage:
    """The run's storage, counting the bytes read through `open_read` per key."""

    def __init__(self, inner: Any):
        self.inner, self.read_bytes = inner, {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_read(self, key: str, *args: Any, **kwargs: Any) -> Any:
        fh, outer = self.inner.open_read(key, *args, **kwargs), self

        class _Counted:
            def __enter__(self):
                fh.__enter__()
                return self

            def __exit__(self, *exc):
                return fh.__exit__(*exc)

            def read(self, n: int = -1) -> bytes:
                data = fh.read(n)
                outer.read_bytes[key] = outer.read_bytes.get(key, 0) + len(data)
                return data

        return _Counted()


class _Catalog:
    directory = Path("/nowhere")

    def __init__(self, storage: Any):
        self._storage = storage

    def storage(self, dag_id: str) -> Any:
        return self._storage if dag_id == DAG else None

    def pipelines(self) -> dict:
        return {}


def write_run(root: Path, steps: int = LOGGED_STEPS) -> tuple[Any, Path]:
    """A run of `steps` logged steps (every 10th step, as the trainer logs them) in a FileStorage at `root`."""
    from ballast.records import Attempt, AttemptHistory
    from ballast.storage import FileStorage
    from ballast.training.curves import CurveRecorder
    from ballast.training.outputs import EVENTS, Event, event_line
    from ballast.ui.summary import run_prefix

    storage = FileStorage(str(root))
    prefix = run_prefix(storage, DAG, RUN)
    train = root / prefix / "train"
    train.mkdir(parents=True)
    rec = CurveRecorder(train, flush_seconds=float("inf"))
    t0 = 1.7e9
    with open(train / EVENTS, "w") as fh:
        batch: list[str] = []
        for i in range(1, steps + 1):
            step, at = 10 * i, t0 + 0.5 * i
            fields = {"epoch": i // 10_000, "loss": 2.0 * math.exp(-i / 3e5) + 0.1 * math.sin(i / 77),
                      "grad_norm": 1.0 + (i % 13) / 10, "lr": 3e-4 * min(1.0, i / 1000), "loss_scale": 65536.0,
                      "data_s": 0.0012, "compute_s": 0.0113, "comm_opt_s": 0.0021}
            events = [("step", fields)]
            if step == EARLY_ANOMALY:
                events.append(("anomaly", {"kind": "loss_spike", "loss": 41.5, "zscore": 9.1, "epoch": 0, "pos": 3}))
            if step == EARLY_RESUME:
                events.append(("resume", {"path": "checkpoints/step-00001500", "seconds": 0.8}))
            for name, f in events:
                event = Event.model_validate({"event": name, "time": at, "step": step, "rank": 0, **f})
                batch.append(event_line(event))
                rec.event(name, step, at, f)
            if len(batch) >= 20_000:
                fh.write("".join(batch))
                batch = []
        fh.write("".join(batch))
    rec.flush()
    end = t0 + 0.5 * steps
    tries = [Attempt(try_number=1, outcome="failed", failure_class="preempted", host="gpu-1", started=t0 - 10,
                     ended=t0 + 0.5 * 150, first_step_at=t0, step_reached=1_500, settings={}, adaptation=[]),
             Attempt(try_number=2, outcome="running", host="gpu-2", started=t0 + 0.5 * 160, ended=None,
                     first_step_at=t0 + 0.5 * 200, step_reached=10 * steps, resumed_step=1_500, settings={},
                     adaptation=[])]
    storage.write_bytes(f"{prefix}/attempts/train.json",
                        AttemptHistory(task_id="train", attempts=tries).model_dump_json().encode())
    return storage, train / EVENTS, end


def _cold_get(storage: Any) -> tuple[float, dict, int, dict]:
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.testclient import TestClient

    from ballast.ui import app as ui

    counting = CountingStorage(storage)
    app = ui.create_app(_Catalog(counting))
    app.dependency_overrides[get_user] = lambda: None
    app.dependency_overrides[ui.READ_RUNS.dependency] = lambda: None
    with TestClient(app) as client:
        started = time.perf_counter()
        resp = client.get(f"/api/runs/{DAG}/{RUN}")
        data = json.loads(resp.content)
        seconds = time.perf_counter() - started
    if resp.status_code != 200:
        raise RuntimeError(f"bench view: {resp.status_code} {resp.text[:200]}")
    return seconds, data, len(resp.content), counting.read_bytes


def bench_view(steps: int = LOGGED_STEPS) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ballast-bench-view-") as tmp:
        started = time.perf_counter()
        storage, log_path, _ = write_run(Path(tmp), steps)
        generated = time.perf_counter() - started
        log_bytes = log_path.stat().st_size
        from ballast.training.curves import CURVES

        history_bytes = (log_path.parent / CURVES).stat().st_size
        runs = [_cold_get(storage) for _ in range(COLD_RUNS)]
    seconds = [r[0] for r in runs]
    _, data, payload, read = runs[0]
    c = data["curves"]
    marked = {"anomaly_at_early_step": any(m["step"] == EARLY_ANOMALY for m in c["spikes"]),
              "resume_at_early_step": EARLY_RESUME in c["resumes"],
              "tries": len(data["tries"]), "restarts_in_tries": sum(1 for t in data["tries"] if t["resumed_step"])}
    whole_run = bool(c["step"]) and c["step"][0] <= 10 * (steps // 1000) and c["step"][-1] == 10 * steps
    first_paint = max(seconds)
    return {
        "benchmark": "view",
        "logged_steps": steps,
        "event_log_bytes": log_bytes,
        "history_bytes": history_bytes,
        "generate_seconds": round(generated, 2),
        "first_paint_seconds": [round(s, 4) for s in seconds],
        "first_paint_median_seconds": round(statistics.median(seconds), 4),
        "bytes_read": sum(read.values()),
        "bytes_read_by_record": {k.rsplit("/", 2)[-2] + "/" + k.rsplit("/", 1)[-1]: v for k, v in sorted(read.items())},
        "payload_bytes": payload,
        "points_drawn": c["shown"],
        "points_for_steps": c["points"],
        "history": c["history"],
        "whole_run_drawn": whole_run,
        "marks": marked,
        "targets": {"first_paint_s": target(round(first_paint, 4), 1.0),
                    "bytes_read_mib": target(round(sum(read.values()) / 2**20, 2), 17.0),
                    "whole_run_with_marks": {"value": whole_run and marked["anomaly_at_early_step"]
                                             and marked["resume_at_early_step"], "target": "true",
                                             "met": whole_run and marked["anomaly_at_early_step"]
                                             and marked["resume_at_early_step"]}},
        "note": f"cold: a new app (no cached summary) each of {COLD_RUNS} times; first paint is the slowest, the time"
                " until GET /api/runs/<dag>/<run> has returned and its JSON is decoded (the page draws from it"
                " alone); uPlot's drawing in the browser is not counted",
    }
