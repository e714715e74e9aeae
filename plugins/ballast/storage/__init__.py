"""The pipeline's storage: a local directory (`FileStorage`) or an S3 prefix (`ballast.storage.s3`,
imported when a URI names S3), chosen by `open_storage`. The interface and its key and listing rules
are `ballast.storage.base`, which both backends build on.

Keys are relative POSIX paths. A key that would escape the root (`..`, an absolute path) is refused.
Writes are never visible half-done: local files are written under a temporary name and renamed; S3
objects only appear once their (multipart) upload completes.

Listings name a directory, with or without its final '/': `raw/digits` is `raw/digits/` and never
reaches `raw/digits_old/`. Both backends answer a listing alike: keys in S3's order (of the key
strings), names starting with '.' left out (a local write in progress), read lazily (S3 a page at a
time), with an optional `limit` and an explicit `name_prefix` for a partial name inside the directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

from ballast.errors import StorageError
# The interface and its key rules, re-exported: callers name them from here.
from ballast.storage.base import Storage, as_directory, is_listed, limited, listing_prefix, safe_key  # noqa: F401
from ballast.training.checkpoint import sha256_file  # noqa: F401  (one implementation, re-exported for the stages)


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


class FileStorage(Storage):
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
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError as exc:
            raise StorageError(f"{self.describe(key)}: no such file") from exc

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        for parent in path.parents:  # no empty directory left behind: it would list as a run or a checkpoint
            if parent == self.root or self.root not in parent.parents:
                break
            try:
                parent.rmdir()
            except OSError:
                break

    def open_read(self, key: str, start: int = 0) -> BinaryIO:
        try:
            fh = open(self._path(key), "rb")
        except FileNotFoundError as exc:
            raise StorageError(f"{self.describe(key)}: no such file") from exc
        fh.seek(start)
        return fh

    def list(self, directory: str, *, name_prefix: str = "", limit: int | None = None) -> Iterator[str]:
        d = listing_prefix(directory, name_prefix, limit)
        return limited(self._walk(d, name_prefix), limit)

    def list_dir(self, directory: str, *, name_prefix: str = "", limit: int | None = None) -> Iterator[str]:
        d = listing_prefix(directory, name_prefix, limit)
        return limited((name for name, _ in self._entries(d, name_prefix)), limit)

    def _walk(self, d: str, name_prefix: str = "") -> Iterator[str]:
        for name, _ in self._entries(d, name_prefix):
            if name.endswith("/"):
                yield from self._walk(d + name)
            else:
                yield d + name

    def _entries(self, d: str, name_prefix: str) -> list[tuple[str, os.DirEntry]]:
        """(name, entry) of a directory's files and subdirectories (`name/`), sorted as S3 sorts keys
        (`a-c` before `a/b`); symbolic links to directories are not followed."""
        try:
            with os.scandir(self._path(d) if d else self.root) as it:
                found = [(e.name + "/" if e.is_dir(follow_symlinks=False) else e.name, e) for e in it
                         if not e.name.startswith(".") and e.name.startswith(name_prefix)
                         and (e.is_dir(follow_symlinks=False) or e.is_file())]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise StorageError(f"{self.describe(d)}: list failed: {exc}") from exc
        return sorted(found, key=lambda item: item[0])


def ballast_home() -> Path:
    """Root of everything Ballast keeps on this machine: BALLAST_HOME, else ~/.ballast."""
    return Path(os.environ.get("BALLAST_HOME") or Path.home() / ".ballast").resolve()


def resolve_local(location: str) -> Path:
    p = Path(location).expanduser()
    return p if p.is_absolute() else ballast_home() / p


def open_storage(uri: str, conn_id: str | None = None, **s3_options) -> Storage:
    """The storage a spec names; s3_options: retry_mode, max_attempts, multipart_chunk_mb, transfer_concurrency."""
    if uri.startswith("s3://"):
        from ballast.storage.s3 import S3Storage

        return S3Storage(uri, conn_id=conn_id, **s3_options)
    return FileStorage(resolve_local(uri))


def __getattr__(name: str):
    """`S3Storage` (and its `_Stream`) live in ballast.storage.s3, imported when first named here."""
    if name in ("S3Storage", "_Stream"):
        from ballast.storage import s3 as storage_s3

        return getattr(storage_s3, name)
    raise AttributeError(f"module 'ballast.storage' has no attribute {name!r}")
