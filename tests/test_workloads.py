"""A team's own model, installed as a package (tests/team_package.py: an entry point under
`ballast.models`), trains through the whole pipeline (dag.test) for every task: classification on the
digits, regression with two feature fields, segmentation of synthetic masks, a causal language model on
text from the Python standard library. Small sizes: what is checked is that each task's data, loss,
metrics, checkpoints, evaluation and publishing hold end to end, not how good the models get."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import team_package
from ballast.training.tasks import METRICS
from helpers import run_spec_dag
from workload_data import stdlib_texts


@pytest.fixture
def team_site(tmp_path, monkeypatch, request):
    """The team's package importable here and in every process the run starts: for classification the
    README's own example package, for the other tasks tests/team_package.py's."""
    root = team_package.install(tmp_path / "site", readme=request.node.callspec.params["task"] == "classification")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, team_package.DIST, raising=False)  # another test's version of it
    monkeypatch.setenv("PYTHONPATH", f"{root}:{':'.join(p for p in sys.path if p)}")
    return root


def _regression(dest: Path) -> dict:
    rng = np.random.default_rng(0)
    n = 1200
    image = rng.random((n, 8, 8), dtype=np.float32)
    extra = rng.random((n, 2), dtype=np.float32)
    target = (image.mean(axis=(1, 2)) + extra[:, 0]).astype(np.float32)
    dest.mkdir(parents=True)
    pq.write_table(pa.table({"image": pa.array(list(image.reshape(n, -1))), "extra": pa.array(list(extra)),
                             "target": pa.array(target)}), dest / "part-0.parquet")
    return {"fields": [{"name": "image", "type": "float32", "shape": [8, 8]},
                       {"name": "extra", "type": "float32", "shape": [2]},
                       {"name": "target", "type": "float32"}], "label": "target"}


def _segmentation(dest: Path) -> dict:
    rng = np.random.default_rng(1)
    n = 600
    image = rng.random((n, 12, 12), dtype=np.float32)
    mask = (image > 0.5).astype(np.int64)
    dest.mkdir(parents=True)
    pq.write_table(pa.table({"image": pa.array(list(image.reshape(n, -1))), "mask": pa.array(list(mask.reshape(n, -1)))}),
                   dest / "part-0.parquet")
    return {"fields": [{"name": "image", "type": "float32", "shape": [12, 12]},
                       {"name": "mask", "type": "int64", "shape": [12, 12]}], "label": "mask", "num_classes": 2}


def _causal_lm(dest: Path) -> dict:
    dest.mkdir(parents=True)
    pq.write_table(pa.table({"text": pa.array(stdlib_texts(200_000), pa.string())}), dest / "part-0.parquet")
    return {"fields": [{"name": "text", "type": "string"}], "text": "text", "tokenizer": {"kind": "bytes"}}


DATA = {"regression": _regression, "segmentation": _segmentation, "causal_lm": _causal_lm}


@pytest.mark.e2e
@pytest.mark.parametrize("task", ["classification", "regression", "segmentation", "causal_lm"])
def test_a_team_model_from_its_own_package_trains_every_task_end_to_end(airflow_db, digits_raw, tmp_path,
                                                                        team_site, task):
    raw = tmp_path / "raw"

    def edit(d):
        t = d["training"]
        t.update(task=task, model={"name": team_package.ENTRY_POINT, "options": {"width": 16}}, epochs=2,
                 micro_batch_size=16, global_batch_size=32, checkpoint={"every_steps": 20, "keep_last": 2})
        t.pop("hidden_size", None)
        d["evaluation"] = {"patience": 5}
        d["storage"]["uri"] = str(tmp_path / "storage")
        d["cache"]["directory"] = str(tmp_path / "cache")
        if task == "classification":
            d["dataset"]["location"] = str(digits_raw)
            return
        d["validation"]["rules"] = []
        d["conversion"]["shard_rows"] = 128
        ds = {"location": str(raw), "split": {"validation": 0.15, "test": 0.15, "seed": 3}, **DATA[task](raw)}
        d["dataset"] = ds
        if task == "causal_lm":
            t["seq_len"] = 32

    dr, ctx = run_spec_dag(tmp_path, edit, name=f"team_{task}")
    assert str(dr.state) == "success", dr.state
    report = json.loads(ctx.storage.read_bytes(ctx.report_key))
    test = report["test"]
    assert test["metric"] == METRICS[task][0]
    for metric in METRICS[task]:  # every metric of the task, by name, and finite
        assert np.isfinite(test[metric]), (metric, test)
    card = json.loads(ctx.storage.read_bytes(report["model_card"].split(str(ctx.storage.uri).rstrip("/") + "/")[-1]))
    assert card["task"] == task and card["model"]["name"] == team_package.ENTRY_POINT
    assert card["model"]["options"] == {"width": 16} and card["weights_file"] == "model.safetensors"
    from safetensors.torch import load_file

    import importlib

    team_models = importlib.import_module(team_package.DIST)  # the README's plain-PyTorch load
    weights = load_file(str(ctx.storage.local_path(f"models/team_{task}/{card['version']}/model.safetensors")))
    model = team_models.factory(card["model"]["options"], card["model"]["data"])
    model.load_state_dict(weights)
