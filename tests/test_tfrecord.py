"""The TFRecord shards as TensorFlow users read them: the README's recipe gives back every array exactly.

The shards are written by `ballast.data.packing.write_shard`, what both conversion engines call (the Spark
engine's output is byte-identical to the arrow engine's: tests/test_convert_spark.py). They are parsed
with the feature description the README documents, through the `tfrecord` package here, and through
TensorFlow itself, in an environment of its own that the tests build and cache (tests/readers.py:
TensorFlow is not in the project's environment).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ballast.data.packing import FeatureEncoder, write_shard
from ballast.spec import FieldSpec

from ballast.training.dataset.format import FORMAT_VERSION
from ballast.training.dataset.reader import load_split
from readers import readme_recipe, run_reader

README = Path(__file__).resolve().parents[1] / "README.md"

# (spec type, shape, codec): a tensor of each numeric spec type, and images TensorFlow decodes.
CASES = [
    ("float32", (8, 8), "auto"),
    ("float64", (3, 2, 2), "auto"),
    ("int32", (5,), "auto"),
    ("int64", (2, 3), "auto"),
    ("bool", (4, 4), "auto"),
    ("uint8", (8, 8), "ndarray"),
    ("uint8", (8, 8), "png"),
    ("uint8", (6, 5, 3), "png"),
]


def _values(dtype: str, shape: tuple[int, ...], n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.startswith("float"):
        return rng.normal(size=(n, *shape)).astype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=(n, *shape)).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -2**40), min(info.max, 2**40), size=(n, *shape), dtype=dtype, endpoint=True)


# Columns of every other kind, in one dataset: two features, a scalar of each stored kind, and labels.
MIXED = [
    ("image", "float32", (4, 4), "auto", "feature"),
    ("ids", "int64", (7,), "auto", "feature"),
    ("weight", "float32", (), "auto", "feature"),
    ("flag", "bool", (), "auto", "feature"),
    ("count", "uint8", (), "auto", "feature"),
    ("target", "float64", (), "auto", "label"),
]


def write_columns(root: Path, columns: list[tuple], n: int = 30, given: dict | None = None) -> dict[str, np.ndarray]:
    """Two TFRecord shards of the train split with these (name, dtype, shape, codec, role) columns (values
    random, or `given`), and their manifest; returns each column's values as written."""
    encoders, values = [], {}
    for i, (name, dtype, shape, codec, role) in enumerate(columns):
        encoders.append(FeatureEncoder(FieldSpec(name=name, type=dtype, shape=shape, codec=codec), role))
        values[name] = (given or {}).get(name, _values(dtype, shape, n, i))
    layouts = [e.layout for e in encoders]
    entries = []
    for shard, rows in enumerate((slice(0, n // 2), slice(n // 2, n))):
        cols = {e.layout.name: e.encode(values[e.layout.name][rows]) for e in encoders}
        entries += write_shard(root, "train", shard, cols, formats=("tfrecord",), layouts=layouts, row_group_rows=8)
    manifest = {"format_version": FORMAT_VERSION, "columns": [c.to_manifest() for c in layouts], "num_classes": 10,
                "files": entries}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return values


def write_dataset(root: Path, dtype: str, shape: tuple[int, ...], codec: str,
                  n: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """A feature `image` of this kind and an int64 class `label`; returns (features, labels) as written."""
    y = np.arange(n, dtype=np.int64) % 10
    values = write_columns(root, [("image", dtype, shape, codec, "feature"), ("label", "int64", (), "auto", "label")],
                           n, {"label": y})
    return values["image"], y


class TensorFlowByTheTfrecordPackage:
    """The TensorFlow calls the README's recipe makes, done by the tfrecord package (record framing, Example
    parsing with the recipe's own feature description) and numpy/OpenCV (decode_raw, decode_image), so
    that the recipe itself runs here, where TensorFlow is not installed. Records what it was asked."""

    string, int64, float32 = "string", "int64", "float32"

    def __init__(self):
        self.descriptions: list[dict] = []
        tf = self

        class io:  # noqa: N801
            @staticmethod
            def FixedLenFeature(shape, dtype):  # noqa: N802
                return (dtype, list(shape))

            @staticmethod
            def parse_single_example(record, description):
                from tfrecord import example_pb2
                from tfrecord.reader import extract_feature_dict

                tf.descriptions.append(description)
                types = {k: {"string": "byte", "int64": "int", "float32": "float"}[t] for k, (t, _) in description.items()}
                features = example_pb2.Example.FromString(bytes(record)).features
                parsed = extract_feature_dict(features, types, {"byte": "bytes_list", "int": "int64_list",
                                                                "float": "float_list"})
                out = {}
                for key, (t, shape) in description.items():
                    value = parsed[key]
                    if t == "string":
                        assert shape == [], key
                        out[key] = bytes(value)  # one bytes value, as FixedLenFeature([], tf.string)
                    else:
                        assert list(np.shape(value)) == (shape or [1]), (key, np.shape(value), shape)
                        out[key] = np.asarray(value, t).reshape(shape)
                return out

            @staticmethod
            def decode_raw(value, dtype):
                return np.frombuffer(value, dtype=np.dtype(dtype).newbyteorder("<"))

            @staticmethod
            def decode_image(value, expand_animations=True):
                import cv2

                img = cv2.imdecode(np.frombuffer(value, np.uint8), cv2.IMREAD_UNCHANGED)
                return cv2.cvtColor(img, cv2.COLOR_BGR2RGB) if img.ndim == 3 else img[..., None]

            class gfile:  # noqa: N801
                @staticmethod
                def glob(pattern):
                    import glob

                    return glob.glob(pattern)

        class dtypes:  # noqa: N801
            as_dtype = staticmethod(lambda name: name)

        class data:  # noqa: N801
            class TFRecordDataset:
                def __init__(self, files):
                    self.files = files

                def map(self, fn):
                    from tfrecord.reader import tfrecord_iterator

                    return [fn(rec) for path in self.files for rec in tfrecord_iterator(path)]

        self.io, self.dtypes, self.data = io, dtypes, data

    @staticmethod
    def reshape(x, shape):
        return np.reshape(x, tuple(int(d) for d in shape))


def read_with_the_readme_recipe(root: Path, split: str, tf) -> list:
    """Run the README's recipe with `tf` for TensorFlow: its read_split(root, split)."""
    namespace: dict = {"tf": tf, "__name__": "readme_recipe"}
    recipe = readme_recipe().replace("import tensorflow as tf\n", "")
    exec(compile(recipe, "<README.md: the TFRecord recipe>", "exec"), namespace)  # noqa: S102
    return list(namespace["read_split"](str(root), split))


@pytest.mark.unit
@pytest.mark.parametrize("dtype,shape,codec", CASES)
def test_the_readme_recipe_on_the_tfrecord_package_gives_back_every_array(tmp_path, dtype, shape, codec):
    x, y = write_dataset(tmp_path, dtype, shape, codec)
    tf = TensorFlowByTheTfrecordPackage()
    got = read_with_the_readme_recipe(tmp_path, "train", tf)
    assert tf.descriptions[0] == {"image": ("string", []), "image/shape": ("int64", [len(shape)]),
                                  "image/dtype": ("string", []), "label": ("int64", [])}
    assert len(got) == len(x)
    for rec, vx, vy in zip(got, x, y):
        gx, gy = rec["image"], rec["label"]
        # a float32 [8, 8] comes back as 64 floats equal to the input (the .npy header made it 96)
        assert gx.shape == vx.shape and gx.dtype == vx.dtype and np.array_equal(gx, vx), (dtype, shape, codec)
        assert int(gy) == int(vy)
    first = next((tmp_path / "tfrecord" / "train").glob("*.tfrecord"))
    from tfrecord.reader import tfrecord_loader

    rec = next(iter(tfrecord_loader(str(first), None, {"image": "byte", "image/shape": "int", "image/dtype": "byte"})))
    assert list(rec["image/shape"]) == list(shape) and bytes(rec["image/dtype"]) == dtype.encode()
    if codec == "png":
        assert bytes(rec["image"])[:8] == b"\x89PNG\r\n\x1a\n"  # the image file, as tf.io.decode_image reads it
    else:
        assert len(bytes(rec["image"])) == np.dtype(dtype).itemsize * int(np.prod(shape))  # no header
    # Our own reader follows the same encoding: integer features (token ids) as int64, the rest float32.
    split = load_split(tmp_path, "train", fmt="tfrecord")
    want = np.int64 if dtype in ("int32", "int64") else np.float32
    assert split.features.dtype == want and np.array_equal(split.features, x.astype(want))
    assert split.labels.dtype == np.int64 and np.array_equal(split.labels, y) and len(split) == len(y)


@pytest.mark.unit
def test_every_kind_of_column_comes_back_exactly_through_the_recipe_and_the_reader(tmp_path):
    values = write_columns(tmp_path, MIXED)
    tf = TensorFlowByTheTfrecordPackage()
    got = read_with_the_readme_recipe(tmp_path, "train", tf)
    assert tf.descriptions[0] == {
        "image": ("string", []), "image/shape": ("int64", [2]), "image/dtype": ("string", []),
        "ids": ("string", []), "ids/shape": ("int64", [1]), "ids/dtype": ("string", []),
        "weight": ("float32", []), "flag": ("int64", []), "count": ("int64", []),
        "target": ("string", []), "target/shape": ("int64", [0]), "target/dtype": ("string", [])}
    for name, want in values.items():
        column = np.stack([np.asarray(rec[name]) for rec in got])
        if name in ("flag", "count"):  # int64_list: the value, as an integer
            column = column.astype(want.dtype)
        assert column.shape == want.shape and column.dtype == want.dtype, name
        assert column.tobytes() == want.tobytes(), name  # float64 and float32 scalars bit for bit
    split = load_split(tmp_path, "train", fmt="tfrecord")
    assert sorted(split.features) == ["count", "flag", "ids", "image", "weight"]
    assert split.features["ids"].dtype == np.int64 and np.array_equal(split.features["ids"], values["ids"])
    assert split.features["image"].dtype == np.float32 and np.array_equal(split.features["image"], values["image"])
    assert split.features["weight"].tobytes() == values["weight"].tobytes()
    assert np.array_equal(split.features["flag"], values["flag"].astype(np.float32))
    assert np.array_equal(split.features["count"], values["count"].astype(np.float32))
    assert split.labels.dtype == np.float32 and np.array_equal(split.labels, values["target"].astype(np.float32))


@pytest.mark.unit
def test_tfrecord_shards_are_byte_identical_across_writes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_dataset(a, "float32", (8, 8), "auto")
    write_dataset(b, "float32", (8, 8), "auto")
    for shard in sorted((a / "tfrecord" / "train").glob("*.tfrecord")):
        assert shard.read_bytes() == (b / "tfrecord" / "train" / shard.name).read_bytes()


TF_SCRIPT = """
import sys

import numpy as np

exec(open(sys.argv[1]).read())  # the README's recipe: defines read_split
for root, out in zip(sys.argv[2::2], sys.argv[3::2]):  # (dataset, npz) pairs: TensorFlow imported once
    columns = {}
    for record in read_split(root, "train"):
        for name, value in record.items():
            columns.setdefault(name, []).append(value.numpy())
    np.savez(out, **{name: np.stack(v) for name, v in columns.items()})
"""


@pytest.mark.integration
def test_tensorflow_reads_the_shards_with_the_readme_recipe(tmp_path):
    recipe = tmp_path / "recipe.py"
    recipe.write_text(readme_recipe())
    written, pairs = [], []
    for i, (dtype, shape, codec) in enumerate(CASES):
        root = tmp_path / f"case{i}"
        root.mkdir()
        written.append(write_dataset(root, dtype, shape, codec))
        pairs += [str(root), str(tmp_path / f"case{i}.npz")]
    root = tmp_path / "mixed"
    root.mkdir()
    values = write_columns(root, MIXED)
    run_reader("tensorflow", TF_SCRIPT, str(recipe), *pairs, str(root), str(tmp_path / "mixed.npz"))
    for i, ((dtype, shape, codec), (x, y)) in enumerate(zip(CASES, written, strict=True)):
        with np.load(tmp_path / f"case{i}.npz", allow_pickle=False) as got:
            assert got["image"].dtype == x.dtype and got["image"].shape == x.shape, (dtype, shape, codec)
            assert np.array_equal(got["image"], x), (dtype, shape, codec)
            assert np.array_equal(got["label"], y)
    with np.load(tmp_path / "mixed.npz", allow_pickle=False) as got:
        for name, want in values.items():
            column = got[name].astype(want.dtype) if name in ("flag", "count") else got[name]
            assert column.dtype == want.dtype and column.tobytes() == want.tobytes(), name
