"""The epoch loader on datasets of every shape: several features reach the model as a dict of tensors by
name, a language model's token sequences come without a target, labels keep their type (a float label
float32, token ids int64); the sample order still never depends on the worker count, and a run resumes
at any sample position."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from ballast.stages import convert, validate
from datasets import (BYTE_EOT, corpus_texts, expected_sequences, regression_edit, regression_raw, text_edit, utf8_ids,
                      write_columns, write_texts)
from helpers import make_ctx, run_chain

pytestmark = pytest.mark.integration


def _collect(root: Path, fmt: str, *, workers: int, start: int = 0, batch: int = 8, rank: int = 0):
    import torch

    from ballast.training.dataset.loader import EpochLoader

    loader = EpochLoader(root, fmt=fmt, rank=rank, world=2, seed=11, workers=workers)
    xs, ys = [], []
    for x, y in loader.batches(1, batch=batch, start=start):
        xs.append(x)
        ys.append(y)
    if isinstance(xs[0], dict):
        x = {k: torch.cat([b[k] for b in xs]) for k in xs[0]}
    else:
        x = torch.cat(xs)
    return x, (None if ys[0] is None else torch.cat(ys)), loader


@pytest.mark.parametrize("fmt", ["petastorm", "tfrecord"])
def test_several_features_arrive_as_a_dict_and_a_float_label_as_float32(tmp_path, fmt):
    import torch

    values = regression_raw(400)
    raw = write_columns(tmp_path / "raw" / "part-0.parquet", values)
    ctx = make_ctx(tmp_path, raw, lambda d: (regression_edit(tmp_path / "raw")(d),
                                             d["conversion"].update(shard_rows=50, row_group_rows=20)))
    out = run_chain(ctx, validate, convert)["convert"]
    root = Path(ctx.storage.local_path(out.prefix))
    x0, y0, loader = _collect(root, fmt, workers=0)
    assert sorted(x0) == ["extra", "image"] and x0["extra"].dtype == torch.int64 and x0["image"].dtype == torch.float32
    assert y0.dtype == torch.float32 and len(y0) == loader.samples_per_rank // 8 * 8 == len(x0["image"])
    x2, y2, _ = _collect(root, fmt, workers=2)
    assert all(torch.equal(x0[k], x2[k]) for k in x0) and torch.equal(y0, y2)  # whatever the workers
    xr, yr, _ = _collect(root, fmt, workers=2, start=24)
    assert all(torch.equal(xr[k], x0[k][24:]) for k in x0) and torch.equal(yr, y0[24:])
    # each row's columns stay together: a row's label is the raw label of the row its features came from
    by_image = {values["image"][i].tobytes(): i for i in range(len(values["y"]))}
    rows = [by_image[r.numpy().tobytes()] for r in x0["image"]]
    assert np.array_equal(y0.numpy(), values["y"][rows]) and np.array_equal(x0["extra"].numpy(), values["extra"][rows])


@pytest.mark.parametrize("fmt", ["petastorm", "tfrecord"])
def test_token_sequences_come_as_int64_without_a_target(tmp_path, fmt):
    import torch

    texts = corpus_texts(200)
    ctx = make_ctx(tmp_path, write_texts(tmp_path / "raw" / "part-0.parquet", texts), text_edit(tmp_path / "raw"))
    out = run_chain(ctx, validate, convert)["convert"]
    root = Path(ctx.storage.local_path(out.prefix))
    x0, y0, loader = _collect(root, fmt, workers=0)
    assert y0 is None and x0.dtype == torch.int64 and x0.shape[1] == 17
    x2, _, _ = _collect(root, fmt, workers=2, start=16)
    assert torch.equal(x2, x0[16:])
    x1, _, _ = _collect(root, fmt, workers=1, rank=1)
    train = expected_sequences(texts, utf8_ids, seq_len=16, eot=BYTE_EOT)["train"]
    planned = Counter(r.tobytes() for r in train)
    seen = Counter(r.numpy().tobytes() for r in torch.cat([x0, x1]))
    assert not seen - planned and sum(seen.values()) > 0.9 * len(train)  # ranks read disjoint planned rows


def test_pre_tokenized_ids_without_a_label_are_packed_and_read_as_they_are(tmp_path):
    """causal_lm on an integer array column of token ids (no text, no label): one int32 feature column."""
    import json

    from ballast.training.dataset.reader import load_split
    from datasets import rows_by_split

    ids = np.random.default_rng(2).integers(0, 50_000, size=(300, 33)).astype(np.int32)
    raw = write_columns(tmp_path / "raw" / "part-0.parquet", {"ids": ids})

    def edit(d):
        d["dataset"] = {"location": str(tmp_path / "raw"), "fields": [{"name": "ids", "type": "int32", "shape": [33]}],
                        "split": {"validation": 0.1, "test": 0.1, "seed": 3}}
        d["validation"] = {"rules": []}
        d["training"].update(task="causal_lm", model={"name": "gpt", "options": {"layers": 1, "width": 32, "heads": 2}},
                             seq_len=32)
        d["training"].pop("hidden_size", None)
        for key in ("metric", "mode", "threshold"):
            d["evaluation"].pop(key, None)

    ctx = make_ctx(tmp_path, raw, edit)
    out = run_chain(ctx, validate, convert)["convert"]
    root = Path(ctx.storage.local_path(out.prefix))
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["columns"] == [{"name": "ids", "dtype": "int32", "shape": [33], "codec": "ndarray",
                                    "role": "feature"}] and "tokenizer" not in manifest
    want = rows_by_split({"ids": ids})
    for fmt in ("petastorm", "tfrecord"):
        got = load_split(root, "train", fmt=fmt)
        assert got.labels is None and got.features.dtype == np.int64
        assert np.array_equal(got.features, want["train"]["ids"])
    x, y, _ = _collect(root, "petastorm", workers=2)
    assert y is None and x.dtype.is_floating_point is False and x.shape[1] == 33


def test_the_workers_are_forked_once_and_every_iteration_reads_its_own_position(digits_cache):
    """Persistent workers: the same processes serve every epoch, a resume position and an iteration
    begun after one abandoned mid-way (as the trainer leaves each epoch's loader), with the batches the
    in-process loader gives for each; `close` ends them. Forked at each epoch's start, a worker could
    inherit a lock the checkpoint writer's thread held (see EpochLoader._make_loader)."""
    import multiprocessing

    import torch

    from ballast.training.dataset.loader import EpochLoader

    def take(loader, epoch, start, n):
        out = []
        for _, (x, y) in zip(range(n), loader.batches(epoch, batch=16, start=start)):
            out.append((x, y))
        return out

    root, fmt = Path(digits_cache.cache_dir), digits_cache.format
    plan = [(0, 0, 3), (0, 48, 100), (1, 0, 100), (2, 32, 2), (2, 0, 100)]  # (epoch, start, batches taken)
    mine, baseline = EpochLoader(root, fmt=fmt, rank=1, world=2, seed=3, workers=2), \
        EpochLoader(root, fmt=fmt, rank=1, world=2, seed=3, workers=0)
    before = {p.pid for p in multiprocessing.active_children()}
    pids = []
    for epoch, start, n in plan:
        got, want = take(mine, epoch, start, n), take(baseline, epoch, start, n)
        assert len(got) == len(want) > 0, (epoch, start)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want)), (epoch, start)
        pids.append({p.pid for p in multiprocessing.active_children()} - before)
    assert len(pids[0]) == 2 and all(p == pids[0] for p in pids), pids  # the same two workers throughout
    mine.close()
    assert not {p.pid for p in multiprocessing.active_children()} - before
