"""Storage listings name directories, on local storage and on S3 alike (issue 21, item 6): a prefix never
reaches a sibling that merely starts with the same letters, partial names are asked for explicitly, and
S3's listing is read page by page, only as far as the caller reads it."""

from __future__ import annotations

import uuid

import pytest
from test_storage_s3 import bucket, s3_endpoint, s3_env  # noqa: F401  (moto's server on loopback)

from ballast.errors import StorageError
from ballast.storage import FileStorage, S3Storage, Storage

BACKENDS = [pytest.param("local", marks=pytest.mark.unit), pytest.param("s3", marks=pytest.mark.integration)]


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> Storage:
    if request.param == "local":
        return FileStorage(tmp_path / "store")
    return S3Storage(f"s3://{request.getfixturevalue('bucket')}/{uuid.uuid4().hex}")  # the bucket outlives a test


def put(store: Storage, *keys: str) -> None:
    for key in keys:
        store.write_bytes(key, key.encode())


@pytest.mark.parametrize("directory", ["raw/digits", "raw/digits/"])
def test_a_directory_never_lists_a_sibling_that_starts_with_its_name(store, directory):
    put(store, "raw/digits/a.parquet", "raw/digits/sub/b.parquet", "raw/digits_old/c.parquet", "raw/digitsx")
    assert list(store.list(directory)) == ["raw/digits/a.parquet", "raw/digits/sub/b.parquet"]
    assert list(store.list_dir(directory)) == ["a.parquet", "sub/"]


def test_a_pipelines_runs_are_not_another_pipelines_whose_name_it_starts(store):
    put(store, "runs/ballast_a/r1/spec.json", "runs/ballast_a_b/r2/spec.json", "runs/ballast_a_b/r3/spec.json")
    assert list(store.list("runs/ballast_a/")) == ["runs/ballast_a/r1/spec.json"]
    assert list(store.list_dir("runs/ballast_a/")) == ["r1/"]
    assert list(store.list_dir("runs/")) == ["ballast_a/", "ballast_a_b/"]


def test_run_r1_does_not_exist_because_r10_does(store):
    put(store, "runs/d/r10/spec.json")
    assert list(store.list("runs/d/r1/", limit=1)) == [] and list(store.list("runs/d/r1", limit=1)) == []
    assert list(store.list("runs/d/r10/", limit=1)) == ["runs/d/r10/spec.json"]


def test_a_partial_name_is_asked_for_and_answered_alike(store):
    """The view finds a rounds pipeline's records by name (`stages/round_<k>.<stage>.json`)."""
    put(store, "r/stages/round_1.train.json", "r/stages/round_2.train.json", "r/stages/train.json",
        "r/stages_old/round_9.train.json", "r/stages/round_x/y.json")
    want = ["r/stages/round_1.train.json", "r/stages/round_2.train.json", "r/stages/round_x/y.json"]
    assert list(store.list("r/stages/", name_prefix="round_")) == want
    assert list(store.list_dir("r/stages", name_prefix="round_")) == ["round_1.train.json", "round_2.train.json",
                                                                     "round_x/"]
    with pytest.raises(StorageError, match=r"name_prefix 'round_/x': a name, not a path"):
        store.list("r/stages/", name_prefix="round_/x")


def test_keys_come_in_the_same_order_and_limit_on_both_backends(store):
    """Key order (S3's): `a-c` before `a/b`; a name starting with '.' (a write in progress on local
    storage) is no key on either."""
    put(store, "d/a/b", "d/a-c", "d/b", "d/a/.part", "d/.hidden/x", *(f"d/n/{i:02d}" for i in range(12)))
    assert list(store.list("d")) == ["d/a-c", "d/a/b", "d/b", *(f"d/n/{i:02d}" for i in range(12))]
    assert list(store.list("d/", limit=4)) == ["d/a-c", "d/a/b", "d/b", "d/n/00"]
    assert list(store.list_dir("d/", limit=2)) == ["a-c", "a/"]
    assert list(store.list("")) == list(store.list("d/"))
    assert list(store.list("nothing/here/")) == []
    with pytest.raises(StorageError, match="limit"):
        store.list("d/", limit=-1)


def test_a_stored_directory_can_be_emptied_key_by_key(store):
    put(store, "c/step-1/a", "c/step-1/b")
    for key in list(store.list("c/step-1/")):
        store.delete(key)
    store.delete("c/step-1/never-was")  # deleting what is not there is no error
    assert list(store.list("c/")) == [] and list(store.list_dir("")) == []


@pytest.mark.integration
def test_s3_listing_reads_pages_only_as_far_as_the_caller(bucket):  # noqa: F811
    store = S3Storage(f"s3://{bucket}/{uuid.uuid4().hex}")
    put(store, *(f"k/{i:02d}" for i in range(25)))
    calls = []
    store.client.meta.events.register("provide-client-params.s3.ListObjectsV2",
                                      lambda params, **_: calls.append(dict(params)))
    store.page_size = 4
    keys = store.list("k/")
    first = [next(keys) for _ in range(5)]
    assert first == [f"k/{i:02d}" for i in range(5)] and len(calls) == 2  # two pages of four, no more
    assert len(first) + len(list(keys)) == 25 and len(calls) == 7
    calls.clear()
    assert list(store.list("k/", limit=3)) == ["k/00", "k/01", "k/02"]
    assert len(calls) == 1 and calls[0]["MaxKeys"] == 3


@pytest.mark.integration
def test_a_dataset_on_s3_is_its_directory_not_its_siblings(bucket, tmp_path, digits_raw):  # noqa: F811
    """`dataset.location: s3://b/raw/digits` beside `raw/digits_old/`: validate reads digits only."""
    from ballast.data.raw import raw_files
    from helpers import make_ctx

    top = uuid.uuid4().hex
    outside = S3Storage(f"s3://{bucket}/{top}")
    for p in sorted(digits_raw.rglob("*.parquet")):
        outside.upload(p, f"raw/digits/{p.name}")
    outside.write_bytes("raw/digits_old/broken.parquet", b"not parquet")
    ctx = make_ctx(tmp_path, digits_raw, lambda d: d["dataset"].update(location=f"s3://{bucket}/{top}/raw/digits"))
    files = raw_files(ctx)
    assert sorted(p.name for p in files) == sorted(p.name for p in digits_raw.rglob("*.parquet"))
