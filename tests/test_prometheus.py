"""Prometheus on Ballast's training metrics: Debian's prometheus started on loopback, finding a real
training run's ranks through the file-based discovery the train stage writes, and the loss-spike alert
of docker/prometheus/ballast-rules.yml firing on an injected spike."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest
from helpers import ROOT, free_port

RULES = ROOT / "docker" / "prometheus" / "ballast-rules.yml"


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: `make prometheus` installs it")
    return path


@pytest.mark.integration
def test_the_alert_rules_are_valid_prometheus_rules():
    out = subprocess.run([_need("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS: 6 rules found" in out.stdout, out.stdout + out.stderr


@pytest.mark.integration
def test_the_alerts_fire_and_resolve_on_series_shaped_as_the_trainer_exports_them():
    # The loss-spike alert fires for a counter that first appears with a spike counted, resolves five
    # minutes later, fires again on the next spike; repeated out-of-memory fires on the second failure.
    out = subprocess.run([_need("promtool"), "test", "rules", RULES.with_suffix(".test.yml").name],
                         capture_output=True, text=True, cwd=RULES.parent)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


@pytest.fixture
def prometheus(tmp_path, monkeypatch):
    binary = _need("prometheus")
    targets = tmp_path / "targets"
    targets.mkdir()
    conf = tmp_path / "prometheus.yml"
    conf.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "ballast", "honor_labels": True,
                            "file_sd_configs": [{"files": [str(targets / "*.json")], "refresh_interval": "1s"}]}],
    }))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "prometheus.log", "wb"), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError((tmp_path / "prometheus.log").read_text()[-2000:])
            time.sleep(0.3)
    monkeypatch.setenv("BALLAST_PROMETHEUS_SD_DIR", str(targets))
    yield base, targets
    proc.terminate()
    proc.wait(timeout=20)


def _two_free_ports() -> int:
    """A port P with P + 1 free too (rank r serves on P + r)."""
    import socket

    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise AssertionError("no two consecutive free ports")


def _api(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=5) as resp:
        return json.loads(resp.read())["data"]


@pytest.mark.e2e
def test_prometheus_finds_the_ranks_and_the_loss_spike_alert_fires(airflow_db, digits_raw, tmp_path, prometheus):
    from helpers import run_spec_dag

    base, targets = prometheus
    port = _two_free_ports()

    def edit(d):
        d["dataset"]["location"] = str(digits_raw)
        d["training"].update(epochs=400, checkpoint={"every_steps": 50, "keep_last": 2}, monitors={"spike_window": 20},
                             rehearsal={"faults": [{"kind": "spike", "step": 35}], "max_seconds": 12})
        d["evaluation"].update(threshold=None, patience=1000)
        d["recovery"] = {"retry_delay_seconds": 0}
        d["schedule"] = {}
        d["execution"] = {"metrics_port": port}

    seen = {"instances": set(), "alerts": [], "series": []}
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                up = [t for t in _api(base, "/api/v1/targets")["activeTargets"] if t["health"] == "up"]
                if up:  # the ranks end one by one: every target seen up counts
                    seen["instances"] |= {t["labels"]["instance"] for t in up}
                    seen["series"] = _api(base, "/api/v1/query?query=ballast_train_step")["result"] or seen["series"]
                firing = [a for a in _api(base, "/api/v1/alerts")["alerts"] if a["state"] == "firing"]
                seen["alerts"] += [a for a in firing if a not in seen["alerts"]]
            except OSError:
                pass
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        dr, ctx = run_spec_dag(tmp_path, edit, conf={"rehearsal": True}, name="prom")
    finally:
        done.set()
        watcher.join(timeout=10)
    assert str(dr.state) == "success"
    assert seen["instances"] == {f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"}, seen["instances"]
    labels = seen["series"][0]["metric"]
    assert {k: labels[k] for k in ("pipeline", "run", "try")} == {"pipeline": "prom", "run": dr.run_id, "try": "1"}
    assert labels["node"] and labels["rank"] in ("0", "1")
    spikes = [a for a in seen["alerts"] if a["labels"]["alertname"] == "BallastLossSpike"]
    assert spikes and spikes[0]["labels"]["pipeline"] == "prom", seen["alerts"]
    assert not list(targets.glob("*.json"))  # the try's targets went with it
