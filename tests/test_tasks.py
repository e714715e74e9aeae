"""The tasks (ballast.training.tasks): each task's loss and metrics against computations by hand, the
summable parts adding up over shards, how a batch becomes inputs and targets, micro-batch slicing of
tensors and dicts, and the light tables (no torch at import)."""

from __future__ import annotations

import math

import pytest

from ballast.training import tasks

pytestmark = pytest.mark.unit


def _ops(task, **kw):
    from ballast.training.tasks.ops import TaskOps

    return TaskOps(task, **kw)


def test_the_tables_are_the_contract():
    assert tasks.TASKS == ("classification", "causal_lm", "segmentation", "regression")
    assert {t: tasks.default_metric(t) for t in tasks.TASKS} == {
        "classification": "accuracy", "causal_lm": "loss", "segmentation": "mean_iou", "regression": "rmse"}
    assert set(tasks.ALL_METRICS) == {m for ms in tasks.METRICS.values() for m in ms} == set(tasks.DIRECTION)
    with pytest.raises(ValueError,
                       match=r"'accuracy' is not a metric of task causal_lm \(loss, perplexity, bits_per_byte\)"):
        tasks.metric_of("causal_lm", "accuracy")
    assert tasks.metric_of("segmentation", None) == "mean_iou"


def test_the_tables_and_the_model_modules_import_no_torch_at_module_level():
    """The spec reads the tables at DAG-parse time; lint loads a factory for its options_schema."""
    import ast
    import inspect
    import importlib

    for name in ("ballast.training.tasks", "ballast.training.scores", "ballast.training.models",
                 "ballast.training.models.registry", "ballast.training.models.classic", "ballast.training.models.gpt",
                 "ballast.training.models.unet", "ballast.training.models.hf"):
        tree = ast.parse(inspect.getsource(importlib.import_module(name)))
        top = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
        top += [node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)]
        assert not [m for m in top if m.split(".")[0] in ("torch", "jsonschema", "transformers")], name


def test_classification_loss_and_accuracy_by_hand():
    import torch

    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    labels = torch.tensor([0, 0, 1])
    ops = _ops("classification", num_classes=2)
    by_hand = [-math.log(math.exp(2) / (math.exp(2) + 1)), -math.log(1 / (1 + math.e)), math.log(2)]
    assert float(ops.loss(logits, labels)) == pytest.approx(sum(by_hand) / 3, rel=1e-6)
    scores = ops.score(logits, labels)
    assert scores["loss"] == pytest.approx(sum(by_hand) / 3, rel=1e-6)
    assert scores["accuracy"] == pytest.approx(1 / 3)  # argmax of a tie is the first class: row 3 wrong


def test_causal_lm_shifts_the_tokens_and_scores_every_token():
    import torch

    tokens = torch.tensor([[1, 2, 3, 0], [3, 3, 1, 2]])
    ops = _ops("causal_lm", token_bytes=[1, 2, 1, 3])
    x, y = ops.prepare(tokens.to(torch.int32), None)
    assert x.dtype == torch.int64 and x.tolist() == [[1, 2, 3], [3, 3, 1]] and y.tolist() == [[2, 3, 0], [3, 1, 2]]
    logits = torch.zeros(2, 3, 4)
    logits[0, 0, 2] = 5.0  # one confident right guess
    per_token = [-math.log(math.exp(5) / (math.exp(5) + 3))] + [math.log(4)] * 5
    mean = sum(per_token) / 6
    assert float(ops.loss(logits, y)) == pytest.approx(mean, rel=1e-6)
    scores = ops.score(logits, y)
    assert scores["loss"] == pytest.approx(mean, rel=1e-6)
    assert scores["perplexity"] == pytest.approx(math.exp(mean), rel=1e-6)
    target_bytes = 1 + 3 + 2 + 3 + 1 + 1  # the bytes tokens 2, 3, 0, 3, 1, 2 stand for
    assert scores["bits_per_byte"] == pytest.approx(sum(per_token) / math.log(2) / target_bytes, rel=1e-6)
    assert "bits_per_byte" not in _ops("causal_lm").score(logits, y)  # ids without a tokenizer: no byte lengths
    assert _ops("causal_lm").metrics == ("loss", "perplexity")


