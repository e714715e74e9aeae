"""What Ballast writes, read back by the real readers its users have, bit for bit.

Ballast writes Petastorm's format without Petastorm (ballast.data.petastorm_format) and TFRecord
through its own encoder; these tests read the demo dataset's every split back with Petastorm 0.13.1
(`make_reader` and `make_batch_reader`) and with TensorFlow's parser, each in an environment of its
own pinned the way that reader needs (tests/readers.py), and with Spark here, and compare with the raw
rows: values and labels, exactly. A language model's token sequences, a segmentation set (images
and masks) and a set of scalar columns (a float64 feature, a float32 label) are read back the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ballast.data.packing import SPLITS, FeatureEncoder, split_codes
from ballast.spec import FieldSpec
from ballast.stages import convert, validate
from helpers import make_ctx, run_chain
from readers import readme_recipe, run_reader


def raw_rows(ctx) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The raw input's rows by split, as the spec's types say them: (features, labels), in row order."""
    ds = ctx.spec.dataset
    f = ds.features[0]
    files = sorted(Path(ctx.spec.dataset.location).glob("*.parquet")) if Path(ds.location).is_dir() \
        else [Path(ds.location)]
    table = pa.concat_tables([pq.read_table(p, columns=[f.name, ds.label]) for p in files])
    x = np.asarray(table.column(f.name).to_pylist(), dtype=f.type).reshape(-1, *f.shape)
    y = table.column(ds.label).to_numpy().astype(np.int64)
    codes = split_codes(np.arange(len(y)), validation=ds.split.validation, test=ds.split.test, seed=ds.split.seed)
    return {split: (x[codes == k], y[codes == k]) for k, split in enumerate(SPLITS)}


def assert_same_rows(got_x: np.ndarray, got_y: np.ndarray, want: tuple[np.ndarray, np.ndarray], what: str) -> None:
    """The same rows, bit for bit, whatever order the reader gave them in."""
    want_x, want_y = want
    assert got_x.dtype == want_x.dtype and got_x.shape == want_x.shape, (what, got_x.dtype, got_x.shape)
    key = lambda x, y: sorted(zip(y.tolist(), (r.tobytes() for r in x)))  # noqa: E731
    assert key(got_x, got_y) == key(want_x, want_y), what


@pytest.fixture(scope="module")
def demo(tmp_path_factory, digits_raw):
    """The digits demo converted by the pipeline: (its dataset directory, the raw rows by split)."""
    tmp = tmp_path_factory.mktemp("readers")
    ctx = make_ctx(tmp, digits_raw)
    out = run_chain(ctx, validate, convert)["convert"]
    return Path(ctx.storage.local_path(out.prefix)), raw_rows(ctx)


PETASTORM_SCRIPT = r"""
import io
import sys
import numpy as np
from petastorm import make_batch_reader, make_reader

root, out = sys.argv[1], sys.argv[2]
# The dummy pool reads in this thread. Petastorm 0.13.1's thread and process pools check "every worker
# is idle" and then "the ventilator is done" without a lock: a ventilator thread that lags between the
# two checks ends the epoch early, row groups unread (seen once in CI: 1024 of 1365 rows).
arrays = {}
for split in ("train", "validation", "test"):
    url = f"file://{root}/petastorm/{split}"
    xs, ys = [], []
    with make_reader(url, num_epochs=1, reader_pool_type="dummy", shuffle_row_groups=False) as reader:
        for row in reader:  # decoded through the pickled Unischema's codecs
            xs.append(row.image)
            ys.append(row.label)
    arrays[f"reader_x_{split}"], arrays[f"reader_y_{split}"] = np.stack(xs), np.asarray(ys, np.int64)
    xs, ys = [], []
    with make_batch_reader(url, num_epochs=1, reader_pool_type="dummy", shuffle_row_groups=False) as reader:
        for batch in reader:  # columns as stored: the NdarrayCodec's .npy bytes, decoded as a user would
            xs.extend(np.load(io.BytesIO(v), allow_pickle=False) for v in batch.image)
            ys.extend(batch.label)
    arrays[f"batch_x_{split}"], arrays[f"batch_y_{split}"] = np.stack(xs), np.asarray(ys, np.int64)
np.savez(out, **arrays)
"""


