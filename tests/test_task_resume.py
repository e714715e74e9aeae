"""Every task keeps the runtime's guarantees: a segmentation U-Net (batch-norm buffers, per-pixel targets)
and a regression model on several feature fields (a dict of inputs, float targets) train under torchrun
with their task's validation metrics, and a rank killed mid-epoch resumes to identical weights."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import make_ctx, run_chain, torchrun

from ballast.training import checkpoint as ckpt

pytestmark = pytest.mark.integration


def _segmentation(d: dict, raw: Path) -> None:
    d["dataset"] = {"location": str(raw), "fields": [{"name": "image", "type": "float32", "shape": [16, 16]},
                                                     {"name": "mask", "type": "int64", "shape": [16, 16]}],
                    "label": "mask", "num_classes": 4, "split": {"validation": 0.15, "test": 0.15, "seed": 1}}
    d["training"].update(task="segmentation", model={"name": "unet", "options": {"depth": 1, "base_width": 4}})


def _regression(d: dict, raw: Path) -> None:
    d["dataset"] = {"location": str(raw), "fields": [{"name": "image", "type": "float32", "shape": [16, 16]},
                                                     {"name": "area", "type": "float32"}],
                    "label": "area", "split": {"validation": 0.15, "test": 0.15, "seed": 1}}
    d["training"].update(task="regression", model={"name": "mlp", "options": {"hidden_size": 32}})


TASKS = {"segmentation": (_segmentation, ("mean_iou", "dice", "loss"), "max"),
         "regression": (_regression, ("rmse", "mae", "loss"), "min")}


@pytest.fixture(scope="module", params=sorted(TASKS))
def task_cache(request, tmp_path_factory):
    from ballast.data.demo import write_regression, write_segmentation
    from ballast.stages import convert, validate, warm_cache
    from helpers import warm_cache_rest

    task = request.param
    tmp = tmp_path_factory.mktemp(task)
    raw = tmp / "raw"
    if task == "segmentation":
        write_segmentation(raw, rows=192, size=16, seed=2)
    else:
        write_regression(raw, rows=192, size=16, seed=2)
    edit, _, _ = TASKS[task]

    def spec(d: dict) -> None:
        edit(d, raw)
        d["validation"]["rules"] = []
        d["conversion"]["shard_rows"] = 64
        d["training"].update(epochs=3, micro_batch_size=8, global_batch_size=16, learning_rate=0.003,
                             checkpoint={"every_steps": 4, "keep_last": 3})
        d["evaluation"] = {"patience": 10}

    ctx = make_ctx(tmp, raw, spec)
    return task, ctx, run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)["warm_cache"]


def _config(tmp: Path, ctx, cache, changes: dict | None = None) -> Path:
    from ballast.launch.config import run_config

    cfg = run_config(ctx.spec, data_dir=cache.cache_dir, data_format=cache.format, checkpoint_dir=str(tmp / "ckpt"),
                     output_dir=str(tmp / "out"))
    data = cfg.model_dump(mode="json")
    data["distributed"]["timeout_seconds"] = 120
    data["rehearsal"].update(changes or {})
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "run.json").write_text(json.dumps(data))
    return tmp / "run.json"


def test_a_killed_rank_resumes_every_task_to_identical_weights(tmp_path, task_cache):
    import torch

    task, ctx, cache = task_cache
    _, metrics, mode = TASKS[task]
    assert ctx.spec.evaluation.mode == mode
    ref = subprocess.run(torchrun(_config(tmp_path / "ref", ctx, cache), "--standalone", "--nproc-per-node=2"),
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    summary = json.loads((tmp_path / "ref" / "out" / "summary.json").read_text())
    assert summary["epochs"] == 3 and all(set(metrics) <= set(h) for h in summary["history"]), summary["history"]
    assert summary["best"]["value"] == (max if mode == "max" else min)(h[metrics[0]] for h in summary["history"])
    step = summary["steps"] // 2 + 1  # mid-epoch, after a committed save
    cfg = _config(tmp_path / "killed", ctx, cache, {"faults": [{"kind": "crash", "step": step, "rank": 1}]})
    run = subprocess.run(torchrun(cfg, "--standalone", "--nproc-per-node=2", "--max-restarts=2"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "resumed from" in run.stdout, run.stderr[-3000:]
    wa = ckpt.load_tensors(ckpt.committed(tmp_path / "ref" / "ckpt")[-1] / "model.pt")
    wb = ckpt.load_tensors(ckpt.committed(tmp_path / "killed" / "ckpt")[-1] / "model.pt")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f"{task}: weights differ"
