"""What a storage is, whatever its backend: the interface (`Storage`), and the rules every backend keeps
for keys (a relative POSIX path that cannot escape its root) and listings (a directory, read lazily, in
key order, dot-names left out). `ballast.storage` (local directories, the choice of backend by URI) and
`ballast.storage.s3` build on it; neither needs the other to.
"""

from __future__ import annotations

import itertools
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterable, Iterator

from ballast.errors import StorageError


def safe_key(key: str) -> str:
    """Normalise a key and refuse one that escapes its root."""
    if not key or "\x00" in key:
        raise StorageError(f"invalid object key {key!r}")
    p = PurePosixPath(key.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts:
        raise StorageError(f"object key {key!r} would escape its directory (absolute or '..'); refused")
    return str(p)


def as_directory(directory: str) -> str:
    """A listing's directory as a key prefix: "" for the root, else the safe key with one final '/'."""
    return "" if directory.strip("/") == "" else safe_key(directory) + "/"


def listing_prefix(directory: str, name_prefix: str, limit: int | None) -> str:
    """Check a listing's arguments; the directory as a key prefix."""
    if "/" in name_prefix or "\\" in name_prefix or "\x00" in name_prefix:
        raise StorageError(f"list {directory!r}: name_prefix {name_prefix!r}: a name, not a path; list the"
                           f" directory it is in")
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise StorageError(f"list {directory!r}: limit must be a whole number >= 0 (got {limit!r})")
    return as_directory(directory)


def is_listed(rel: str) -> bool:
    """Whether a key relative to a listed directory is one both backends list: a file (no final '/'),
    no name starting with '.', and a key this interface can address as it is."""
    parts = rel.split("/")
    return bool(rel) and all(parts) and not any(p.startswith(".") or p == ".." for p in parts)


def limited(items: Iterable[str], limit: int | None) -> Iterator[str]:
    return iter(items) if limit is None else itertools.islice(items, limit)



class Storage:
    """Abstract storage. `uri` is how a person would name it in a message."""

    uri: str

    def exists(self, key: str) -> bool: ...
    def read_bytes(self, key: str) -> bytes: ...
    def write_bytes(self, key: str, data: bytes) -> None: ...
    def upload(self, local: Path, key: str) -> None: ...
    def download(self, key: str, local: Path) -> None: ...
    def size(self, key: str) -> int: ...
    def delete(self, key: str) -> None:
        """Remove one object; nothing happens when it is not there."""
        raise NotImplementedError

    def list(self, directory: str, *, name_prefix: str = "", limit: int | None = None) -> Iterator[str]:
        """Keys of the files under `directory` at any depth, in key order, read lazily. `directory` is a
        directory with or without its final '/' ("" is the root). `name_prefix`: only what lies under
        the directory's entries whose name starts with it (`list("stages/", name_prefix="round_")`);
        `limit`: at most that many keys."""
        raise NotImplementedError

    def list_dir(self, directory: str, *, name_prefix: str = "", limit: int | None = None) -> Iterator[str]:
        """Names of `directory`'s own entries in key order: a file as `name`, a subdirectory as `name/`
        (one request a page on S3, however many files lie below); `name_prefix` and `limit` as in `list`."""
        raise NotImplementedError

    def open_read(self, key: str, start: int = 0) -> BinaryIO:
        """A stream of the object's bytes from offset `start` (for resuming a partial download)."""
        raise NotImplementedError

    def local_path(self, key: str) -> Path | None:
        """The file's path when storage is a local directory (lets training write in place)."""
        return None

    def describe(self, key: str) -> str:
        if key.strip("/") == "":
            return f"{self.uri.rstrip('/')}/"
        return f"{self.uri.rstrip('/')}/{safe_key(key)}" + ("/" if key.endswith("/") else "")