@pytest.mark.integration
def test_petastorm_reads_every_split_of_the_demo_dataset_exactly(demo, tmp_path):
    root, raw = demo
    out = tmp_path / "petastorm.npz"
    run_reader("petastorm", PETASTORM_SCRIPT, str(root), str(out))
    with np.load(out, allow_pickle=False) as got:
        for split in SPLITS:
            for kind in ("reader", "batch"):
                assert_same_rows(got[f"{kind}_x_{split}"], got[f"{kind}_y_{split}"], raw[split], f"{kind} {split}")
    union = np.concatenate([raw[s][1] for s in SPLITS])
    assert len(union) == 1797  # every raw row is in exactly one split


CODEC_SCRIPT = r"""
import sys
import numpy as np
import pyarrow.parquet as pq
from petastorm.codecs import CompressedImageCodec, NdarrayCodec
from petastorm.unischema import UnischemaField

t = pq.read_table(sys.argv[1]).to_pydict()
x = np.asarray(t["x"], np.float32).reshape(-1, 3, 4)
field = UnischemaField("f", np.float32, (3, 4), NdarrayCodec(), False)
assert t["encoded"] == [bytes(NdarrayCodec().encode(field, row)) for row in x], "ndarray bytes differ"
t = pq.read_table(sys.argv[2]).to_pydict()
img = np.asarray(t["img"], np.uint8).reshape(-1, 6, 5, 3)
gfield = UnischemaField("g", np.uint8, (6, 5, 3), CompressedImageCodec("png"), False)
decoded = [CompressedImageCodec("png").decode(gfield, v) for v in t["encoded"]]
assert all((d == i).all() for d, i in zip(decoded, img)), "png images differ"
print("ok", len(x), len(img))
"""


@pytest.mark.integration
def test_the_encoder_writes_the_bytes_petastorms_codecs_write(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 3, 4)).astype(np.float32)
    img = rng.integers(0, 256, size=(3, 6, 5, 3), dtype=np.uint8)
    enc = FeatureEncoder(FieldSpec(name="f", type="float32", shape=(3, 4)))
    png = FeatureEncoder(FieldSpec(name="g", type="uint8", shape=(6, 5, 3)))
    pq.write_table(pa.table({"x": pa.array(list(x.reshape(5, -1))), "encoded": enc.encode(x)}), tmp_path / "x.parquet")
    pq.write_table(pa.table({"img": pa.array(list(img.reshape(3, -1))), "encoded": png.encode(img)}),
                   tmp_path / "img.parquet")
    # Petastorm's own codecs (in its environment), on the same arrays: identical .npy bytes, lossless PNG
    # in the RGB order petastorm expects.
    out = run_reader("petastorm", CODEC_SCRIPT, str(tmp_path / "x.parquet"), str(tmp_path / "img.parquet"))
    assert out.split() == ["ok", "5", "3"]


TF_SCRIPT = r"""
import sys
import numpy as np

exec(open(sys.argv[1]).read())  # the README's recipe: defines read_split
arrays = {}
for split in ("train", "validation", "test"):
    xs, ys = [], []
    for record in read_split(sys.argv[2], split):
        xs.append(record["image"].numpy())
        ys.append(int(record["label"].numpy()))
    arrays[f"x_{split}"], arrays[f"y_{split}"] = np.stack(xs), np.asarray(ys, np.int64)
np.savez(sys.argv[3], **arrays)
"""


