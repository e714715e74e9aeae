"""training.scores and training.tasks.ops: the scores and the better/threshold rule that the trainer and
evaluate share (each task's metrics against hand computations: tests/test_tasks.py); the
per-rank Prometheus endpoint (training.monitor.Metrics) and how the ranks are found."""

from __future__ import annotations

import ast
import inspect
import json
import socket
import time
import urllib.request

import pytest
import ballast.training.scores
from ballast.training.scores import improved, mode_of, reaches
from ballast.training.tasks.ops import TaskOps, per_class_accuracy

pytestmark = pytest.mark.unit


def test_scores_from_parts_summed_over_shards_equal_the_whole():
    import torch
    import torch.nn.functional as F

    ops = TaskOps("classification", num_classes=7)
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(101, 7, generator=g), torch.randint(0, 7, (101,), generator=g)
    whole = ops.score(logits, labels)
    assert whole["loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-6)
    assert whole["accuracy"] == pytest.approx(float((logits.argmax(1) == labels).float().mean()))
    assert whole["samples"] == 101
    shards = [ops.parts(logits[r::3], labels[r::3]) for r in range(3)]  # three ranks
    summed = [sum(p) for p in zip(*shards)]
    assert ops.scores(summed) == pytest.approx(whole)


def test_an_empty_shard_scores_nothing_without_dividing_by_zero():
    import torch

    ops = TaskOps("classification", num_classes=3)
    empty = ops.parts(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64))
    assert empty == [0.0, 0.0, 0.0] == ops.empty_parts()
    assert ops.scores(empty) == {"accuracy": 0.0, "loss": 0.0, "samples": 0.0}


def test_per_class_accuracy():
    import torch

    logits = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    labels = torch.tensor([0, 0, 1, 1])
    assert per_class_accuracy(logits, labels) == {0: 1.0, 1: 0.5}


@pytest.mark.parametrize("value,best,mode,delta,expected", [
    (0.5, None, "max", 0.0, True), (0.91, 0.9, "max", 0.0, True), (0.9, 0.9, "max", 0.0, False),
    (0.905, 0.9, "max", 0.01, False), (0.3, 0.4, "min", 0.0, True), (0.395, 0.4, "min", 0.01, False),
    (0.4, 0.4, "min", 0.0, False),
])
def test_improved_is_strict_beyond_min_delta(value, best, mode, delta, expected):
    assert improved(value, best, mode=mode, min_delta=delta) is expected


@pytest.mark.parametrize("value,threshold,mode,expected", [
    (0.9, 0.9, "max", True), (0.89, 0.9, "max", False), (0.2, 0.2, "min", True), (0.21, 0.2, "min", False),
])
def test_reaches_includes_the_threshold(value, threshold, mode, expected):
    assert reaches(value, threshold, mode=mode) is expected


def test_every_metric_has_its_direction():
    assert [mode_of(m) for m in ("accuracy", "mean_iou", "dice")] == ["max"] * 3
    assert [mode_of(m) for m in ("loss", "perplexity", "bits_per_byte", "rmse", "mae")] == ["min"] * 5


def test_the_metrics_module_imports_no_torch_at_module_level():
    tree = ast.parse(inspect.getsource(ballast.training.scores))
    top = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
    top += [node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert not [m for m in top if m.split(".")[0] == "torch"]


def test_a_metrics_port_in_use_is_a_warning_and_another_port_the_rank_reports(tmp_path, capsys):
    from ballast.training.monitor import Metrics

    with socket.socket() as taken:  # another pipeline's rank, on the port this one was given
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        metrics = Metrics(out_dir=tmp_path, rank=0, port=port)
        try:
            assert metrics.port is not None and metrics.port != port
            assert f"metrics port {port} is in use" in capsys.readouterr().err
            assert (tmp_path / "metrics-port-rank0").read_text().strip() == str(metrics.port)
            metrics.set(step=3)
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as resp:
                assert "ballast_train_step" in resp.read().decode()
        finally:
            metrics.close()


def test_discovery_lists_the_ports_the_ranks_bound(tmp_path, monkeypatch):
    from ballast.launch import prometheus_sd

    monkeypatch.setenv("BALLAST_PROMETHEUS_SD_DIR", str(tmp_path / "targets"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics-port-rank1").write_text("9999\n")  # an earlier try's: gone before this one starts
    path = prometheus_sd.publish(pipeline="p", dag_id="ballast_p", run_id="manual__1", try_number=1, port=9100,
                                 ranks=2, out_dir=out)

    def targets() -> list[str]:
        return json.loads(path.read_text())[0]["targets"]

    try:
        assert targets() == ["127.0.0.1:9100", "127.0.0.1:9101"]
        assert not (out / "metrics-port-rank1").exists()
        (out / "metrics-port-rank1").write_text("40123\n")  # rank 1 found 9101 taken
        deadline = time.monotonic() + 10
        while targets() != ["127.0.0.1:9100", "127.0.0.1:40123"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert targets() == ["127.0.0.1:9100", "127.0.0.1:40123"]
    finally:
        prometheus_sd.withdraw(path)
    assert not path.exists()


@pytest.mark.unit
def test_nvml_reads_the_gpu_this_process_uses_by_uuid_not_by_cuda_index(monkeypatch):
    """With CUDA_VISIBLE_DEVICES=2,3 CUDA's device 0 is the machine's GPU 2: NVML (which numbers every GPU)
    is asked by the device's UUID; by index only where the UUID is not known to it."""
    import sys
    import types

    import torch
    from ballast.training.monitor import Nvml

    asked = []
    nv = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda u: asked.append(("uuid", u)) or f"handle:{u}",
        nvmlDeviceGetHandleByIndex=lambda i: asked.append(("index", i)) or f"handle:{i}")
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(uuid="8f0a1b2c-0000-1111-2222-333344445555"))
    assert Nvml(torch.device("cuda", 0)).handle == "handle:GPU-8f0a1b2c-0000-1111-2222-333344445555"
    assert asked == [("uuid", "GPU-8f0a1b2c-0000-1111-2222-333344445555")]

    def unknown(u):
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    nv.nvmlDeviceGetHandleByUUID = unknown
    assert Nvml(torch.device("cuda", 1)).handle == "handle:1"
    assert Nvml(None).handle is None
