"""S3 storage against a real S3 server over HTTP on loopback (moto's ThreadedMotoServer)."""

from __future__ import annotations

import socket

import pytest

from ballast.errors import StorageError
from ballast.storage import S3Storage, open_storage


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3_endpoint


@pytest.fixture
def bucket(s3_env):
    import boto3

    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket="ballast-test")
    return "ballast-test"


def test_roundtrip_through_s3(bucket, tmp_path):
    store = open_storage(f"s3://{bucket}/pipelines")
    assert isinstance(store, S3Storage)
    store.write_bytes("runs/a/spec.json", b"{}")
    local = tmp_path / "big.bin"
    local.write_bytes(b"x" * (9 << 20))  # above boto3's multipart threshold
    store.upload(local, "datasets/big.bin")
    assert store.exists("datasets/big.bin") and not store.exists("datasets/missing.bin")
    assert store.size("datasets/big.bin") == 9 << 20
    assert sorted(store.list("")) == ["datasets/big.bin", "runs/a/spec.json"]
    out = tmp_path / "back" / "big.bin"
    store.download("datasets/big.bin", out)
    assert out.read_bytes() == local.read_bytes()
    assert store.describe("runs/a/spec.json") == f"s3://{bucket}/pipelines/runs/a/spec.json"


def test_missing_bucket_is_named(s3_env):
    store = open_storage("s3://no-such-bucket-here/x")
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-here/x/a\.json: write failed: bucket 'no-such-bucket-here' does not exist"):
        store.write_bytes("a.json", b"{}")


def test_missing_object_leaves_no_partial_file(bucket, tmp_path):
    store = open_storage(f"s3://{bucket}")
    with pytest.raises(StorageError, match=r"nothing\.bin: download failed"):
        store.download("nothing.bin", tmp_path / "nothing.bin")
    assert list(tmp_path.iterdir()) == []


def test_keys_cannot_escape_the_prefix(bucket):
    store = open_storage(f"s3://{bucket}/p")
    with pytest.raises(StorageError, match="would escape its directory"):
        store.write_bytes("../other/x", b"")


def test_committed_checkpoints_upload_marker_last(bucket, tmp_path):
    import torch

    from ballast.context import RunContext
    from ballast.spec import parse_spec
    from ballast.stages.train import upload_checkpoints
    from conftest import example_data
    from training import checkpoint as ckpt

    for step in (10, 20):
        w = ckpt.Writer(tmp_path, step, rank=0, barrier=lambda: None)
        w.begin()
        w.write_tensors("model.pt", {"w": torch.ones(4) * step})
        w.commit()
    (tmp_path / ".step-00000030.tmp").mkdir()  # an unfinished save is not uploaded
    d = example_data()
    d["storage"]["uri"] = f"s3://{bucket}/store"
    ctx = RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id="r1")
    uploaded = upload_checkpoints(ctx, tmp_path)
    assert uploaded == [f"s3://{bucket}/store/runs/ballast_digits/r1/checkpoints/step-000000{n}0" for n in (1, 2)]
    keys = sorted(ctx.storage.list("runs/ballast_digits/r1/checkpoints"))
    assert len(keys) == 6 and not any("30" in k for k in keys)
    assert upload_checkpoints(ctx, tmp_path) == []  # already there