@pytest.mark.integration
def test_tensorflow_reads_every_split_of_the_demo_dataset_exactly(demo, tmp_path):
    root, raw = demo
    recipe = tmp_path / "recipe.py"
    recipe.write_text(readme_recipe())
    out = tmp_path / "tf.npz"
    run_reader("tensorflow", TF_SCRIPT, str(recipe), str(root), str(out))
    with np.load(out, allow_pickle=False) as got:
        for split in SPLITS:
            assert_same_rows(got[f"x_{split}"], got[f"y_{split}"], raw[split], f"tensorflow {split}")


@pytest.mark.integration
def test_spark_reads_the_petastorm_parquet_back_exactly(demo):
    import io

    from pyspark.sql import SparkSession

    root, raw = demo
    spark = (SparkSession.builder.master("local[1]").appName("ballast-readers")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "1").getOrCreate())
    try:
        for split in SPLITS:
            rows = spark.read.parquet(str(root / "petastorm" / split)).select("image", "label").collect()
            x = np.stack([np.load(io.BytesIO(bytes(r["image"])), allow_pickle=False) for r in rows])
            y = np.asarray([r["label"] for r in rows], np.int64)
            assert_same_rows(x, y, raw[split], f"spark {split}")
    finally:
        spark.stop()
    manifest = json.loads((root / "manifest.json").read_text())
    assert {f["split"] for f in manifest["files"]} == set(SPLITS)


# --- the other kinds of dataset: a language model's token sequences, segmentation masks -----------------

COLUMNS_PETASTORM = r"""
import sys
import numpy as np
from petastorm import make_reader

root, out, columns = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
arrays = {}
for split in ("train", "validation", "test"):
    rows = {c: [] for c in columns}
    # The dummy pool: Petastorm 0.13.1's thread pool loses a few rows now and then when a split has a
    # hundred row groups of 8 rows (936 of 944 in one run, all 944 in the next; the dummy pool reads all).
    with make_reader(f"file://{root}/petastorm/{split}", num_epochs=1, reader_pool_type="dummy",
                     shuffle_row_groups=False) as reader:
        for row in reader:  # every column decoded through the pickled Unischema's codecs
            for c in columns:
                rows[c].append(getattr(row, c))
    for c in columns:
        arrays[f"{split}__{c}"] = np.stack(rows[c])
np.savez(out, **arrays)
"""

COLUMNS_TENSORFLOW = r"""
import sys
import numpy as np

exec(open(sys.argv[1]).read())  # the README's recipe: defines read_split
arrays = {}
for split in ("train", "validation", "test"):
    rows = {}
    for record in read_split(sys.argv[2], split):
        for name, value in record.items():
            rows.setdefault(name, []).append(value.numpy())
    arrays.update({f"{split}__{name}": np.stack(v) for name, v in rows.items()})
np.savez(sys.argv[3], **arrays)
"""


