"""The data-side stages on real files, without Airflow: validate, convert, warm_cache; storage safety."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ballast.context import RunContext
from ballast.errors import DataError, StorageError
from ballast.spec import parse_spec
from ballast.stages import convert, validate, warm_cache
from ballast.storage import LocalStorage, safe_key
from conftest import example_data


def make_ctx(tmp_path: Path, raw: Path, edit=None, run_id: str = "manual__2026-01-01T00:00:00+00:00") -> RunContext:
    d = example_data()
    d["dataset"]["location"] = str(raw)
    d["storage"]["uri"] = str(tmp_path / "storage")
    d["cache"]["directory"] = str(tmp_path / "cache")
    if edit:
        edit(d)
    return RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id=run_id)


def raw_table(n: int = 1200, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    images = rng.uniform(0, 16, size=(n, 64)).astype(np.float32)
    labels = rng.integers(0, 10, size=n).astype(np.int64)
    return {"images": images, "labels": labels}


def write_raw(path: Path, images, labels, *, image_type=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    col = pa.array([row.tolist() for row in images], type=image_type or pa.list_(pa.float32()))
    pq.write_table(pa.table({"image": col, "label": pa.array(labels)}), path)
    return path


def run_chain(ctx: RunContext, *stages) -> dict:
    out = {}
    for module in stages:
        name = module.__name__.rsplit(".", 1)[-1]
        out[name] = module.run(ctx)
        ctx.save_result(name, out[name])
    return out


def test_validate_passes_on_digits(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    result = validate.run(ctx)
    assert result["rows"] == 1797
    assert result["failures"] == []
    assert len(result["input_fingerprint"]) == 64


@pytest.mark.parametrize("damage,pattern", [
    ("nan", r"expect_column_values_to_be_in_set on image__finite: expected values in \[True\], 3 rows"),
    ("labels", r"expect_column_values_to_be_in_set on label: expected values in \[0, 1, .*\], 2 rows, e\.g\. \[(42|-1), (42|-1)\]"),
    ("range", r"expect_column_values_to_be_between on image__max: expected between None and 16\.0, 1 rows"),
    ("shape", r"expect_column_values_to_be_in_set on image__len: expected values in \[64\], 1 rows"),
    ("few_rows", r"expect_table_row_count_to_be_between: observed 50, expected between 1000 and None"),
])
def test_validate_fails_with_summary_of_bad_rows(tmp_path, damage, pattern):
    t = raw_table()
    images, labels = t["images"], t["labels"]
    rows = [list(r) for r in images]
    if damage == "nan":
        for i in (3, 5, 7):
            rows[i][10] = float("nan")
    elif damage == "labels":
        labels[[1, 2]] = [42, -1]
    elif damage == "range":
        rows[9][0] = 99.0
    elif damage == "shape":
        rows[4] = rows[4][:60]
    elif damage == "few_rows":
        rows, labels = rows[:50], labels[:50]
    raw = tmp_path / "raw" / "part-0.parquet"
    raw.parent.mkdir(parents=True)
    pq.write_table(pa.table({"image": pa.array(rows, type=pa.list_(pa.float32())), "label": pa.array(labels)}), raw)
    with pytest.raises(DataError, match=pattern):
        validate.run(make_ctx(tmp_path, raw.parent))


@pytest.mark.parametrize("kind,pattern", [
    ("missing_column", r"part-0\.parquet: missing column 'label' \(dataset\.fields\)"),
    ("wrong_type", r"part-0\.parquet: column 'image' has type string, spec says an array of float32 with shape \[8, 8\]"),
    ("truncated", r"part-0\.parquet: not a readable Parquet file"),
    ("nowhere", r"dataset\.location: .*does-not-exist does not exist"),
])
def test_validate_refuses_unreadable_or_mismatched_input(tmp_path, kind, pattern):
    raw = tmp_path / "raw" / "part-0.parquet"
    raw.parent.mkdir(parents=True)
    t = raw_table(100)
    if kind == "missing_column":
        pq.write_table(pa.table({"image": pa.array([r.tolist() for r in t["images"]])}), raw)
    elif kind == "wrong_type":
        pq.write_table(pa.table({"image": pa.array(["x"] * 100), "label": pa.array(t["labels"])}), raw)
    elif kind == "truncated":
        write_raw(raw, t["images"], t["labels"])
        raw.write_bytes(raw.read_bytes()[:-200])
    location = tmp_path / "does-not-exist" if kind == "nowhere" else raw.parent
    with pytest.raises(DataError, match=pattern):
        validate.run(make_ctx(tmp_path, location))


def test_convert_writes_manifest_and_is_idempotent(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    out = run_chain(ctx, validate, convert)["convert"]
    assert out["reused"] is False
    assert out["rows"] == {"train": 1365, "validation": 159, "test": 273}
    storage = ctx.storage
    manifest = json.loads(storage.read_bytes(f"{out['prefix']}/manifest.json"))
    assert {f["format"] for f in manifest["files"]} == {"petastorm", "tfrecord"}
    assert sum(f["rows"] for f in manifest["files"] if f["format"] == "tfrecord") == 1797
    again = convert.run(ctx)
    assert again["reused"] is True and again["dataset_id"] == out["dataset_id"]
    # Another shard size is another dataset.
    ctx2 = make_ctx(tmp_path, digits_raw, lambda d: d["conversion"].update(shard_rows=500))
    ctx2.save_result("validate", ctx.result("validate"))
    assert convert.run(ctx2)["dataset_id"] != out["dataset_id"]


def test_converted_shards_are_readable_by_petastorm_and_tfrecord(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    out = run_chain(ctx, validate, convert)["convert"]
    root = Path(ctx.storage.local_path(out["prefix"]))
    from petastorm import make_batch_reader

    n = 0
    with make_batch_reader(f"file://{root}/petastorm/test", num_epochs=1, workers_count=1) as reader:
        for batch in reader:
            n += len(batch.label)
            assert batch.image[0].shape == (64,)
    assert n == 273
    from tfrecord.torch.dataset import TFRecordDataset

    ds = TFRecordDataset(str(root / "tfrecord/test/part-00000.tfrecord"), None, {"image": "byte", "label": "int"})
    first = next(iter(ds))
    assert np.frombuffer(first["image"], dtype=np.float32).shape == (64,)


def test_split_assignment_is_deterministic():
    a = convert.assign_splits(10_000, validation=0.1, test=0.15, seed=7)
    b = convert.assign_splits(10_000, validation=0.1, test=0.15, seed=7)
    c = convert.assign_splits(10_000, validation=0.1, test=0.15, seed=8)
    assert (a == b).all() and not (a == c).all()
    assert abs((a == 2).mean() - 0.15) < 0.02 and abs((a == 1).mean() - 0.1) < 0.02


def test_warm_cache_stages_verify_and_skip(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw, lambda d: d["conversion"].update(shard_rows=100))
    out = run_chain(ctx, validate, convert, warm_cache)["warm_cache"]
    first, rest = out["stages"]
    assert first["stage"] == "first_steps" and first["files"] == 4  # ceil(0.25 * 14 train shards)
    assert rest["files"] == 10 + 2 + 3  # remaining train shards + validation + test
    cache = Path(out["cache_dir"])
    assert (cache / "manifest.json").exists()
    again = warm_cache.run(ctx)
    assert [s["downloaded"] for s in again["stages"]] == [0, 0]
    # A damaged cached file is fetched again.
    victim = next((cache / "petastorm" / "train").iterdir())
    victim.write_bytes(b"garbage")
    third = warm_cache.run(ctx)
    assert sum(s["downloaded"] for s in third["stages"]) == 1


def test_warm_cache_refuses_damaged_source_and_over_budget(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    conv = run_chain(ctx, validate, convert)["convert"]
    shard = Path(ctx.storage.local_path(conv["prefix"])) / "petastorm" / "train" / "part-00000.parquet"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"part-00000\.parquet: size or sha256 differs from the dataset manifest"):
        warm_cache.run(ctx)
    assert not any(p.name == "part-00000.parquet" for p in Path(ctx.cache_root).rglob("*"))  # nothing half-trusted
    small = make_ctx(tmp_path, digits_raw, lambda d: d["cache"].update(max_bytes=1000))
    small.save_result("convert", conv)
    with pytest.raises(StorageError, match=r"cache\.max_bytes: stage 'first_steps' needs \d+ more bytes"):
        warm_cache.run(small)


def test_warm_cache_refuses_keys_escaping_the_cache(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    conv = run_chain(ctx, validate, convert)["convert"]
    key = f"{conv['prefix']}/manifest.json"
    manifest = json.loads(ctx.storage.read_bytes(key))
    manifest["files"][0]["path"] = "../../../etc/evil"
    ctx.storage.write_bytes(key, json.dumps(manifest).encode())
    with pytest.raises(StorageError, match=r"object key '\.\./\.\./\.\./etc/evil' would escape its directory"):
        warm_cache.run(ctx)


@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/../../b", ""])
def test_safe_key_refuses_escapes(key):
    with pytest.raises(StorageError):
        safe_key(key)


def test_local_storage_roundtrip(tmp_path):
    s = LocalStorage(tmp_path)
    s.write_bytes("a/b.txt", b"hi")
    assert s.read_bytes("a/b.txt") == b"hi" and list(s.list("a")) == ["a/b.txt"]
    assert not list(tmp_path.rglob("*.tmp"))
    with pytest.raises(StorageError, match="no such file"):
        s.read_bytes("a/missing")
