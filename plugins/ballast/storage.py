"""One interface over the pipeline's storage: a local directory or an S3 prefix.

Keys are relative POSIX paths. A key that would escape the root (`..`, an absolute path) is refused.
Writes are never visible half-done: local files are written under a temporary name and renamed; S3
objects only appear once their (multipart) upload completes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterator

from ballast.errors import StorageError
from training.checkpoint import sha256_file  # noqa: F401  (one implementation, re-exported for the stages)


def safe_key(key: str) -> str:
    """Normalise a key and refuse one that escapes its root."""
    if not key or "\x00" in key:
        raise StorageError(f"invalid object key {key!r}")
    p = PurePosixPath(key.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts:
        raise StorageError(f"object key {key!r} would escape its directory (absolute or '..'); refused")
    return str(p)


def safe_join(root: Path, key: str) -> Path:
    return root / safe_key(key)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Storage:
    """Abstract storage. `uri` is how a person would name it in a message."""

    uri: str

    def exists(self, key: str) -> bool: ...
    def read_bytes(self, key: str) -> bytes: ...
    def write_bytes(self, key: str, data: bytes) -> None: ...
    def upload(self, local: Path, key: str) -> None: ...
    def download(self, key: str, local: Path) -> None: ...
    def size(self, key: str) -> int: ...
    def list(self, prefix: str) -> Iterator[str]: ...
    def open_read(self, key: str, start: int = 0) -> BinaryIO:
        """A stream of the object's bytes from offset `start` (for resuming a partial download)."""
        raise NotImplementedError

    def local_path(self, key: str) -> Path | None:
        """The file's path when storage is a local directory (lets training write in place)."""
        return None

    def describe(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{safe_key(key)}"


class LocalStorage(Storage):
    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        return safe_join(self.root, key)

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def read_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise StorageError(f"{self.describe(key)}: no such file") from exc

    def write_bytes(self, key: str, data: bytes) -> None:
        atomic_write_bytes(self._path(key), data)

    def upload(self, local: Path, key: str) -> None:
        dst = self._path(key)
        if Path(local).resolve() != dst:
            atomic_copy(Path(local), dst)

    def download(self, key: str, local: Path) -> None:
        src = self._path(key)
        if not src.exists():
            raise StorageError(f"{self.describe(key)}: no such file")
        atomic_copy(src, Path(local))

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def open_read(self, key: str, start: int = 0) -> BinaryIO:
        try:
            fh = open(self._path(key), "rb")
        except FileNotFoundError as exc:
            raise StorageError(f"{self.describe(key)}: no such file") from exc
        fh.seek(start)
        return fh

    def list(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.exists():
            return
        for p in sorted(base.rglob("*")):
            if p.is_file() and not p.name.startswith("."):
                yield p.relative_to(self.root).as_posix()


class S3Storage(Storage):
    """S3 or any S3-compatible endpoint, through boto3 (imported only when used)."""

    def __init__(self, uri: str, *, conn_id: str | None = None, retry_mode: str = "adaptive", max_attempts: int = 8,
                 multipart_chunk_mb: int = 16, transfer_concurrency: int = 8):
        self.retry_mode, self.max_attempts = retry_mode, max_attempts
        self.chunk = multipart_chunk_mb * 1024 * 1024
        self.transfer_concurrency = transfer_concurrency
        rest = uri[len("s3://"):]
        self.bucket, _, prefix = rest.partition("/")
        self.prefix = prefix.strip("/")
        self.uri = uri.rstrip("/")
        self.conn_id = conn_id
        self._client = None

    def _key(self, key: str) -> str:
        key = safe_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            kwargs = _s3_connection_kwargs(self.conn_id)
            self._client = boto3.client(
                "s3", config=Config(retries={"mode": self.retry_mode, "max_attempts": self.max_attempts},
                                    max_pool_connections=max(10, 2 * self.transfer_concurrency)), **kwargs)
        return self._client

    @property
    def transfer(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.chunk, multipart_chunksize=self.chunk,
                              max_concurrency=self.transfer_concurrency)

    def _error(self, what: str, key: str, exc: Exception) -> StorageError:
        code = (getattr(exc, "response", None) or {}).get("Error", {}).get("Code", "")
        hint = {"NoSuchBucket": f"bucket {self.bucket!r} does not exist",
                "404": "no such object", "NoSuchKey": "no such object", "NotFound": "no such object",
                "InvalidAccessKeyId": "credentials refused", "SignatureDoesNotMatch": "credentials refused",
                "AccessDenied": "access denied", "403": "access denied"}.get(code, code or str(exc))
        return StorageError(f"{self.describe(key)}: {what} failed: {hint}")

    def _call(self, what: str, key: str, fn, *args, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(what, key, exc) from exc

    def exists(self, key: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._error("head", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("head", key, exc) from exc

    def read_bytes(self, key: str) -> bytes:
        resp = self._call("read", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
        return resp["Body"].read()

    def write_bytes(self, key: str, data: bytes) -> None:
        self._call("write", key, self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data)

    def upload(self, local: Path, key: str) -> None:
        # Multipart above the chunk size; S3 shows the object only once the upload completes.
        self._call("upload", key, self.client.upload_file, str(local), self.bucket, self._key(key),
                   Config=self.transfer)

    def download(self, key: str, local: Path) -> None:
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.part")
        try:
            self._call("download", key, self.client.download_file, self.bucket, self._key(key), str(tmp),
                       Config=self.transfer)
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def open_read(self, key: str, start: int = 0) -> BinaryIO:
        extra = {"Range": f"bytes={start}-"} if start else {}
        body = self._call("read", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key), **extra)["Body"]
        return _Stream(body, lambda exc: self._error(f"read from byte {start}", key, exc))

    def size(self, key: str) -> int:
        return int(self._call("head", key, self.client.head_object, Bucket=self.bucket,
                              Key=self._key(key))["ContentLength"])

    def list(self, prefix: str) -> Iterator[str]:
        full = self._key(prefix) if prefix else self.prefix
        paginator = self.client.get_paginator("list_objects_v2")
        pages = self._call("list", prefix, lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=full)))
        strip = len(self.prefix) + 1 if self.prefix else 0
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"][strip:]


class _Stream:
    """An object body whose read errors (timeouts, connections dropped mid-object) are StorageErrors."""

    def __init__(self, body, error):
        self.body, self.error = body, error

    def read(self, n: int = -1) -> bytes:
        from botocore.exceptions import BotoCoreError

        try:
            return self.body.read(n)
        except BotoCoreError as exc:
            raise self.error(exc) from exc

    def close(self) -> None:
        self.body.close()

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _s3_connection_kwargs(conn_id: str | None) -> dict:
    """Endpoint and credentials from an Airflow connection, else boto3's standard environment chain."""
    if not conn_id:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return {"endpoint_url": endpoint} if endpoint else {}
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(conn_id)
    extra = conn.extra_dejson or {}
    kwargs = {
        "aws_access_key_id": conn.login or extra.get("aws_access_key_id"),
        "aws_secret_access_key": conn.password or extra.get("aws_secret_access_key"),
        "region_name": extra.get("region_name"),
        "endpoint_url": extra.get("endpoint_url") or (conn.host or None),
    }
    return {k: v for k, v in kwargs.items() if v}


def ballast_home() -> Path:
    """Root of everything Ballast keeps on this machine: BALLAST_HOME, else ~/.ballast."""
    return Path(os.environ.get("BALLAST_HOME") or Path.home() / ".ballast").resolve()


def resolve_local(location: str) -> Path:
    p = Path(location).expanduser()
    return p if p.is_absolute() else ballast_home() / p


def open_storage(uri: str, conn_id: str | None = None, **s3_options) -> Storage:
    """The storage a spec names; s3_options: retry_mode, max_attempts, multipart_chunk_mb, transfer_concurrency."""
    if uri.startswith("s3://"):
        return S3Storage(uri, conn_id=conn_id, **s3_options)
    return LocalStorage(resolve_local(uri))