def test_segmentation_mean_iou_and_dice_by_hand():
    import torch
    import torch.nn.functional as F

    # 1 image 2x2, 3 classes; predicted [[0, 1], [1, 1]], truth [[0, 0], [1, 1]]; class 2 nowhere.
    pred = torch.tensor([[[0, 1], [1, 1]]])
    truth = torch.tensor([[[0, 0], [1, 1]]])
    logits = F.one_hot(pred, 3).permute(0, 3, 1, 2).float() * 4
    scores = _ops("segmentation", num_classes=3).score(logits, truth)
    # class 0: I 1, P 1, T 2 -> IoU 1/2, Dice 2/3; class 1: I 2, P 3, T 2 -> IoU 2/3, Dice 4/5; class 2 absent.
    assert scores["mean_iou"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert scores["dice"] == pytest.approx((2 / 3 + 4 / 5) / 2)
    assert scores["loss"] == pytest.approx(float(F.cross_entropy(logits, truth)), rel=1e-6)


def test_regression_rmse_mae_and_a_scalar_target_squeezed():
    import torch

    out = torch.tensor([[1.0], [2.0], [4.0]])  # a model's (N, 1) for a scalar target
    y = torch.tensor([1.5, 2.0, 2.0])
    ops = _ops("regression")
    assert float(ops.loss(out, y)) == pytest.approx((0.25 + 0 + 4) / 3)
    scores = ops.score(out, y)
    assert scores == pytest.approx({"rmse": math.sqrt(4.25 / 3), "mae": 2.5 / 3, "loss": 4.25 / 3, "samples": 3})
    grid = ops.score(torch.ones(2, 2, 3), torch.zeros(2, 2, 3))  # an array target: every element
    assert grid["rmse"] == 1.0 and grid["mae"] == 1.0


@pytest.mark.parametrize("task,make", [
    ("classification", lambda g: (__import__("torch").randn(30, 5, generator=g),
                                  __import__("torch").randint(0, 5, (30,), generator=g))),
    ("segmentation", lambda g: (__import__("torch").randn(30, 4, 3, 3, generator=g),
                                __import__("torch").randint(0, 4, (30, 3, 3), generator=g))),
    ("regression", lambda g: (__import__("torch").randn(30, 2, generator=g),
                              __import__("torch").randn(30, 2, generator=g))),
    ("causal_lm", lambda g: (__import__("torch").randn(30, 6, 7, generator=g),
                             __import__("torch").randint(0, 7, (30, 6), generator=g))),
])
def test_parts_summed_over_shards_score_as_the_whole(task, make):
    import torch

    ops = _ops(task, num_classes=5 if task == "classification" else 4, token_bytes=[1, 2, 1, 1, 3, 1, 2])
    out, y = make(torch.Generator().manual_seed(1))
    shards = [ops.parts(out[r::4], y[r::4]) for r in range(4)] + [ops.empty_parts()]
    summed = [sum(p) for p in zip(*shards)]
    assert ops.scores(summed) == pytest.approx(ops.score(out, y), rel=1e-9)
    assert set(ops.scores(summed)) == {*ops.metrics, "samples"}


def test_micro_batches_slice_tensors_and_dicts_alike():
    import torch

    from ballast.training.tasks.ops import micro_batches, rows, take

    x = {"a": torch.arange(8).reshape(4, 2), "b": torch.arange(4)}
    parts = list(micro_batches(x, torch.arange(4) * 10, 2, 2))
    assert [p[0]["b"].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert [p[1].tolist() for p in parts] == [[0, 10], [20, 30]]
    assert [p[1] for p in micro_batches(torch.zeros(4, 3), None, 1, 4)] == [None] * 4
    assert rows(x) == 4 and take(x, 1, 3)["a"].tolist() == [[2, 3], [4, 5]]


def test_split_parts_score_a_rank_share_in_batches():
    import numpy as np
    import torch

    from ballast.training.tasks.ops import split_parts

    ops = _ops("regression")
    model = torch.nn.Identity()
    x = np.arange(10, dtype=np.float32)
    y = np.zeros(10, dtype=np.float32)
    both = [split_parts(model, ops, x, y, device="cpu", batch=3, rank=r, world=2) for r in range(2)]
    assert both[0][0] == 5 and both[0][2] == sum(float(v) ** 2 for v in range(0, 10, 2))
    assert ops.scores([a + b for a, b in zip(*both)])["mae"] == pytest.approx(4.5)


def test_every_rank_runs_the_same_number_of_forward_passes():
    """A sharded (FSDP) model's forward is a collective: ranks with fewer rows still take part."""
    import numpy as np
    import torch

    from ballast.training.tasks.ops import split_parts

    calls = []

    class Counting(torch.nn.Module):
        def forward(self, x):
            calls.append(len(x))
            return x

    ops = _ops("regression")
    x, y = np.arange(7, dtype=np.float32), np.zeros(7, dtype=np.float32)
    parts = []
    for rank in range(3):  # 3, 2 and 2 rows; batches of 2: two passes each
        calls.clear()
        parts.append(split_parts(Counting(), ops, x, y, device="cpu", batch=2, rank=rank, world=3))
        assert len(calls) == 2, rank
    assert [p[0] for p in parts] == [3, 2, 2]  # the repeated row is not scored
    assert ops.scores([sum(v) for v in zip(*parts)])["mae"] == pytest.approx(3.0)


def test_read_only_arrays_become_writable_tensors_without_a_warning(recwarn):
    import numpy as np

    from ballast.training.tasks.ops import as_tensors

    frozen = np.arange(6, dtype=np.float32)
    frozen.flags.writeable = False
    shared = np.arange(3, dtype=np.int64)
    out = as_tensors({"a": frozen, "b": shared})
    out["a"][0] = 5.0  # a copy: the array is untouched
    assert frozen[0] == 0 and out["b"].data_ptr() == shared.ctypes.data  # a writable one is shared
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_the_packed_columns_must_be_the_ones_the_model_was_built_for():
    from ballast.training.failure import DataFailure

    lm = {"task": "causal_lm", "input_shape": [8], "seq_len": 8, "inputs": {"tokens": {"shape": [8], "dtype": "int64"}}}
    manifest = {"columns": [{"name": "tokens", "dtype": "int32", "shape": [9], "codec": "ndarray", "role": "feature"}]}
    tasks.check_columns(manifest, lm, ["tokens"], where="/cache")  # seq_len + 1 tokens per stored sequence
    with pytest.raises(DataFailure, match=r"^/cache: feature 'tokens' has shape \[9\], the model expects \[17\];"
                                          r" convert the dataset again for this spec$"):
        tasks.check_columns(manifest, {**lm, "seq_len": 16}, ["tokens"], where="/cache")
    cls = {"task": "classification", "input_shape": [8, 8], "inputs": {"image": {"shape": [8, 8], "dtype": "float32"}}}
    with pytest.raises(DataFailure, match=r"^/cache: the dataset has no feature column 'image' \(it has tokens\)"):
        tasks.check_columns(manifest, cls, ["image"], where="/cache")
