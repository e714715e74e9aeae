"""The spark engine, in a real local Spark session, writes the same dataset as the arrow engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from ballast.stages import convert, validate
from helpers import make_ctx, run_chain

pytestmark = pytest.mark.integration


def test_spark_and_arrow_engines_write_the_same_rows(tmp_path, digits_raw):
    # Three raw files with several row groups each: many Spark tasks, rows crossing shard boundaries.
    table = pq.read_table(digits_raw / "part-00000.parquet")
    raw = tmp_path / "raw"
    raw.mkdir()
    for i, start in enumerate(range(0, table.num_rows, 600)):
        pq.write_table(table.slice(start, 600), raw / f"part-{i}.parquet", row_group_size=128)

    def settings(engine):
        def edit(d):
            d["conversion"].update(engine=engine, shard_rows=100, row_group_rows=40, spark_master="local[2]")
            d["validation"]["rules"] = [r for r in d["validation"]["rules"] if r["kind"] != "row_count"]
        return edit

    arrow = make_ctx(tmp_path / "arrow", raw, settings("arrow"))
    spark = make_ctx(tmp_path / "spark", raw, settings("spark"))
    a = run_chain(arrow, validate, convert)["convert"]
    s = run_chain(spark, validate, convert)["convert"]
    assert s.engine == "spark" and a.engine == "arrow"
    assert a.dataset_id == s.dataset_id and a.rows == s.rows
    ma = json.loads(arrow.storage.read_bytes(f"{a.prefix}/manifest.json"))
    ms = json.loads(spark.storage.read_bytes(f"{s.prefix}/manifest.json"))
    key = lambda m: [(f["path"], f["rows"], f["bytes"], f["sha256"]) for f in m["files"]]  # noqa: E731
    assert key(ma) == key(ms)  # the same files, byte for byte

    # And the rows, read back from the Parquet shards (Petastorm reads them in tests/test_readers.py),
    # are the input's rows.
    import io

    root = Path(spark.storage.local_path(s.prefix))
    raw_rows = {np.asarray(r, np.float32).tobytes() for r in table.column("image").to_pylist()}
    n = 0
    for split in ("train", "validation", "test"):
        for part in sorted((root / "petastorm" / split).glob("part-*.parquet")):
            for value in pq.read_table(part, columns=["image"]).column("image").to_pylist():
                assert np.load(io.BytesIO(value), allow_pickle=False).tobytes() in raw_rows
                n += 1
    assert n == table.num_rows


def test_spark_and_arrow_engines_write_the_same_bytes_for_several_columns_and_a_float_label(tmp_path):
    """Two features (float32 [4, 4], int64 [3]) and a float32 scalar label: every column in both formats,
    the same files from both engines, and the rows read back are the raw rows of each split."""
    from ballast.training.dataset.reader import load_split
    from datasets import regression_edit, regression_raw, rows_by_split, write_columns

    values = regression_raw(500)
    write_columns(tmp_path / "raw" / "part-0.parquet", {k: v[:260] for k, v in values.items()})
    write_columns(tmp_path / "raw" / "part-1.parquet", {k: v[260:] for k, v in values.items()})

    def settings(engine):
        def edit(d):
            regression_edit(tmp_path / "raw")(d)
            d["conversion"].update(engine=engine, shard_rows=70, row_group_rows=30, spark_master="local[2]")
        return edit

    arrow = make_ctx(tmp_path / "arrow", tmp_path / "raw", settings("arrow"))
    spark = make_ctx(tmp_path / "spark", tmp_path / "raw", settings("spark"))
    a = run_chain(arrow, validate, convert)["convert"]
    s = run_chain(spark, validate, convert)["convert"]
    ma = json.loads(arrow.storage.read_bytes(f"{a.prefix}/manifest.json"))
    ms = json.loads(spark.storage.read_bytes(f"{s.prefix}/manifest.json"))
    key = lambda m: [(f["path"], f["rows"], f["bytes"], f["sha256"]) for f in m["files"]]  # noqa: E731
    assert a.dataset_id == s.dataset_id and key(ma) == key(ms)
    assert [(c["name"], c["codec"], c["role"]) for c in ma["columns"]] == \
        [("image", "ndarray", "feature"), ("extra", "ndarray", "feature"), ("y", "scalar", "label")]
    want = rows_by_split(values)
    root = Path(spark.storage.local_path(s.prefix))
    for fmt in ("petastorm", "tfrecord"):
        for split, rows in want.items():
            got = load_split(root, split, fmt=fmt)
            assert got.features["extra"].dtype == np.int64 and np.array_equal(got.features["extra"], rows["extra"])
            assert np.array_equal(got.features["image"], rows["image"]), (fmt, split)
            assert got.labels.dtype == np.float32 and got.labels.tobytes() == rows["y"].tobytes(), (fmt, split)
