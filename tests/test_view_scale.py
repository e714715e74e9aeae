"""The stability view over a long run: the trainer's bounded history of the curves (`training.curves`:
exact per-bucket count, min, max and mean after any number of merges, O(buckets) for any run length),
the view reading at most the last 16 MiB of the event log beside it, the whole run's curves joined from
both with the early anomalies and resumes still marked, and the event lines decoded in one pass as the
trainer's contract reads them one by one."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

DAG, RUN = "ballast_demo", "manual__2026-12-05T00_00_00"


def _feed(history, steps, values):
    from ballast.training.curves import SERIES

    for i, step in enumerate(steps):
        history.add_step(int(step), 1000.0 + i, {name: values[name][i] for name in SERIES})


@pytest.mark.unit
def test_bucket_min_max_mean_are_exact_after_merges():
    from ballast.training.curves import BUCKETS, SERIES, CurveHistory

    rng = np.random.default_rng(0)
    steps = np.cumsum(rng.integers(1, 40, size=30_000))  # uneven logging, well past BUCKETS buckets
    values = {name: rng.normal(size=steps.size) * 10.0 ** rng.integers(-3, 3, size=steps.size) for name in SERIES}
    values["loss"][::997] = np.nan  # non-finite values are in no bucket
    values["lr"][5000:5100] = np.inf
    h = CurveHistory()
    _feed(h, steps, {k: v.tolist() for k, v in values.items()})
    assert h.span & (h.span - 1) == 0 and h.span > 1 and len(h.time) <= BUCKETS  # merged, a power of two
    assert steps[-1] // h.span < BUCKETS <= steps[-1] // (h.span // 2)  # the smallest span that fits
    rows = h.buckets()
    assert rows and all(r["first"] // h.span == r["last"] // h.span for r in rows)
    covered = 0
    for row in rows:
        start = row["first"] // h.span * h.span
        inside = (steps >= start) & (steps <= start + h.span - 1)
        assert steps[inside].size and row["first"] == steps[inside][0]
        assert row["last"] == min(start + h.span - 1, steps[-1])
        covered += int(inside.sum())
        for name in SERIES:
            v = values[name][inside]
            v = v[np.isfinite(v)]
            if not v.size:
                assert name not in row
                continue
            got = row[name]
            assert got["n"] == v.size and got["min"] == v.min() and got["max"] == v.max()
            assert math.isclose(got["mean"], float(v.mean()), rel_tol=1e-9, abs_tol=1e-12)
    assert covered == steps.size == h.steps


@pytest.mark.unit
def test_the_history_stays_bounded_for_a_million_logged_steps(tmp_path):
    from ballast.training.curves import BUCKETS, CURVES, CurveHistory, read_history, write_history

    h = CurveHistory()
    sizes = {}
    for step in range(1, 10**6 + 1):
        h.add_step(step * 10, float(step), {"loss": 1.0 / step, "grad_norm": 1.0, "lr": 1e-3, "loss_scale": 65536.0})
        if step in (10**4, 10**6):
            write_history(tmp_path, h)
            sizes[step] = (tmp_path / CURVES).stat().st_size
    assert h.steps == 10**6 and len(h.time) <= BUCKETS
    assert sizes[10**6] <= 1.1 * sizes[10**4] and sizes[10**6] < 256 << 10, sizes  # O(buckets), not O(steps)
    back = read_history(tmp_path)
    assert back is not None and back.buckets()[0]["loss"]["max"] == 1.0 and back.steps == 10**6


@pytest.mark.unit
def test_repeats_after_a_resume_are_skipped_and_marks_are_bounded():
    from ballast.training.curves import MAX_MARKS, CurveHistory

    h = CurveHistory()
    for step in range(10, 110, 10):
        h.add_step(step, 0.0, {"loss": 1.0})
    h.add_resume(50)
    assert not h.add_step(60, 0.0, {"loss": 99.0})  # a resumed try logs step 60 again: the first stands
    assert h.add_step(110, 0.0, {"loss": 2.0})
    assert max(r["loss"]["max"] for r in h.buckets()) == 2.0 and h.resumes.items == [{"step": 50}]
    for step in range(3 * MAX_MARKS):
        h.add_anomaly(step, "loss_spike", loss=float("nan"), zscore=4.0)
    items = h.anomalies.items
    assert len(items) == MAX_MARKS and h.anomalies.dropped == 2 * MAX_MARKS
    assert items[0]["step"] == 0 and items[-1]["step"] == 3 * MAX_MARKS - 1  # the first and the newest kept
    assert items[0]["loss"] is None and items[0]["zscore"] == 4.0


@pytest.mark.unit
def test_rank_zeros_metrics_write_the_history_beside_the_event_log(tmp_path):
    from ballast.training.curves import CURVES, read_history
    from ballast.training.monitor import Metrics
    from ballast.training.outputs import EVENTS

    m0, m1 = Metrics(out_dir=tmp_path, rank=0, port=None), Metrics(out_dir=tmp_path / "r1", rank=1, port=None)
    for step in range(10, 60, 10):
        m0.event("step", step, loss=1.0 / step, grad_norm=2.0, lr=0.1, loss_scale=None)
        m1.event("step", step, loss=5.0)
    m0.event("anomaly", 20, kind="loss_spike", loss=9.0, zscore=5.0)
    m0.event("checkpoint", 50, reason="end")  # a rarer event writes it at once
    h = read_history(tmp_path)
    assert h is not None and h.steps == 5 and h.anomalies.items[0]["kind"] == "loss_spike"
    assert sum(r["loss"]["n"] for r in h.buckets()) == 5 and "loss_scale" not in h.buckets()[0]
    assert (tmp_path / EVENTS).is_file() and not (tmp_path / "r1" / CURVES).exists()
    m0.event("resume", 30, path="x", seconds=0.1)
    m0.close()
    again = Metrics(out_dir=tmp_path, rank=0, port=None)  # the next try goes on from it
    assert again.curves.history.steps == 5 and again.curves.history.resumes.items == [{"step": 30}]


@pytest.mark.unit
@pytest.mark.parametrize("line", [
    b'{"event": "step", "time": 1.5, "step": 10, "rank": 0, "loss": 0.5, "version": 1}',
    b'{"event": "step", "time": 2, "step": 10.5, "loss": NaN, "grad_norm": Infinity}',
    b'{"event": "step", "time": 1.0, "step": 3, "lr": 1e999}',
    b'{"event": "anomaly", "time": 1.0, "step": 3, "rank": 1.0, "kind": 7}',
    b'{"time": 1.0, "step": 3, "extra": [1, 2, {"a": null}]}',
    b'{"event": "step", "time": 1.0, "step": true}',
    b'{"event": "step", "time": NaN, "step": 3}',
    b'{"event": 5, "time": 1.0, "step": 3}',
    b'{"event": "step", "time": 1.0, "step": 99999999999999999999999}',
    b'{"event": "step", "time": 1.0, "st',
    b'[1, 2]',
    b'{"event": "step", "time": 1.0, "step": 4}, {"event": "step", "time": 1.0, "step": 5}',  # two on one line
    b'{"event": "step", "time": 1.0, "step": 6, "x": [1\n2]}',  # a line broken in two
])
def test_event_lines_decoded_at_once_read_as_the_contract_reads_each(line):
    from ballast.training.outputs import parse_event, parse_events

    good = b'{"event": "step", "time": 1.0, "step": 1, "loss": 0.25}'
    for lines in ([good, *line.split(b"\n"), good], [good, good, *line.split(b"\n")], line.split(b"\n")):
        got, bad = parse_events(lines)
        want = [e for e in (parse_event(x) for x in lines) if e is not None]
        assert bad == len(lines) - len(want)
        assert got == [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                        for k, v in e.model_dump().items()} for e in want]


# --- the view: the log's last 16 MiB and the history -------------------------------------------------------


def _long_run(tmp_path, steps: int, *, early_anomaly: int, resume: int):
    """A run's train/ directory as the trainer leaves it: the event log (written with the trainer's own
    event lines, the anomaly and resume at its start) and the history fed the same events."""
    from ballast.storage import FileStorage
    from ballast.training.curves import CurveRecorder
    from ballast.training.outputs import EVENTS, Event, event_line
    from ballast.ui.summary import run_prefix

    storage = FileStorage(str(tmp_path))
    train = tmp_path / run_prefix(storage, DAG, RUN) / "train"
    train.mkdir(parents=True)
    rec = CurveRecorder(train, flush_seconds=float("inf"))
    with open(train / EVENTS, "w") as fh:
        for i in range(1, steps + 1):
            step, at = 10 * i, 1000.0 + i
            fields = {"loss": 2.0 + math.sin(i / 500), "grad_norm": 1.0 + (i % 7) / 10, "lr": 1e-3,
                      "loss_scale": 1024.0, "data_s": 0.001, "compute_s": 0.01, "comm_opt_s": 0.001, "epoch": 0}
            extra = []
            if step == early_anomaly:
                extra.append(("anomaly", {"kind": "loss_spike", "loss": 40.0, "zscore": 9.0}))
            if step == resume:
                extra.append(("resume", {"path": "checkpoints/step-00000100", "seconds": 0.5}))
            for name, f in [("step", fields), *extra]:
                fh.write(event_line(Event.model_validate({"event": name, "time": at, "step": step, "rank": 0, **f})))
                rec.event(name, step, at, f)
    rec.flush()
    return storage


@pytest.mark.unit
def test_the_view_reads_the_logs_tail_and_the_history_for_the_whole_run(tmp_path, monkeypatch):
    from ballast.bench.view import CountingStorage
    from ballast.ui import reader, summary

    monkeypatch.setattr(reader, "MAX_EVENTS_BYTES", 256 << 10)  # a small bound: the same arithmetic, faster
    storage = _long_run(tmp_path, 20_000, early_anomaly=120, resume=200)
    counted = CountingStorage(storage)
    s = summary.run_summary(counted, DAG, RUN)
    log_key = next(k for k in counted.read_bytes if k.endswith("train/metrics.jsonl"))
    assert counted.read_bytes[log_key] <= 256 << 10 < storage.size(log_key)  # only the tail was read
    states = s["records"]["states"]
    assert states["train/metrics.jsonl"] == "partial" and states["train/curves.json"] == "ok"
    c = s["curves"]
    hist = c["history"]
    assert hist is not None and c["step"][0] < 200 and c["step"][-1] == 200_000  # the whole run, start to end
    assert c["step"] == sorted(c["step"]) and len(set(c["step"])) == len(c["step"])
    assert hist["tail_from"] > 100_000 and c["step"][hist["buckets"]] == hist["tail_from"]  # history, then the tail
    tail_steps = (200_000 - hist["tail_from"]) // 10 + 1
    assert c["points"] == 20_000 == hist["steps"] and c["shown"] == hist["buckets"] + min(2000, tail_steps)
    band = c["band"]["loss"]
    for i in range(hist["buckets"]):
        assert band["min"][i] <= c["loss"][i] <= band["max"][i]
    assert min(band["min"]) == pytest.approx(1.0, abs=1e-3) and max(band["max"]) == pytest.approx(3.0, abs=1e-3)
    tail = c["loss"][hist["buckets"]:]
    assert band["min"][hist["buckets"]:] == tail == band["max"][hist["buckets"]:]  # exact points: no band
    assert {"step": 120, "kind": "loss_spike", "loss": 40.0, "zscore": 9.0} in c["spikes"]  # the lost head's anomaly
    assert c["resumes"] == [200]
    json.dumps(s, allow_nan=False)  # what the page gets is plain JSON


@pytest.mark.unit
@pytest.mark.parametrize("mib", [20])
def test_the_reader_reads_at_most_16_mib_of_a_larger_log(tmp_path, mib):
    from ballast.bench.view import CountingStorage
    from ballast.storage import FileStorage
    from ballast.ui.reader import MAX_EVENTS_BYTES, Reader

    assert MAX_EVENTS_BYTES == 16 << 20
    storage = FileStorage(str(tmp_path))
    line = '{"event": "step", "time": %d.0, "step": %d, "rank": 0, "loss": 0.5, "version": 1}\n'
    n = (mib << 20) // len(line % (10**9, 10**9)) + 1000
    storage.write_bytes("r/train/metrics.jsonl", "".join(line % (i, i) for i in range(n)).encode())
    counted = CountingStorage(storage)
    events = Reader(counted, "r").jsonl("train/metrics.jsonl")
    assert sum(counted.read_bytes.values()) <= MAX_EVENTS_BYTES
    assert events[-1]["step"] == n - 1 and events[0]["step"] > 0 and len(events) < n
    assert [e["step"] for e in events] == list(range(events[0]["step"], n))  # every line of the tail, none cut


@pytest.mark.unit
def test_a_run_whose_log_is_read_whole_draws_its_exact_steps_alone(tmp_path):
    from ballast.ui import summary

    storage = _long_run(tmp_path, 300, early_anomaly=20, resume=40)
    c = summary.run_summary(storage, DAG, RUN)["curves"]
    assert c["history"] is None and c["step"] == list(range(10, 3010, 10)) and c["points"] == c["shown"] == 300
    assert [m["step"] for m in c["spikes"]] == [20] and c["resumes"] == [40]


@pytest.mark.unit
def test_a_damaged_history_is_named_and_the_log_still_draws(tmp_path):
    from ballast.training.curves import CURVES
    from ballast.ui import summary

    storage = _long_run(tmp_path, 50, early_anomaly=20, resume=40)
    prefix = summary.run_prefix(storage, DAG, RUN)
    storage.write_bytes(f"{prefix}/train/{CURVES}", b'{"span": "wide"')
    s = summary.run_summary(storage, DAG, RUN)
    assert s["records"]["states"]["train/curves.json"] == "corrupt"
    assert s["records"]["problems"]["train/curves.json"] == "not a curve history"
    assert s["curves"]["step"] == list(range(10, 510, 10)) and s["curves"]["history"] is None


@pytest.mark.unit
def test_the_history_is_copied_to_remote_storage_with_the_event_log(tmp_path):
    from types import SimpleNamespace

    from ballast.storage.outputs import upload_outputs
    from ballast.training.curves import CURVES, CurveHistory, write_history

    class Remote:  # what upload_outputs asks of an S3 storage
        def __init__(self):
            self.keys = []

        def local_path(self, key):
            return None

        def upload(self, path, key):
            self.keys.append(key)

    h = CurveHistory()
    h.add_step(10, 1.0, {"loss": 1.0})
    write_history(tmp_path, h)
    (tmp_path / "metrics.jsonl").write_text("")
    ctx = SimpleNamespace(storage=Remote(), run_key="runs/d/r")
    assert upload_outputs(ctx, tmp_path) == ["runs/d/r/train/metrics.jsonl", f"runs/d/r/train/{CURVES}"]


@pytest.mark.unit
def test_a_cluster_trys_node_0_goes_on_with_the_runs_history(tmp_path, caplog):
    from types import SimpleNamespace

    from ballast.node import pull_history
    from ballast.storage import FileStorage
    from ballast.training.curves import CURVES, CurveHistory, read_history, write_history

    storage = FileStorage(tmp_path / "store")
    ctx = SimpleNamespace(storage=storage, run_key="runs/d/r", try_number=2)
    fresh = tmp_path / "try-2-node0" / "train"
    fresh.mkdir(parents=True)
    assert pull_history(ctx, fresh) == {}  # a run's first try: nothing in storage yet, nothing pulled
    assert not (fresh / CURVES).exists()
    h = CurveHistory()
    for step in range(1, 41):
        h.add_step(step, float(step), {"loss": 1.0 / step})
    write_history(tmp_path, h)
    storage.upload(tmp_path / CURVES, f"runs/d/r/train/{CURVES}")
    pulled = pull_history(ctx, fresh)
    got = read_history(fresh)
    assert got is not None and got.buckets() == h.buckets() and set(pulled) == {CURVES}
    # A node whose ranks did not write it (global rank 0 ran on another node) does not push it back.
    from ballast.node import push_outputs

    push_outputs(ctx, fresh, node=1, unchanged=pulled)
    assert not storage.exists(f"runs/d/r/train/try-2/out/node1/{CURVES}")
    got.add_step(50, 50.0, {"loss": 0.02})
    write_history(fresh, got)  # rank 0 ran here and went on with it: its history goes
    push_outputs(ctx, fresh, node=1, unchanged=pulled)
    assert storage.exists(f"runs/d/r/train/try-2/out/node1/{CURVES}")

    class Broken:  # storage failing: a warning, and training goes on without the history
        def exists(self, key):
            raise OSError("connection reset")

        def describe(self, key):
            return f"s3://b/{key}"

    with caplog.at_level("WARNING", logger="ballast.node"):
        pull_history(SimpleNamespace(storage=Broken(), run_key="runs/d/r"), tmp_path / "other")
    assert "could not pull the curve history s3://b/runs/d/r/train/curves.json" in caplog.text


@pytest.mark.unit
def test_bench_view_reports_first_paint_bytes_read_and_the_marks(tmp_path):
    from ballast.bench.view import EARLY_ANOMALY, bench_view

    r = bench_view(steps=20_000)
    assert set(r["targets"]) == {"first_paint_s", "bytes_read_mib", "whole_run_with_marks"}
    assert r["targets"]["first_paint_s"]["target"] == "<= 1.0" and len(r["first_paint_seconds"]) == 3
    assert r["targets"]["whole_run_with_marks"]["met"] and r["marks"]["anomaly_at_early_step"]
    assert r["marks"]["restarts_in_tries"] == 1 and r["points_for_steps"] == 20_000 and EARLY_ANOMALY < 10 * 20_000
    assert r["bytes_read_by_record"]["train/metrics.jsonl"] == r["event_log_bytes"]  # under 16 MiB: read whole
    assert r["payload_bytes"] > 0 and r["bytes_read"] >= r["event_log_bytes"] + r["history_bytes"]


@pytest.mark.integration
def test_the_page_draws_a_long_runs_history_band_and_marks_in_a_browser(tmp_path):
    """The run page of a run whose log the view reads only the tail of, in headless Chromium against the
    app served by uvicorn: rendered, its note names the history's spans, the loss chart has its band
    and the anomaly and resume series, and the console has no error (a script fault, a CSP refusal)."""
    import threading

    import uvicorn
    from airflow.api_fastapi.core_api.security import get_user
    from ballast.bench.view import DAG as BDAG
    from ballast.bench.view import RUN as BRUN
    from ballast.bench.view import _Catalog, write_run
    from ballast.ui import app as ui
    from ballast.ui import reader
    from helpers import free_port
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    storage, _, _ = write_run(tmp_path, 40_000)
    reader_bound = reader.MAX_EVENTS_BYTES
    reader.MAX_EVENTS_BYTES = 1 << 20  # the tail is the last 1 MiB of this 9 MiB log: the rest from the history
    app = ui.create_app(_Catalog(storage))
    app.dependency_overrides[get_user] = lambda: None
    app.dependency_overrides[ui.READ_RUNS.dependency] = lambda: None
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    browser = None
    try:
        from helpers import headless_chromium

        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        browser = headless_chromium()
        browser.get(f"http://127.0.0.1:{port}/runs/{BDAG}/{BRUN}")
        WebDriverWait(browser, 60).until(
            lambda b: b.find_element(By.ID, "app").get_attribute("data-state") in ("rendered", "error"))
        assert browser.find_element(By.ID, "app").get_attribute("data-state") == "rendered"
        note = browser.find_element(By.ID, "curves-note").text
        assert "spans of" in note and "1 anomaly(ies) marked" in note and "1 resume(s) marked" in note, note
        loss = browser.find_element(By.CSS_SELECTOR, '[data-chart="loss"]')
        legend = loss.text
        assert all(word in legend for word in ("loss max", "loss min", "anomaly", "resume")), legend
        assert browser.find_elements(By.CSS_SELECTOR, '[data-chart="loss"] canvas')
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
                  and "favicon.ico" not in e["message"]]  # the bare app has none; Airflow's server does
        assert not errors, errors
    finally:
        reader.MAX_EVENTS_BYTES = reader_bound
        if browser is not None:
            browser.quit()
        server.should_exit = True
        thread.join(10)