def _same_row_sets(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    """The same rows (every column of a row together), bit for bit, whatever order the reader gave."""
    names = sorted(want)
    for name in names:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, (what, name)
    key = lambda cols: sorted(b"|".join(cols[n][i].tobytes() for n in names)  # noqa: E731
                              for i in range(len(cols[names[0]])))
    assert key(got) == key(want), what


@pytest.fixture(scope="module")
def token_dataset(tmp_path_factory):
    """A text corpus converted by the pipeline with the byte vocabulary: (its directory, the token rows
    each split must hold, as int32)."""
    from datasets import BYTE_EOT, corpus_texts, expected_sequences, text_edit, utf8_ids, write_texts

    tmp = tmp_path_factory.mktemp("tokens")
    texts = corpus_texts(150)
    ctx = make_ctx(tmp, write_texts(tmp / "raw" / "part-0.parquet", texts), text_edit(tmp / "raw", seq_len=32))
    out = run_chain(ctx, validate, convert)["convert"]
    want = expected_sequences(texts, utf8_ids, seq_len=32, eot=BYTE_EOT)
    return Path(ctx.storage.local_path(out.prefix)), {s: {"tokens": r.astype(np.int32)} for s, r in want.items()}


@pytest.fixture(scope="module")
def segmentation_dataset(tmp_path_factory):
    """`ballast data segmentation`'s images and masks converted by the pipeline: (its directory, the raw
    rows of each split)."""
    from ballast.data.demo import write_segmentation
    from datasets import rows_by_split, segmentation_edit

    tmp = tmp_path_factory.mktemp("segmentation")
    raw = write_segmentation(tmp / "raw", rows=96, size=16, seed=4)
    ctx = make_ctx(tmp, raw, segmentation_edit(tmp / "raw", size=16))
    out = run_chain(ctx, validate, convert)["convert"]
    table = pq.read_table(raw)
    columns = {"image": np.asarray(table.column("image").to_pylist(), np.float32).reshape(-1, 16, 16),
               "mask": np.asarray(table.column("mask").to_pylist(), np.int64).reshape(-1, 16, 16)}
    return Path(ctx.storage.local_path(out.prefix)), rows_by_split(columns)


@pytest.fixture(scope="module")
def scalar_dataset(tmp_path_factory):
    """Two array features, a float64 scalar feature and a float32 scalar label converted by the pipeline:
    (its directory, the raw rows of each split)."""
    from datasets import regression_edit, regression_raw, rows_by_split, write_columns

    tmp = tmp_path_factory.mktemp("scalars")
    columns = regression_raw(240)
    columns["w"] = np.random.default_rng(9).normal(size=240) * 1e-300  # float64 only: a float32 would be 0
    raw = write_columns(tmp / "raw" / "part-0.parquet", columns)

    def edit(d):
        regression_edit(tmp / "raw")(d)
        d["dataset"]["fields"].insert(2, {"name": "w", "type": "float64"})

    ctx = make_ctx(tmp, raw, edit)
    out = run_chain(ctx, validate, convert)["convert"]
    return Path(ctx.storage.local_path(out.prefix)), rows_by_split(columns)


def _split_arrays(npz: Path, split: str) -> dict[str, np.ndarray]:
    with np.load(npz, allow_pickle=False) as got:
        return {k.split("__", 1)[1]: got[k] for k in got.files if k.startswith(f"{split}__")}


@pytest.mark.integration
@pytest.mark.parametrize("which", ["token_dataset", "segmentation_dataset", "scalar_dataset"])
def test_petastorm_reads_token_and_segmentation_datasets_exactly(which, request, tmp_path):
    root, want = request.getfixturevalue(which)
    out = tmp_path / "petastorm.npz"
    run_reader("petastorm", COLUMNS_PETASTORM, str(root), str(out), ",".join(want["train"]))
    for split in SPLITS:
        _same_row_sets(_split_arrays(out, split), want[split], f"petastorm {which} {split}")


@pytest.mark.integration
@pytest.mark.parametrize("which", ["token_dataset", "segmentation_dataset", "scalar_dataset"])
def test_tensorflow_reads_token_and_segmentation_datasets_exactly(which, request, tmp_path):
    root, want = request.getfixturevalue(which)
    recipe = tmp_path / "recipe.py"
    recipe.write_text(readme_recipe())
    out = tmp_path / "tf.npz"
    run_reader("tensorflow", COLUMNS_TENSORFLOW, str(recipe), str(root), str(out))
    for split in SPLITS:
        _same_row_sets(_split_arrays(out, split), want[split], f"tensorflow {which} {split}")


@pytest.mark.integration
def test_the_training_reader_gives_token_and_segmentation_datasets_back(token_dataset, segmentation_dataset):
    from ballast.training.dataset.reader import load_split

    root, want = token_dataset
    for split in SPLITS:
        got = load_split(root, split, fmt="petastorm")
        assert got.labels is None and got.features.dtype == np.int64
        assert np.array_equal(got.features, want[split]["tokens"])  # file order is the stream's order
    root, want = segmentation_dataset
    for fmt in ("petastorm", "tfrecord"):
        got = load_split(root, "test", fmt=fmt, num_classes=4)
        _same_row_sets({"image": got.features, "mask": got.labels}, want["test"], f"{fmt} segmentation")
