"""A sharded checkpoint's DCP metadata (`.metadata`, a pickle), read as data: checked against the digest
the gate verified (or the manifest's), unpickled with DCP's metadata classes only (restricted_pickle),
then every entry checked before a planner or a reader trusts it: tensors only (a bytes entry would make
DCP's load unpickle a stored value), no transform, every piece in a shard file of DCP's own name that
the manifest lists and within its size, every size and offset an int of its range. Importing this
module does not import torch.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import importlib
import io
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

from ballast.training.checkpoint.commit import DCP_METADATA, MANIFEST
from ballast.training.checkpoint.direct_read import PIECE_FILE
from ballast.training.checkpoint.restricted_pickle import RestrictedUnpickler
from ballast.training.failure import CheckpointFailure

_SAFE_GLOBALS = {("torch", "Size"), ("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
                 ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),
                 ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                 *(("torch.distributed.checkpoint.metadata", name) for name in (
                     "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                     "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"))}
"""What DCP's `.metadata` pickle may name: its metadata classes, torch sizes and dtypes, paths; no
function (a module prefix would let a pickle call any function in DCP's modules)."""


_METADATA_MAX_BYTES = 1 << 30
"""The largest `.metadata` read: ~200 bytes a stored piece, so ~5 million pieces (a 175B model's weights
and Adam state sharded over 1,024 ranks is ~3.5 million)."""


def _allowed(key: tuple[str, str]) -> Any:
    import torch

    module, name = key
    if key in _SAFE_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):  # torch.float32...
        return getattr(torch, name)
    return None


@functools.cache
def _buildable() -> tuple[type, ...]:
    """The instances a `.metadata` pickle sets the state of: DCP's metadata classes (dataclasses)."""
    from torch.distributed.checkpoint import filesystem, metadata

    return (metadata.Metadata, metadata.MetadataIndex, metadata.StorageMeta, metadata.TensorProperties,
            metadata.TensorStorageMetadata, metadata.BytesStorageMetadata, metadata.ChunkStorageMetadata,
            filesystem._StorageInfo)


def _read_regular(f: Path, limit: int) -> bytes:
    """The bytes of `f`, a regular file of at most `limit` bytes opened without following a link (a FIFO
    or a device is refused at once, never read)."""
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointFailure(f"{f}: cannot open the checkpoint's metadata ({exc.strerror})") from exc
    with os.fdopen(fd, "rb") as stream:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFailure(f"{f}: not a regular file; a checkpoint's metadata is one")
        if st.st_size > limit:
            raise CheckpointFailure(f"{f}: {st.st_size} bytes, over the {limit} a checkpoint's metadata may have")
        data = stream.read(limit + 1)
    if len(data) > limit:  # grown since the stat
        raise CheckpointFailure(f"{f}: over the {limit} bytes a checkpoint's metadata may have")
    return data


def read_metadata(path: Path, *, digest: str | None = None) -> tuple[Any, str]:
    """(DCP's metadata of the sharded checkpoint at `path`, the sha256 of its bytes), checked before
    anything trusts it. The bytes must hash to `digest` (what the gate checked) or, without one, to the
    manifest's entry; unpickled with DCP's metadata classes only (restricted_pickle); then every entry
    checked: tensors only (a bytes entry would make DCP unpickle a stored value), no transform, every
    piece in a file of DCP's own name that the manifest lists, within the file's bounds. The object is
    shared by the reads of the same bytes (`_CHECKED`): read it, never change it."""
    path = Path(path)
    f = path / DCP_METADATA
    data = _read_regular(f, _METADATA_MAX_BYTES)
    sha = hashlib.sha256(data).hexdigest()
    listed = _manifest_files(path)
    if digest is None and listed is not None:
        entry = listed.get(DCP_METADATA)
        if not isinstance(entry, dict):
            raise CheckpointFailure(f"{path / MANIFEST}: does not list {DCP_METADATA}; refusing to read the shards")
        digest = entry.get("sha256")
    if digest is not None and sha != digest:
        raise CheckpointFailure(f"{f}: sha256 {sha[:12]}... is not the {digest[:12]}... that was verified; the"
                                f" metadata changed after the gate checked it, refusing to load")
    key = (sha, None if listed is None else tuple(sorted(
        (name, e.get("size") if isinstance(e, dict) else None) for name, e in listed.items())))
    with _CHECKED_LOCK:
        meta = _CHECKED.get(key)
    if meta is None:
        try:
            meta = RestrictedUnpickler(io.BytesIO(data), allowed=_allowed, buildable=_buildable(),
                                       what="a DCP checkpoint's metadata").load()
        except Exception as exc:  # UnpicklingError, EOFError, TypeError... for a bad file
            raise CheckpointFailure(f"{f}: not a DCP checkpoint's metadata ({type(exc).__name__}: {exc})") from exc
        problem = _metadata_problem(meta, listed)
        if problem:
            raise CheckpointFailure(f"{f}: {problem}; refusing to read the checkpoint")
        with _CHECKED_LOCK:
            _CHECKED[key] = meta
            while len(_CHECKED) > _CHECKED_KEPT:
                _CHECKED.popitem(last=False)
    return meta, sha


