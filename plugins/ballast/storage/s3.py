"""S3 or any S3-compatible endpoint as the pipeline's storage (`ballast.storage.S3Storage`, loaded on
first use: boto3 is imported only when a client is made).
"""

from __future__ import annotations

import heapq
import os
from pathlib import Path
from typing import BinaryIO, Iterator

from ballast.errors import StorageError
from ballast.storage.base import Storage, is_listed, limited, listing_prefix, safe_key


_MIN_PART = 5 << 20  # S3's least size of a multipart upload's part (all but the last)
_MAX_PART = 5 << 30  # and its most


class S3Storage(Storage):
    """S3 or any S3-compatible endpoint, through boto3 (imported only when used)."""

    page_size = 1000  # keys a listing asks for at a time (S3's most)

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

    def append(self, local: Path, key: str, stored: int) -> int:
        """Make the object `key` the whole local file `local`, which has only grown since its first
        `stored` bytes were stored there (an append-only log): the new bytes are sent, the stored ones
        copied within S3 (a multipart upload whose first parts are UploadPartCopy ranges of the object
        itself). Below S3's 5 MiB least part, or when the object is not `stored` bytes long, the file is
        uploaded whole. The size now stored."""
        local = Path(local)
        size = local.stat().st_size
        if size == stored and stored:
            return size
        if stored < _MIN_PART or size < stored or not self._has_size(key, stored):
            self.upload(local, key)
            return size
        k = self._key(key)
        mpu = self._call("append", key, self.client.create_multipart_upload, Bucket=self.bucket, Key=k)
        parts = []
        try:
            for start in range(0, stored, _MAX_PART):  # the stored bytes, copied by S3 from the object itself
                end = min(start + _MAX_PART, stored) - 1
                r = self._call("append", key, self.client.upload_part_copy, Bucket=self.bucket, Key=k,
                               UploadId=mpu["UploadId"], PartNumber=len(parts) + 1,
                               CopySource={"Bucket": self.bucket, "Key": k}, CopySourceRange=f"bytes={start}-{end}")
                parts.append({"ETag": r["CopyPartResult"]["ETag"], "PartNumber": len(parts) + 1})
            with open(local, "rb") as fh:  # then what is new, read from where the stored bytes end
                fh.seek(stored)
                while chunk := fh.read(min(_MAX_PART, size - fh.tell())):
                    r = self._call("append", key, self.client.upload_part, Bucket=self.bucket, Key=k,
                                   UploadId=mpu["UploadId"], PartNumber=len(parts) + 1, Body=chunk)
                    parts.append({"ETag": r["ETag"], "PartNumber": len(parts) + 1})
                    if fh.tell() >= size:
                        break
            self._call("append", key, self.client.complete_multipart_upload, Bucket=self.bucket, Key=k,
                       UploadId=mpu["UploadId"], MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=mpu["UploadId"])
            except Exception:  # noqa: BLE001 - the append's own error is the one to report
                pass
            raise
        return size

    def _has_size(self, key: str, size: int) -> bool:
        try:
            return self.size(key) == size
        except StorageError:
            return False

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

    def delete(self, key: str) -> None:
        self._call("delete", key, self.client.delete_object, Bucket=self.bucket, Key=self._key(key))

    def list(self, directory: str, *, name_prefix: str = "", limit: int | None = None) -> Iterator[str]:
        d = listing_prefix(directory, name_prefix, limit)
        return limited(self._list(d, name_prefix, limit, delimiter=False), limit)

    def list_dir(self, directory: str, *, name_prefix: str = "", limit: int | None = None) -> Iterator[str]:
        d = listing_prefix(directory, name_prefix, limit)
        return limited(self._list(d, name_prefix, limit, delimiter=True), limit)

    def _list(self, d: str, name_prefix: str, limit: int | None, *, delimiter: bool) -> Iterator[str]:
        """Keys under directory `d` (with `delimiter`: names of its entries), one page at a time."""
        from botocore.exceptions import BotoCoreError, ClientError

        root = f"{self.prefix}/{d}" if self.prefix else d  # the directory, its '/' included
        strip = len(root) if delimiter else len(root) - len(d)
        size = min(self.page_size, limit or self.page_size, 1000) or 1
        kwargs = {"Bucket": self.bucket, "Prefix": root + name_prefix, "PaginationConfig": {"PageSize": size}}
        pages = iter(self.client.get_paginator("list_objects_v2").paginate(
            **kwargs, **({"Delimiter": "/"} if delimiter else {})))
        while True:
            try:
                page = next(pages, None)
            except (ClientError, BotoCoreError) as exc:
                raise self._error("list", d, exc) from exc
            if page is None:
                return
            keys = (o["Key"] for o in page.get("Contents", []))
            dirs = (p["Prefix"] for p in page.get("CommonPrefixes", []))
            for key in heapq.merge(keys, dirs):  # a page is one range of keys: each part is in key order
                rel = key[len(root):]
                if is_listed(rel.rstrip("/") if delimiter else rel):
                    yield key[strip:]


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
