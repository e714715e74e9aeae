"""The CUDA paths: NCCL, fp16 loss scaling, the per-process memory cap, NVML gauges.

Skipped where torch sees no GPU (CI, and the pinned CPU wheel). On a machine with a GPU and a CUDA
build of torch: `pytest tests/test_gpu.py`. NCCL wants one rank per device: with one GPU the run has
one rank and no collective (the backend is still chosen); with two or more, two ranks all-reduce.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers import config, free_port, metric_value, record, run_single

from ballast.training.failure import EXIT_CODES

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_nccl_fp16_trains_resumes_and_reports_nvml(tmp_path, digits_cache):
    ranks = min(2, torch.cuda.device_count())

    def fp16(d):
        d["training"].update(precision="fp16", loss_scale={"initial": 8192, "growth_interval": 100},
                             processes_per_node=ranks, global_batch_size=32 * ranks)

    port = free_port()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "--module", "ballast.training", "--config"]
    first = subprocess.run([*argv, str(config(tmp_path, digits_cache, epochs=1, edit=fp16))], capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"world {ranks} (nccl" in first.stdout
    cfg = config(tmp_path, digits_cache, epochs=3, edit=fp16, changes={"execution.metrics_port": port})
    proc = subprocess.Popen([*argv, str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    text, deadline = "", time.monotonic() + 120
    while "ballast_train_gpu_utilization_percent{" not in text and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.5)
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            continue
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in out
    for gauge in ("gpu_utilization_percent", "gpu_temperature_celsius", "gpu_memory_used_bytes"):
        assert metric_value(text, f"ballast_train_{gauge}", rank="0") is not None, gauge
    scale = metric_value(text, "ballast_train_loss_scale", rank="0")
    assert 0 < scale <= 8192 * 2, scale  # dynamic, from the spec's 8192, growing at most once per 100 steps
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["best"]["value"] > 0.8


def test_memory_cap_turns_an_oversized_model_into_the_oom_class(tmp_path, digits_cache):
    # hidden 20000: 0.4 G parameters, 1.6 GB of weights and 3.2 GB of AdamW moments; the cap leaves
    # far less than that of the device.
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = 2e9 / total
    cfg = config(tmp_path, digits_cache, edit=lambda d: d["training"].update(hidden_size=20000),
                 changes={"resources.gpu_memory_fraction": fraction})
    proc = run_single(cfg)
    assert proc.returncode == EXIT_CODES["oom"], proc.stderr[-3000:]
    assert record(tmp_path)["class"] == "oom"
