"""S3 storage against a real S3 server over HTTP on loopback (moto's ThreadedMotoServer)."""

from __future__ import annotations

import socket

import pytest

from ballast.errors import StorageError
from ballast.storage import S3Storage, open_storage

pytestmark = pytest.mark.integration  # a real S3 server over HTTP


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

    from ballast.pipeline.context import RunContext
    from ballast.spec import parse_spec
    from ballast.stages.train_try import upload_checkpoints
    from helpers import example_data
    from ballast.training import checkpoint as ckpt

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


def test_data_plane_through_s3(bucket, tmp_path, digits_raw):
    """validate -> convert -> staged warm-up with the pipeline's storage on S3: shards uploaded, the
    cache filled from S3 with ranged GETs, a partial download resumed, a damaged object refused."""
    import json

    from ballast.errors import DataError
    from ballast.stages import convert, validate, warm_cache
    from helpers import make_ctx, run_chain, warm_cache_rest

    ctx = make_ctx(tmp_path, digits_raw, lambda d: d["storage"].update(uri=f"s3://{bucket}/pipes", max_attempts=2))
    out = run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)
    prefix = out["convert"].prefix
    manifest = json.loads(ctx.storage.read_bytes(f"{prefix}/manifest.json"))
    assert all(ctx.storage.exists(f"{prefix}/{f['path']}") for f in manifest["files"])
    cache = tmp_path / "cache" / "digits" / out["convert"].dataset_id
    entry = next(f for f in manifest["files"] if f["path"].endswith(".parquet") and f["split"] == "train")
    dst = cache / entry["path"]
    original = dst.read_bytes()
    dst.unlink()
    part = dst.with_name(f".{dst.name}.part")
    part.write_bytes(original[:777])  # an interrupted download
    got = warm_cache.fetch(ctx.storage, f"{prefix}/{entry['path']}", dst, entry)
    assert got == len(original) - 777 and dst.read_bytes() == original
    # An object changed behind the manifest's back is refused, naming it; nothing is left in the cache.
    ctx.storage.write_bytes(f"{prefix}/{entry['path']}", original[:-10] + b"0123456789")
    dst.unlink()
    with pytest.raises(DataError, match=rf"s3://{bucket}/pipes/{prefix}/{entry['path']}: size or sha256 differs"):
        warm_cache.fetch(ctx.storage, f"{prefix}/{entry['path']}", dst, entry)
    assert not dst.exists() and not part.exists()


def test_refused_credentials_are_named(tmp_path, monkeypatch):
    """A real S3 server (moto_server with authentication on) refusing unknown keys."""
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0", "PATH": "/usr/bin:/bin"}
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret-key")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        store = open_storage("s3://some-bucket/p", max_attempts=1)
        with pytest.raises(StorageError, match=r"s3://some-bucket/p/a\.json: write failed: credentials refused") as err:
            store.write_bytes("a.json", b"{}")
        assert "not-a-real-secret-key" not in str(err.value)
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_endpoint_and_credentials_from_an_airflow_connection(s3_endpoint, monkeypatch, tmp_path):
    """storage.conn_id: endpoint, keys and region from an Airflow connection (here from the environment's
    AIRFLOW_CONN_* secrets backend), not from the AWS environment."""
    import json

    import boto3

    for key in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_BALLAST_S3", json.dumps({
        "conn_type": "aws", "login": "conn-key", "password": "conn-secret",
        "extra": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"}}))
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                 region_name="us-east-1").create_bucket(Bucket="from-conn")
    store = open_storage("s3://from-conn/p", conn_id="ballast_s3")
    store.write_bytes("a.txt", b"hello")
    assert store.read_bytes("a.txt") == b"hello"


def test_errors_while_streaming_an_object_are_storage_errors(bucket):
    from botocore.exceptions import ResponseStreamingError

    from ballast.storage import _Stream

    class Body:
        def read(self, n=-1):
            raise ResponseStreamingError(error="connection reset by peer")

        def close(self):
            pass

    store = open_storage(f"s3://{bucket}/p")
    stream = _Stream(Body(), lambda exc: store._error("read from byte 0", "a.bin", exc))
    with pytest.raises(StorageError, match=rf"s3://{bucket}/p/a\.bin: read from byte 0 failed"):
        stream.read(10)


