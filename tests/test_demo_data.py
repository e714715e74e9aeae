"""`ballast data`'s example sets: the standard library corpus, shapes and their masks (2-D and 3-D), a
disc's area; deterministic by seed, in the raw format the specs read."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from ballast.data.demo import stdlib_sources, write_corpus, write_regression, write_segmentation
from ballast.dev.cli import main as cli

pytestmark = pytest.mark.unit


def test_the_corpus_is_the_standard_library_one_document_per_file_within_the_size_limit(tmp_path):
    path = write_corpus(tmp_path / "c", max_mb=2, docs_per_group=16)
    table = pq.read_table(path)
    texts, names = table.column("text").to_pylist(), table.column("path").to_pylist()
    size = sum(len(t.encode()) for t in texts)
    assert 1.5e6 < size <= 2e6 and len(texts) == len(set(names))
    assert names == sorted(names) and not any("site-packages" in n for n in names)
    sources = {p.as_posix().split("/")[-1] for p in stdlib_sources()}
    assert {n.split("/")[-1] for n in names} <= sources
    first = next(p for p in stdlib_sources() if p.as_posix().endswith(names[0]))
    assert texts[0] == first.read_text(encoding="utf-8")  # the file itself, not a copy of ours
    assert pq.ParquetFile(path).metadata.num_row_groups == -(-len(texts) // 16)  # bounded row groups
    again = write_corpus(tmp_path / "d", max_mb=2, repeat=3)
    assert pq.read_table(again).column("text").to_pylist() == texts * 3


def test_segmentation_masks_mark_the_shapes_the_images_show(tmp_path):
    path = write_segmentation(tmp_path / "s", rows=40, size=24, seed=5)
    t = pq.read_table(path)
    images = np.asarray(t.column("image").to_pylist(), np.float32).reshape(-1, 24, 24)
    masks = np.asarray(t.column("mask").to_pylist(), np.int64).reshape(-1, 24, 24)
    assert t.schema.field("mask").type.value_type.bit_width == 64 and set(np.unique(masks)) == {0, 1, 2, 3}
    means = [images[masks == k].mean() for k in range(4)]  # each class its own brightness under the noise
    assert np.allclose(means, [0.2, 0.8, 0.55, 0.35], atol=0.03)
    same = write_segmentation(tmp_path / "again", rows=40, size=24, seed=5)
    assert pq.read_table(same).equals(t)
    vol = pq.read_table(write_segmentation(tmp_path / "v", rows=6, size=12, three_d=True, depth=8, dtype="uint8"))
    masks3 = np.asarray(vol.column("mask").to_pylist()).reshape(-1, 8, 12, 12)
    assert set(np.unique(masks3)) <= {0, 1, 2} and len(np.unique(masks3)) > 1
    assert vol.schema.field("image").type.value_type.bit_width == 8


def test_the_regression_label_is_the_discs_share_of_the_image(tmp_path):
    t = pq.read_table(write_regression(tmp_path / "r", rows=50, size=16, seed=2))
    images = np.asarray(t.column("image").to_pylist(), np.float32).reshape(-1, 16, 16)
    area = np.asarray(t.column("area").to_pylist(), np.float32)
    assert t.schema.field("area").type == "float"
    bright = (images > 0.5).reshape(50, -1).mean(axis=1)  # disc pixels at 0.8, background at 0.2
    assert np.allclose(bright, area, atol=0.02) and area.min() > 0 and area.max() < 0.5


def test_ballast_data_writes_each_set_under_ballast_home(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BALLAST_HOME", str(tmp_path))
    assert cli(["data", "segmentation", "--3d", "--rows", "4", "--size", "8"]) == 0
    assert cli(["data", "regression", "--rows", "5", "--name", "areas"]) == 0
    assert cli(["data", "corpus", "--max-mb", "0.2"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(tmp_path / "raw" / d / "part-00000.parquet") for d in ("segmentation", "areas", "corpus")]
    assert pq.read_metadata(out[0]).num_rows == 4 and pq.read_metadata(out[1]).num_rows == 5
