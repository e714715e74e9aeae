"""Evaluation in micro-batches: the test split streams from the packed cache in bounded batches
(reader.iter_split) and each task's summable metric parts add up to exactly the scores of the split
scored as one batch, for every task and both formats; the published model scored in the same pass
gets its own scores; what streaming holds at once does not grow with the split; and the evaluate stage
itself reads `evaluation.batch_size`. In-process (the real converter writes the packed datasets)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from ballast.spec import parse_spec
from datasets import regression_edit, regression_raw, segmentation_edit, write_columns
from helpers import example_data

pytestmark = pytest.mark.unit

FORMATS = ("petastorm", "tfrecord")


def _classification(loc: Path, rows: int = 700, side: int = 8):
    rng = np.random.default_rng(0)
    cols = {"image": rng.uniform(0, 16, size=(rows, side, side)).astype(np.float32),
            "label": rng.integers(0, 10, size=rows)}

    def edit(d):
        d["dataset"]["location"] = str(loc)
        d["dataset"]["fields"][0]["shape"] = [side, side]
        d["training"]["model"] = "mlp"

    return cols, edit


def _segmentation(loc: Path):
    rng = np.random.default_rng(1)
    image = rng.uniform(0, 1, size=(500, 16, 16)).astype(np.float32)
    mask = (image * 4).astype(np.int64).clip(0, 3)
    mask[:, :4] = rng.integers(0, 4, size=(500, 4, 16))  # not learnable everywhere: some errors, every class
    edit = segmentation_edit(loc, size=16)

    def both(d):
        edit(d)
        d["training"]["model"] = {"name": "unet", "options": {"depth": 1, "base_width": 4}}

    return {"image": image, "mask": mask}, both


def _regression(loc: Path):
    return regression_raw(600), regression_edit(loc)


def _causal_lm(loc: Path):
    ids = np.random.default_rng(2).integers(0, 97, size=(500, 17)).astype(np.int32)

    def edit(d):
        d["dataset"] = {"location": str(loc), "fields": [{"name": "ids", "type": "int32", "shape": [17]}],
                        "split": {"validation": 0.1, "test": 0.1, "seed": 3}}
        d["validation"] = {"rules": []}
        d["training"].update(task="causal_lm", seq_len=16,
                             model={"name": "gpt", "options": {"layers": 1, "width": 16, "heads": 2, "vocab_size": 97}})
        d["training"].pop("hidden_size", None)
        for key in ("metric", "mode", "threshold"):
            d["evaluation"].pop(key, None)

    return {"ids": ids}, edit


CASES = {"classification": _classification, "segmentation": _segmentation, "regression": _regression,
         "causal_lm": _causal_lm}


def packed(tmp: Path, task: str, *, test: float | None = None, row_group_rows: int = 20, shard_rows: int = 45,
           **size):
    """The task's raw data converted in this process by the real converter into both formats under
    tmp/cache: (cache dir, spec, raw columns)."""
    import json

    from ballast.data.packing import layout, plan_chunks
    from ballast.stages.convert import convert_arrow, finish

    cols, edit = CASES[task](tmp / "raw", **size)
    raw = write_columns(tmp / "raw" / "part-0.parquet", cols)
    d = example_data()
    d["storage"]["uri"], d["cache"]["directory"] = str(tmp / "storage"), str(tmp / "c")
    edit(d)
    d["conversion"].update(formats=list(FORMATS), shard_rows=shard_rows, row_group_rows=row_group_rows)
    if test is not None:
        d["dataset"]["split"].update(validation=0.0, test=test)
    spec = parse_spec(d)
    root = tmp / "cache"
    root.mkdir()
    entries = finish(root, spec, convert_arrow(plan_chunks([raw]), spec, np.zeros(0, np.int64), root))
    manifest = {**layout(spec.dataset, task=spec.training.task, seq_len=spec.training.seq_len), "files": entries}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root, spec


def model_of(spec, seed: int):
    import torch
    from ballast.launch.config import run_config
    from ballast.training.models import build_configured_model

    section = run_config(spec, data_dir=".", data_format="petastorm", checkpoint_dir=".", output_dir=".").model
    torch.manual_seed(seed)
    return build_configured_model(section).eval(), section


def task_ops(spec, section):
    from ballast.training.tasks.ops import TaskOps

    token_bytes = list(range(1, 98)) if spec.training.task == "causal_lm" else None  # bits_per_byte too
    return TaskOps(section.task, num_classes=section.data.get("num_classes"), token_bytes=token_bytes)


def one_batch(model, task, split):
    """The scores of the whole split as one batch (one forward pass), and the model's output."""
    import torch
    from ballast.training.tasks.ops import as_tensors

    x, y = task.prepare(as_tensors(split.features), as_tensors(split.labels))
    with torch.no_grad():
        out = model(x)
    return task.scores(task.parts(out, y)), out, y


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-9) for k in a)


