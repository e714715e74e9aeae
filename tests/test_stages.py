"""The data-side stages on real files, without Airflow: validate, convert, warm_cache; storage safety."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ballast.errors import DataError, StorageError
from ballast.data.packing import split_codes
from ballast.stages import convert, validate, warm_cache
from ballast.stages.warm_cache import plan_phases
from ballast.storage import FileStorage, safe_key
from helpers import damaged_rows, make_ctx, raw_table, run_chain, warm_cache_rest, write_raw


@pytest.mark.integration
def test_validate_passes_on_digits(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    result = validate.run(ctx)
    assert result.rows == 1797
    assert result.failures == []
    assert len(result.input_fingerprint) == 64


@pytest.mark.integration
@pytest.mark.parametrize("damage,pattern", [
    ("nan", r"expect_column_values_to_be_in_set on image__finite: expected values in \[True\], 3 rows"),
    ("labels", r"expect_column_values_to_be_in_set on label: expected values in \[0, 1, .*\], 2 rows, e\.g\. \[(42|-1), (42|-1)\]"),
    ("range", r"expect_column_values_to_be_between on image__max: expected between None and 16\.0, 1 rows"),
    ("shape", r"expect_column_values_to_be_in_set on image__len: expected values in \[64\], 1 rows"),
    ("few_rows", r"expect_table_row_count_to_be_between: observed 50, expected between 1000 and None"),
    ("imbalance", r"expect_column_min_to_be_between on label__share: observed 0\.0008\d*, expected between 0\.05 and None"),
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
    elif damage == "imbalance":
        labels[:] = np.where(labels == 3, 4, labels)
        labels[0] = 3  # one row of class 3 in 1200
    raw = tmp_path / "raw" / "part-0.parquet"
    raw.parent.mkdir(parents=True)
    pq.write_table(pa.table({"image": pa.array(rows, type=pa.list_(pa.float32())), "label": pa.array(labels)}), raw)
    with pytest.raises(DataError, match=pattern):
        validate.run(make_ctx(tmp_path, raw.parent))


def _damaged_raw(tmp_path: Path) -> tuple[Path, list[int]]:
    """1200 rows, of which rows 3, 5 (NaN), 9 (out of range), 4 (short) and 1 (bad label) are bad."""
    rows, labels, bad = damaged_rows()
    raw = tmp_path / "raw" / "part-0.parquet"
    raw.parent.mkdir(parents=True)
    pq.write_table(pa.table({"image": pa.array(rows, type=pa.list_(pa.float32())), "label": pa.array(labels)}), raw)
    return raw, bad


@pytest.mark.integration
def test_validate_failure_keeps_data_docs(tmp_path):
    raw, _ = _damaged_raw(tmp_path)
    ctx = make_ctx(tmp_path, raw.parent)
    with pytest.raises(DataError, match="6 of 10 expectations failed on 1200 rows"):
        validate.run(ctx)
    docs = ctx.result("validate").data_docs
    html = ctx.storage.read_bytes(docs).decode()
    assert "Data Docs" in html or "Great Expectations" in html
    pages = [k for k in ctx.storage.list(docs.rsplit("/", 1)[0]) if k.endswith(".html") and "validations" in k]
    assert pages, "the validation result page is part of the site"


@pytest.mark.integration
def test_validate_quarantines_bad_rows_and_convert_leaves_them_out(tmp_path):
    raw, bad = _damaged_raw(tmp_path)
    def quarantine(limit):
        def edit(d):
            # balance is table-level: the one row with label 42 would be a class of its own and fail it
            d["validation"]["rules"] = [r for r in d["validation"]["rules"] if r["kind"] != "balance"]
            d["validation"].update(on_failure="quarantine", max_bad_fraction=limit)
        return edit

    ctx = make_ctx(tmp_path, raw.parent, quarantine(0.01))
    out = run_chain(ctx, validate, convert)
    q = out["validate"].quarantine
    assert q.rows == len(bad)
    rows = pq.read_table(io.BytesIO(ctx.storage.read_bytes(q.file)))
    assert rows.column("_row").to_pylist() == bad
    reasons = dict(zip(rows.column("_row").to_pylist(), rows.column("_failed").to_pylist()))
    assert "image__finite" in reasons[3] and "label" in reasons[1] and "image__len" in reasons[4]
    assert sum(out["convert"].rows.values()) == 1200 - len(bad)
    # The same input with a stricter limit fails the run, naming the fraction.
    strict = make_ctx(tmp_path / "s", raw.parent, quarantine(0.001))
    with pytest.raises(DataError, match=r"validation\.max_bad_fraction: 5 of 1200 rows \(0\.42%\) fail expectations,"
                                        r" more than the 0\.10% allowed"):
        validate.run(strict)


@pytest.mark.integration
def test_quarantine_does_not_excuse_table_level_failures(tmp_path):
    t = raw_table(50)
    raw = write_raw(tmp_path / "raw" / "part-0.parquet", t["images"], t["labels"])
    ctx = make_ctx(tmp_path, raw.parent, lambda d: d["validation"].update(on_failure="quarantine"))
    with pytest.raises(DataError, match="table-level expectations failed.*expect_table_row_count_to_be_between"):
        validate.run(ctx)


@pytest.mark.integration
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


@pytest.mark.integration
def test_convert_writes_manifest_and_is_idempotent(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    out = run_chain(ctx, validate, convert)["convert"]
    assert out.reused is False
    assert out.rows == {"train": 1365, "validation": 159, "test": 273}
    storage = ctx.storage
    manifest = json.loads(storage.read_bytes(f"{out.prefix}/manifest.json"))
    assert {f["format"] for f in manifest["files"]} == {"petastorm", "tfrecord"}
    assert sum(f["rows"] for f in manifest["files"] if f["format"] == "tfrecord") == 1797
    again = convert.run(ctx)
    assert again.reused is True and again.dataset_id == out.dataset_id
    # Another shard size is another dataset.
    ctx2 = make_ctx(tmp_path, digits_raw, lambda d: d["conversion"].update(shard_rows=500))
    ctx2.save_result("validate", ctx.result("validate"))
    assert convert.run(ctx2).dataset_id != out.dataset_id


@pytest.mark.integration
def test_convert_and_warm_up_record_their_progress_while_they_work(tmp_path, digits_raw, monkeypatch):
    """What the task log says (done, total, rate, ETA) goes to runs/<dag>/<run>/progress/<stage>.json for
    the stability view: 0 done as the work starts, then each report, the last one finished."""
    from ballast.records import StageProgress

    ctx = make_ctx(tmp_path, digits_raw, lambda d: d["cache"].update(phases=[{"name": "first", "fraction": 0.5},
                                                                           {"name": "rest", "fraction": 1.0}]))
    written: dict[str, list[StageProgress]] = {"convert": [], "warm_cache": []}
    write = type(ctx.storage).write_bytes

    def spy(self, key, data):
        for stage, seen in written.items():
            if key == f"{ctx.run_key}/progress/{stage}.json":
                seen.append(StageProgress.model_validate_json(data))
        return write(self, key, data)

    monkeypatch.setattr(type(ctx.storage), "write_bytes", spy)
    run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)
    conv, warm = written["convert"], written["warm_cache"]
    assert (conv[0].done, conv[0].finished, conv[0].eta_seconds) == (0, False, None), conv[0]
    assert (conv[-1].done, conv[-1].total, conv[-1].finished, conv[-1].unit) == (1797, 1797, True, "rows")
    assert [p.what for p in warm] == ["cache phase first"] * (len(warm) - 2) + ["cache phase rest"] * 2
    assert all(p.unit == "bytes" and p.done <= p.total for p in warm)
    assert warm[-1].finished and warm[-1].done == warm[-1].total > 0
    assert ctx.storage.exists(f"{ctx.run_key}/progress/warm_cache.json")


@pytest.mark.integration
def test_converted_shards_are_readable_by_the_tfrecord_package(tmp_path, digits_raw):
    """Petastorm, TensorFlow and Spark read them in tests/test_readers.py, each in its own environment."""
    ctx = make_ctx(tmp_path, digits_raw)
    out = run_chain(ctx, validate, convert)["convert"]
    root = Path(ctx.storage.local_path(out.prefix))
    from sklearn.datasets import load_digits

    raw = {img.astype(np.float32).tobytes() for img in load_digits().images}
    from tfrecord.torch.dataset import TFRecordDataset

    ds = TFRecordDataset(str(root / "tfrecord/test/part-00000.tfrecord"), None, {"image": "byte", "label": "int"})
    first = next(iter(ds))
    # Raw float32 tensor bytes since format version 3 (a whole .npy file before): 64 floats, the input's.
    assert np.frombuffer(bytes(first["image"]), dtype="<f4").reshape(8, 8).shape == (8, 8)
    assert bytes(first["image"]) in raw


@pytest.mark.integration
def test_png_images_roundtrip_through_the_training_reader(tmp_path):
    from ballast.training.dataset.reader import load_split

    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(600, 64), dtype=np.uint8)
    labels = rng.integers(0, 10, size=600)
    raw = write_raw(tmp_path / "raw" / "part-0.parquet", images, labels, image_type=pa.list_(pa.uint8()))

    def edit(d):
        d["dataset"]["fields"][0] = {"name": "image", "type": "uint8", "shape": [8, 8]}
        d["validation"]["rules"] = [r for r in d["validation"]["rules"] if r["kind"] in ("in_set", "finite")]

    ctx = make_ctx(tmp_path, raw.parent, edit)
    assert ctx.spec.dataset.features[0].storage_codec == "png"
    out = run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)
    root = Path(ctx.storage.local_path(out["convert"].prefix))
    head = (root / "petastorm/train/part-00000.parquet").read_bytes()
    assert b"PNG" in head  # compressed images, not raw arrays
    known = {img.tobytes(): lab for img, lab in zip(images, labels)}
    test = load_split(Path(out["warm_cache"].cache_dir), "test", fmt="petastorm")
    assert all(known[x.astype(np.uint8).tobytes()] == y for x, y in zip(test.features, test.labels))


@pytest.mark.unit
def test_split_assignment_is_deterministic():
    ids = np.arange(10_000)
    a = split_codes(ids, validation=0.1, test=0.15, seed=7)
    b = split_codes(ids, validation=0.1, test=0.15, seed=7)
    c = split_codes(ids, validation=0.1, test=0.15, seed=8)
    assert (a == b).all() and not (a == c).all()
    assert abs((a == 2).mean() - 0.15) < 0.02 and abs((a == 1).mean() - 0.1) < 0.02
    # A row's split depends on its id alone, not on which batch it arrives in.
    assert (split_codes(ids[5000:], validation=0.1, test=0.15, seed=7) == a[5000:]).all()


@pytest.mark.integration
def test_convert_streams_in_bounded_batches_with_the_same_output(tmp_path, digits_raw):
    big = make_ctx(tmp_path / "a", digits_raw)
    small = make_ctx(tmp_path / "b", digits_raw, lambda d: d["conversion"].update(read_batch_rows=37))
    one = run_chain(big, validate, convert)["convert"]
    two = run_chain(small, validate, convert)["convert"]
    m1 = json.loads(big.storage.read_bytes(f"{one.prefix}/manifest.json"))
    m2 = json.loads(small.storage.read_bytes(f"{two.prefix}/manifest.json"))
    assert one.dataset_id == two.dataset_id
    assert [(f["path"], f["sha256"]) for f in m1["files"]] == [(f["path"], f["sha256"]) for f in m2["files"]]


@pytest.mark.integration
def test_warm_cache_stages_follow_the_training_read_order(tmp_path, digits_raw):
    from ballast.training.dataset.loader import EpochLoader

    ctx = make_ctx(tmp_path, digits_raw, lambda d: d["conversion"].update(shard_rows=100))
    out = run_chain(ctx, validate, convert, warm_cache)["warm_cache"]
    (first,) = out.phases
    assert first.name == "first_steps" and out.pending_phases == 1
    cache = Path(out.cache_dir)
    manifest = json.loads((cache / "manifest.json").read_text())
    have = {p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()}
    fmt_files = [f["path"] for f in manifest["files"] if f["format"] == "petastorm"]
    train = [f for f in fmt_files if "/train/" in f and f.endswith(".parquet")]
    later = {f for f in fmt_files if ("/test/" in f or "/validation/" in f) and f.endswith(".parquet")}
    assert not later & have  # validation and test come with the last phase
    assert 0 < len(set(train) & have) < len(train)
    # Every rank's first quarter of epoch 0 reads only files already cached.
    for rank in range(2):
        loader = EpochLoader(cache, fmt="petastorm", rank=rank, world=2, seed=0, workers=0)
        need, got = loader.samples_per_rank // 4, 0
        for b, rows in loader.spans(0):
            if got >= need:
                break
            assert loader.blocks[b].path in have
            got += len(rows)
    rest = warm_cache_rest.run(ctx)
    assert rest.phases[0].name == "rest"
    have = {p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()}
    assert set(fmt_files) <= have
    again = run_chain(ctx, warm_cache, warm_cache_rest)
    assert again["warm_cache"].phases[0].downloaded == 0 and again["warm_cache_rest"].phases[0].downloaded == 0
    # A damaged cached file is fetched again.
    victim = cache / train[0]
    victim.write_bytes(b"garbage")
    third = run_chain(ctx, warm_cache, warm_cache_rest)
    assert sum(p.downloaded for r in third.values() for p in r.phases) == 1


@pytest.mark.integration
def test_warm_cache_resumes_a_partial_download(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    conv = run_chain(ctx, validate, convert)["convert"]
    manifest = json.loads(ctx.storage.read_bytes(f"{conv.prefix}/manifest.json"))
    entry = next(f for f in manifest["files"] if f["path"].endswith(".parquet"))
    src = Path(ctx.storage.local_path(f"{conv.prefix}/{entry['path']}")).read_bytes()
    dst = tmp_path / "c" / "x.parquet"
    part = dst.with_name(".x.parquet.part")
    part.parent.mkdir(parents=True)
    part.write_bytes(src[:1000])  # an interrupted download
    got = warm_cache.fetch(ctx.storage, f"{conv.prefix}/{entry['path']}", dst, entry)
    assert got == len(src) - 1000 and dst.read_bytes() == src and not part.exists()
    part.write_bytes(b"X" * 1000)  # a part that is not a prefix of the object: refused, removed
    dst.unlink()  # (a verified file is not fetched again)
    with pytest.raises(DataError, match="size or sha256 differs"):
        warm_cache.fetch(ctx.storage, f"{conv.prefix}/{entry['path']}", tmp_path / "c" / "x.parquet", entry)
    assert not part.exists()


@pytest.mark.integration
def test_warm_cache_refuses_damaged_source_and_over_budget(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    conv = run_chain(ctx, validate, convert)["convert"]
    first = plan_phases(json.loads(ctx.storage.read_bytes(f"{conv.prefix}/manifest.json")), "petastorm",
                        [0.25, 1.0], world=2, seed=0)[0]
    victim = next(f["path"] for f in first if f["path"].endswith(".parquet"))
    shard = Path(ctx.storage.local_path(conv.prefix)) / victim
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"{victim}: size or sha256 differs from the dataset manifest"):
        warm_cache.run(ctx)
    assert not list(Path(ctx.cache_root).rglob(f"*{Path(victim).name}*"))  # nothing half-trusted
    small = make_ctx(tmp_path, digits_raw, lambda d: d["cache"].update(max_bytes=1000))
    small.save_result("convert", conv)
    with pytest.raises(StorageError, match=r"cache\.max_bytes: stage 'first_steps' needs \d+ more bytes"):
        warm_cache.run(small)


@pytest.mark.integration
def test_warm_cache_refuses_keys_escaping_the_cache(tmp_path, digits_raw):
    ctx = make_ctx(tmp_path, digits_raw)
    conv = run_chain(ctx, validate, convert)["convert"]
    key = f"{conv.prefix}/manifest.json"
    manifest = json.loads(ctx.storage.read_bytes(key))
    manifest["files"][0]["path"] = "../../../etc/evil"
    ctx.storage.write_bytes(key, json.dumps(manifest).encode())
    with pytest.raises(StorageError, match=r"object key '\.\./\.\./\.\./etc/evil' would escape its directory"):
        warm_cache.run(ctx)


@pytest.mark.unit
@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/../../b", ""])
def test_safe_key_refuses_escapes(key):
    with pytest.raises(StorageError):
        safe_key(key)


@pytest.mark.unit
def test_local_storage_roundtrip(tmp_path):
    s = FileStorage(tmp_path)
    s.write_bytes("a/b.txt", b"hi")
    assert s.read_bytes("a/b.txt") == b"hi" and list(s.list("a")) == ["a/b.txt"]
    assert not list(tmp_path.rglob("*.tmp"))
    with pytest.raises(StorageError, match="no such file"):
        s.read_bytes("a/missing")


@pytest.mark.integration
def test_training_is_ended_when_the_background_warm_up_fails(tmp_path):
    import logging
    import sys
    import time

    from ballast.launch import Launch, driver
    from ballast.launch.local import LocalBackend

    log = logging.getLogger("test")
    failed_at = time.monotonic() + 1.0
    t0 = time.monotonic()
    end = driver.run(LocalBackend(tmp_path, log), Launch(name="t", try_number=1, nodes=1,
                                                         command=(sys.executable, "-c", "import time; time.sleep(60)")),
                     tmp_path, log, hang_timeout=600,
                     should_stop=lambda: DataError("damaged shard") if time.monotonic() > failed_at else None)
    assert not end.hung and end.exit_code != 0 and time.monotonic() - t0 < 20


@pytest.mark.integration
def test_convert_refuses_raw_data_changed_after_validation(tmp_path):
    t = raw_table()
    raw = write_raw(tmp_path / "raw" / "part-0.parquet", t["images"], t["labels"])
    ctx = make_ctx(tmp_path, raw.parent)
    run_chain(ctx, validate)
    write_raw(raw.parent / "part-1.parquet", t["images"][:10], t["labels"][:10])  # lands after validation
    with pytest.raises(DataError, match=r"the raw data changed after validation \(2 file\(s\) now\)"):
        convert.run(ctx)
    assert not list((tmp_path / "storage").rglob("manifest.json"))


@pytest.mark.integration
def test_a_download_cut_mid_object_is_named_and_resumed(tmp_path, digits_raw):
    """A connection dropped mid-object: StorageError naming it, the .part kept, the next try resumes."""
    ctx = make_ctx(tmp_path, digits_raw)
    conv = run_chain(ctx, validate, convert)["convert"]
    manifest = json.loads(ctx.storage.read_bytes(f"{conv.prefix}/manifest.json"))
    entry = next(f for f in manifest["files"] if f["path"].endswith(".parquet"))
    key = f"{conv.prefix}/{entry['path']}"

    class Cut:
        def __init__(self, inner):
            self.inner, self.sent = inner, 0

        def read(self, n=-1):
            if self.sent >= 500:
                raise StorageError(f"{ctx.storage.describe(key)}: read failed: connection reset")
            block = self.inner.read(500)
            self.sent += len(block)
            return block

        def close(self):
            self.inner.close()

    class Flaky(FileStorage):
        def open_read(self, k, start=0):
            return Cut(super().open_read(k, start))

    flaky = Flaky(ctx.storage.root)
    dst = tmp_path / "c" / "x.parquet"
    with pytest.raises(StorageError, match=rf"{entry['path']}: read failed: connection reset"):
        warm_cache.fetch(flaky, key, dst, entry)
    assert dst.with_name(".x.parquet.part").stat().st_size == 500 and not dst.exists()
    assert warm_cache.fetch(ctx.storage, key, dst, entry) == entry["bytes"] - 500
    assert warm_cache.verified(dst, entry)
