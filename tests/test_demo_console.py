"""What `ballast demo` prints while a run works: read from the records the run writes anyway."""

from __future__ import annotations

import io
import json
import os
import time

import pytest
from ballast.dev.demo_console import StageWatcher, output_to


def _write(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


@pytest.mark.unit
def test_one_line_per_finished_stage_progress_and_epochs(tmp_path):
    runs = tmp_path / "runs" / "ballast_lm"
    old = runs / "an_older_run"
    _write(old / "spec.json", {})
    os.utime(old / "spec.json", (1, 1))  # before this demo started: never shown
    _write(old / "stages" / "validate.json", {"rows": 1})
    run = runs / "this_run"
    _write(run / "spec.json", {})
    out = io.StringIO()
    watcher = StageWatcher(runs, out, started=time.time() - 1, every=0.0)
    watcher.poll()
    assert out.getvalue() == ""
    _write(run / "stages" / "validate.json", {"rows": 314, "quarantine": {"rows": 1}})
    _write(run / "progress" / "convert.json", {"what": "tokenize", "done": 157, "total": 314, "unit": "documents",
                                               "rate_per_second": 50.0, "eta_seconds": 3.0, "finished": False})
    watcher.poll()
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["done", "validate"] and lines[0].endswith("314 rows valid, 1 quarantined")
    assert lines[1].strip() == "tokenize: 157/314 documents (50%, 50 documents/s, ETA 3s)"
    events = [{"event": "step", "step": 10, "rank": 0, "epoch": 0, "loss": 1.5},
              {"event": "epoch", "step": 20, "rank": 0, "epoch": 0, "loss": 1.25, "perplexity": 3.5, "time": 5.0},
              {"event": "epoch", "step": 20, "rank": 1, "epoch": 0, "loss": 9.0}]
    _write(run / "train" / "metrics.jsonl", "\n".join(json.dumps(e) for e in events) + "\n{\"event\": \"st")
    _write(run / "stages" / "train.json", {"epochs": 1, "steps": 20, "stopped_early": False})
    watcher.poll()
    new = out.getvalue().splitlines()[2:]
    assert new[0].strip() == "train epoch 1: validation loss 1.2500, perplexity 3.5000"  # rank 0's, before done
    assert new[1].split()[:2] == ["done", "train"] and new[1].endswith("1 epochs, 20 steps")
    watcher.poll()  # nothing new: nothing printed again (the half-written line waits for its end)
    assert len(out.getvalue().splitlines()) == 4


@pytest.mark.unit
def test_the_run_output_goes_to_the_log_file_and_the_console_stays_free(tmp_path, capfd):
    log = tmp_path / "logs" / "demo.log"
    with output_to(log) as console:
        os.write(1, b"airflow says a lot\n")
        os.write(2, b"and warns\n")
        console.write("stage line\n")
    out, err = capfd.readouterr()
    assert out == "stage line\n" and err == ""
    assert log.read_text() == "airflow says a lot\nand warns\n"
