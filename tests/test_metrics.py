"""training.metrics: the scores and the better/threshold rule that the trainer and evaluate share."""

from __future__ import annotations

import ast
import inspect

import pytest
import training.metrics
from training.metrics import ScoreSums, classification_sums, improved, per_class_accuracy, reaches

pytestmark = pytest.mark.unit


def test_scores_from_parts_summed_over_shards_equal_the_whole():
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(101, 7, generator=g), torch.randint(0, 7, (101,), generator=g)
    whole = classification_sums(logits, labels).scores()
    assert whole["loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-6)
    assert whole["accuracy"] == pytest.approx(float((logits.argmax(1) == labels).float().mean()))
    assert whole["samples"] == 101
    shards = [classification_sums(logits[r::3], labels[r::3]) for r in range(3)]  # three ranks
    summed = ScoreSums.from_list([sum(p) for p in zip(*(s.as_list() for s in shards))])
    assert summed.scores() == pytest.approx(whole)
    assert (shards[0] + shards[1] + shards[2]).scores() == pytest.approx(whole)


def test_an_empty_shard_scores_nothing_without_dividing_by_zero():
    import torch

    empty = classification_sums(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64))
    assert empty == ScoreSums(samples=0.0, loss_sum=0.0, correct=0.0)
    assert empty.scores() == {"accuracy": 0.0, "loss": 0.0, "samples": 0.0}


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


def test_the_metrics_module_imports_no_torch_at_module_level():
    tree = ast.parse(inspect.getsource(training.metrics))
    top = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
    top += [node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert not [m for m in top if m.split(".")[0] == "torch"]