def test_training_progress_reaches_s3_while_a_try_runs_and_when_it_ends(bucket, tmp_path):
    """With S3 storage the trainers write their event log and heartbeat on the worker: they are copied
    to the run's prefix while the try trains and once more at its end, where the stability view reads."""
    import logging
    import time

    from ballast.pipeline.context import RunContext
    from ballast.storage.outputs import OutputsUpload
    from ballast.spec import parse_spec
    from ballast.ui.summary import run_summary
    from helpers import example_data

    d = example_data()
    d["storage"]["uri"] = f"s3://{bucket}/store"
    ctx = RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id="r2")
    ctx.log = logging.getLogger("test")
    out = tmp_path / "train"
    out.mkdir()
    (out / "heartbeat").write_text("10 1000.0\n")
    (out / "metrics.jsonl").write_text('{"event": "step", "step": 10, "time": 1000.0, "rank": 0, "loss": 1.5}\n')
    up = OutputsUpload(ctx, out, interval=0.2)
    up.start()
    deadline = time.monotonic() + 20
    while not ctx.storage.exists("runs/ballast_digits/r2/train/heartbeat"):
        assert time.monotonic() < deadline, "no progress copied while the try ran"
        time.sleep(0.1)
    with (out / "metrics.jsonl").open("a") as fh:
        fh.write('{"event": "step", "step": 20, "time": 1010.0, "rank": 0, "loss": 0.5}\n')
    up.finish()
    view = run_summary(ctx.storage, "ballast_digits", "r2", now=1020.0)
    assert view["curves"]["step"] == [10, 20], view["records"]
    assert view["progress"]["step"] == 10


def test_a_growing_log_is_appended_sending_only_its_new_bytes(bucket, tmp_path):
    """S3Storage.append: past S3's 5 MiB least part, the stored bytes are copied within S3 and only what
    the file grew by is sent; the object is the whole file after each append. Smaller, or when the
    object is not what was stored, the file goes whole."""
    store = open_storage(f"s3://{bucket}/logs")
    sent: list[int] = []
    real_part, real_upload = store.client.upload_part, store.client.upload_file
    store.client.upload_part = lambda **kw: (sent.append(len(kw["Body"])), real_part(**kw))[1]
    store.client.upload_file = lambda path, *a, **kw: (sent.append(-(tmp_path / path).stat().st_size),
                                                       real_upload(path, *a, **kw))[1]
    log = tmp_path / "metrics.jsonl"
    line = b'{"event": "step", "step": 10, "loss": 1.0}\n'
    log.write_bytes(line * 1000)
    stored = store.append(log, "run/metrics.jsonl", 0)  # small: whole
    assert stored == log.stat().st_size and sent == [-stored]
    log.write_bytes(line * ((6 << 20) // len(line) + 1))
    stored = store.append(log, "run/metrics.jsonl", stored)  # past 5 MiB, but first time this size: whole
    assert sent[-1] == -stored and store.read_bytes("run/metrics.jsonl") == log.read_bytes()
    sent.clear()
    for k in range(3):  # each append sends what is new, nothing else
        with log.open("ab") as fh:
            fh.write(line * (k + 1))
        before, stored = stored, store.append(log, "run/metrics.jsonl", stored)
        assert sent == [stored - before] and store.read_bytes("run/metrics.jsonl") == log.read_bytes()
        sent.clear()
    assert store.append(log, "run/metrics.jsonl", stored) == stored and sent == []  # unchanged: nothing
    store.write_bytes("run/metrics.jsonl", b"replaced")  # not what this process stored: the file whole
    with log.open("ab") as fh:
        fh.write(line)
    stored = store.append(log, "run/metrics.jsonl", stored)
    assert sent == [-stored] and store.read_bytes("run/metrics.jsonl") == log.read_bytes()