@pytest.mark.parametrize("task_name", list(CASES))
def test_streamed_scores_equal_the_split_scored_as_one_batch(tmp_path, task_name):
    from ballast.stages.evaluate import score_batches
    from ballast.training.dataset.reader import iter_split, load_split
    from ballast.training.tasks.ops import per_class_accuracy

    root, spec = packed(tmp_path, task_name)
    model, section = model_of(spec, seed=0)
    published, _ = model_of(spec, seed=1)  # another model of the same shape: if_better's baseline
    task = task_ops(spec, section)
    for fmt in FORMATS:
        whole = load_split(root, "test", fmt=fmt)
        n = len(whole)
        assert n > 40  # several blocks (row groups of 20, TFRecord shards of 45 rows)
        want, out, y = one_batch(model, task, whole)
        theirs, _, _ = one_batch(published, task, whole)
        assert set(want) == {*task.metrics, "samples"} and want["samples"] == n
        assert not close(want, theirs)  # the two models score differently: the tallies cannot be swapped
        for rows in (1, 7, 64, n + 5):
            batches = list(iter_split(root, "test", fmt=fmt, batch_rows=rows))
            assert [len(b) for b in batches] == [rows] * (n // rows) + ([n % rows] if n % rows else [])
            mine, base = score_batches([model, published], task, iter(batches), per_class=task_name == "classification")
            got = task.scores(mine.parts)
            assert close(got, want), (fmt, rows, got, want)
            assert close(task.scores(base.parts), theirs), (fmt, rows)
            if task_name == "classification":
                assert mine.per_class_accuracy() == per_class_accuracy(out, y)
                assert sum(mine.seen) == n and sum(mine.right) == round(want["accuracy"] * n)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_batches_are_the_split_in_file_order_with_its_label_check(tmp_path, fmt):
    from ballast.training.dataset.reader import iter_split, load_split
    from ballast.training.failure import DataFailure

    root, _ = packed(tmp_path, "regression")
    whole = load_split(root, "test", fmt=fmt)
    batches = list(iter_split(root, "test", fmt=fmt, batch_rows=13))
    for k in ("image", "extra"):
        assert np.array_equal(np.concatenate([b.features[k] for b in batches]), whole.features[k])
    assert np.array_equal(np.concatenate([b.labels for b in batches]), whole.labels)
    with pytest.raises(DataFailure, match=r"the manifest lists no .* shards for split 'nowhere'"):
        iter_split(root, "nowhere", fmt=fmt, batch_rows=8)  # refused at the call, not when first read
    with pytest.raises(ValueError, match=r"batch_rows must be >= 1 \(got 0\)"):
        iter_split(root, "test", fmt=fmt, batch_rows=0)
    seg, _ = packed(tmp_path / "seg", "segmentation")
    with pytest.raises(DataFailure, match=r"labels outside \[0, 3\) in split 'test'"):
        list(iter_split(seg, "test", fmt=fmt, batch_rows=8, num_classes=3))


def test_streaming_holds_a_block_and_a_batch_not_the_split(tmp_path, monkeypatch):
    """What the stream holds at once (numpy's and Python's allocations, traced) is bounded by a few times
    a block, a batch and a fixed allowance (the manifest, the decoder), far below the split (~11 MB, 340 row groups or
    54 shards), which the same measure sees load_split hold. Blocks are read lazily: the first batch
    has read only the blocks it needs."""
    import tracemalloc

    from ballast.training.dataset import reader

    root, _ = packed(tmp_path, "classification", test=0.45, row_group_rows=8, shard_rows=50, rows=6000, side=32)
    row_bytes = 32 * 32 * 4
    split_rows = len(reader.load_split(root, "test", fmt="petastorm"))
    assert split_rows > 2500
    fixed = 512 * 1024
    original = reader.read_block
    for fmt in FORMATS:
        reads: list[int] = []

        def counted(*a, _reads=reads, _read=original, **k):
            _reads.append(1)
            return _read(*a, **k)

        monkeypatch.setattr(reader, "read_block", counted)
        stream = reader.iter_split(root, "test", fmt=fmt, batch_rows=16)
        assert not reads  # nothing read before the first batch is asked for
        first = next(stream)
        assert len(first) == 16 and len(reads) == (2 if fmt == "petastorm" else 1)
        monkeypatch.setattr(reader, "read_block", original)

        for _ in reader.iter_split(root, "test", fmt=fmt, batch_rows=16):
            pass  # once untraced: the interpreter's one-off growth (interned path names) is not the data's
        tracemalloc.start()
        seen = sum(len(b) for b in reader.iter_split(root, "test", fmt=fmt, batch_rows=16))
        _, streamed = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        tracemalloc.start()
        whole = reader.load_split(root, "test", fmt=fmt)
        _, loaded = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert seen == len(whole) == split_rows
        block = (8 if fmt == "petastorm" else 50) * row_bytes
        held = 8 * block + 16 * row_bytes  # a block's records as read, raw and decoded (transient), a batch
        assert loaded > split_rows * row_bytes  # the measure sees a whole split held
        assert streamed < held + fixed < split_rows * row_bytes / 4, (fmt, streamed, held, loaded)


def test_the_evaluate_stage_scores_in_batches_of_evaluation_batch_size(tmp_path, caplog):
    """evaluate.run on a committed checkpoint: the same record at batch_size 7 as in one batch, and the
    log says the batch size and the rows scored (the progress line)."""
    import logging

    from ballast.pipeline.context import RunContext
    from ballast.records import CheckedCheckpoint, VerifyResult, WarmCacheResult
    from ballast.stages import evaluate
    from ballast.training import checkpoint as ckpt
    from ballast.training.dataset.reader import load_split

    root, spec = packed(tmp_path, "classification")
    model, section = model_of(spec, seed=3)
    w = ckpt.Writer(tmp_path / "ckpt", 10, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", model.state_dict())
    w.write_json("trainer.json", {"step": 10, "epoch": 1, "history": [{"epoch": 0, "accuracy": 0.1}],
                                  "model": section.model_dump(mode="json")})
    best = w.commit()
    want, _, _ = one_batch(model, task_ops(spec, section), load_split(root, "test", fmt="petastorm"))
    records = []
    for size in (7, 65_536):
        d = spec.model_dump(mode="json")
        d["evaluation"].update(batch_size=size, threshold=None)
        ctx = RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id=f"b{size}")
        checked = CheckedCheckpoint(path=str(best), step=10, files=3, parameters=1)
        ctx.save_result("verify_checkpoint", VerifyResult(last=checked, best=checked))
        ctx.save_result("warm_cache", WarmCacheResult(cache_dir=str(root), format="petastorm", phases=[],
                                                      pending_phases=0, seconds=0.0))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=ctx.log.name):
            records.append(evaluate.run(ctx))
        assert any(f"held-out rows in batches of {size} " in r.getMessage() for r in caplog.records), caplog.text
        rows = records[-1].test_rows  # the progress line at the end: every row of the split scored
        assert any(r.getMessage().startswith(f"evaluate: {rows}/{rows} rows (100%)") for r in caplog.records)
    small, big = records
    assert small.test_rows == big.test_rows == want["samples"]
    assert math.isclose(small.accuracy, want["accuracy"]) and math.isclose(small.loss, want["loss"], rel_tol=1e-5)
    assert small.per_class_accuracy == big.per_class_accuracy and len(small.per_class_accuracy) == 10
    assert math.isclose(small.loss, big.loss, rel_tol=1e-5) and small.accuracy == big.accuracy