_CHECKED: collections.OrderedDict[tuple[str, Any], Any] = collections.OrderedDict()
"""Metadata already unpickled and checked, by (sha256 of its bytes, the manifest's file names and
sizes it was checked against): a resume's load after its gate, and the gate of each of several
checkpoints, hash the bytes again but parse them once. The restricted unpickler is the pure-Python
one: ~60 us a stored piece against ~13 for the C one DCP uses (1,200 pieces: 67 ms against 5)."""
_CHECKED_KEPT = 4
_CHECKED_LOCK = threading.Lock()


def _manifest_files(path: Path) -> dict[str, Any] | None:
    """The manifest's files of a committed checkpoint; None for a bare DCP directory (no manifest)."""
    f = path / MANIFEST
    if not f.exists():
        return None
    try:
        files = json.loads(_read_regular(f, _METADATA_MAX_BYTES))["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointFailure(f"{f}: unreadable checkpoint manifest ({exc})") from exc
    return files


def _is_size(v: Any, rank: int | None = None) -> bool:
    import torch

    return (type(v) is torch.Size and (rank is None or len(v) == rank)
            and all(type(n) is int and n >= 0 for n in v))


def _metadata_problem(meta: Any, listed: dict[str, Any] | None) -> str | None:
    """What is wrong with unpickled metadata (None: nothing): every field's type and range, as the
    planner and the readers use them."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    if type(meta) is not Metadata or type(meta.state_dict_metadata) is not dict:
        return f"holds a {type(meta).__name__}, not DCP's Metadata"
    pickled = [k for k, e in meta.state_dict_metadata.items() if type(e) is BytesStorageMetadata]
    if pickled:
        return (f"holds pickled values ({', '.join(map(str, pickled[:3]))}); a Ballast checkpoint holds tensors"
                f" only, refusing to unpickle")
    chunks: set[tuple[str, tuple[int, ...]]] = set()
    for fqn, e in meta.state_dict_metadata.items():
        if type(fqn) is not str or type(e) is not TensorStorageMetadata:
            return f"entry {str(fqn)[:80]!r} is a {type(e).__name__}, not a tensor's"
        p = e.properties
        if (type(p) is not TensorProperties or not isinstance(p.dtype, torch.dtype) or p.layout != torch.strided
                or not _is_size(e.size) or type(e.chunks) is not list):
            return f"entry {fqn!r} has malformed tensor properties"
        for c in e.chunks:
            if (type(c) is not ChunkStorageMetadata or not _is_size(c.offsets, len(e.size))
                    or not _is_size(c.sizes, len(e.size))
                    or any(o + n > d for o, n, d in zip(c.offsets, c.sizes, e.size))):
                return f"entry {fqn!r} has a piece outside its tensor"
            chunks.add((fqn, tuple(c.offsets)))
    if type(meta.storage_data) is not dict:
        return "has no table of where each piece is stored"
    for index, info in meta.storage_data.items():
        if type(index) is not MetadataIndex or (index.fqn, tuple(index.offset or ())) not in chunks:
            return f"stores a piece no tensor has ({str(getattr(index, 'fqn', index))[:80]})"
        if type(info) is not _StorageInfo:
            return f"piece of {index.fqn!r}: a {type(info).__name__}, not DCP's storage entry"
        name = info.relative_path
        if type(name) is not str or not PIECE_FILE.match(name):
            return (f"piece of {index.fqn!r} is in {str(name)[:300]!r}, not a shard file of this checkpoint"
                    f" (__<rank>_<n>.distcp)")
        if listed is not None and name not in listed:
            return f"piece of {index.fqn!r} is in {name}, which the manifest does not list"
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            return f"piece of {index.fqn!r} has offset {info.offset!r} and length {info.length!r}"
        size = listed[name].get("size") if listed is not None and isinstance(listed[name], dict) else None
        if listed is not None and not (type(size) is int and info.offset + info.length <= size):
            return f"piece of {index.fqn!r} lies past the end of {name} ({size!r} bytes in the manifest)"
        if info.transform_descriptors:
            return (f"piece of {index.fqn!r} is stored transformed ({str(info.transform_descriptors)[:80]}); a Ballast"
                    f" checkpoint stores plain tensors")
    if meta.storage_meta is not None and type(meta.storage_meta) is not StorageMeta:
        return f"storage_meta is a {type(meta.storage_meta).__name__}"
    planner = meta.planner_data
    if planner is not None and not (type(planner) is dict and all(
            type(k) is str and type(v) in (tuple, list) and all(type(x) in (str, int) for x in v)
            for k, v in planner.items())):
        return "planner_data is not DCP's map of names to key paths"
    return None
