"""A sharded checkpoint's DCP metadata, read as data: from Ballast's JSON index of it (dcp_index) or,
without one, DCP's `.metadata` pickle unpickled with DCP's metadata classes only (restricted_pickle);
checked against the digest the gate verified (or the manifest's), then every entry checked before a
planner or a reader trusts it: tensors only (a bytes entry would make DCP's load unpickle a stored
value), no transform, every piece in a shard file of DCP's own name that the manifest lists and within
its size, every size and offset an int of its range. Importing this module does not import torch.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import importlib
import io
import json
import math
import os
import stat
import threading
from pathlib import Path
from typing import Any

from ballast.training.checkpoint import dcp_index
from ballast.training.checkpoint.commit import DCP_METADATA, MANIFEST
from ballast.training.checkpoint.dcp_index import INDEX_FILE
from ballast.training.checkpoint.direct_read import PIECE_FILE, STORED_DTYPES
from ballast.training.checkpoint.restricted_pickle import ATOMS, RestrictedUnpickler
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


_INDEX_MAX_BYTES = 256 << 20
"""The largest index read: ~50 bytes a stored piece, so the same ~5 million pieces (built into DCP's
metadata objects, ~2.8 KB each: what DCP's own load of such a checkpoint holds too)."""
_MAX_PIECES = 5_000_000
"""The most stored pieces a checkpoint's metadata may list."""


def _allowed(key: tuple[str, str]) -> Any:
    import torch

    module, name = key
    if key in _SAFE_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module == "pathlib._local" and ("pathlib", name) in _SAFE_GLOBALS:  # what Python 3.13 and later write
        return getattr(importlib.import_module("pathlib"), name)
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
    """(DCP's metadata of the sharded checkpoint at `path`, the sha256 of the bytes it was read from),
    checked before anything trusts it. Read from Ballast's JSON index (dcp_index) where the manifest
    lists one, never unpickling; else (a bare DCP directory, or one saved before the index) from DCP's
    `.metadata` with DCP's metadata classes only (restricted_pickle). The bytes must hash to `digest`
    (what the gate checked) or, without one, to the manifest's entry; then every entry is checked:
    tensors only (a bytes entry would make DCP unpickle a stored value), no transform, every piece in a
    file of DCP's own name that the manifest lists, within the file's bounds. The object is shared by
    the reads of the same bytes (`_CHECKED`): read it, never change it."""
    path = Path(path)
    listed = _manifest_files(path)
    name = INDEX_FILE if listed is not None and INDEX_FILE in listed else DCP_METADATA
    if name == INDEX_FILE and DCP_METADATA not in listed:  # the gate checks a sharded checkpoint by it
        raise CheckpointFailure(f"{path / MANIFEST}: lists {INDEX_FILE} but not {DCP_METADATA}; a sharded"
                                f" checkpoint has both, refusing to read the shards")
    f = path / name
    data = _read_regular(f, _INDEX_MAX_BYTES if name == INDEX_FILE else _METADATA_MAX_BYTES)
    sha = hashlib.sha256(data).hexdigest()
    if digest is None and listed is not None:
        entry = listed.get(name)
        if not isinstance(entry, dict):
            raise CheckpointFailure(f"{path / MANIFEST}: does not list {name}; refusing to read the shards")
        digest = entry.get("sha256")
        if not isinstance(digest, str):
            raise CheckpointFailure(f"{path / MANIFEST}: records no sha256 of {name}; refusing to read the shards")
    if digest is not None and sha != digest:
        raise CheckpointFailure(f"{f}: sha256 {sha[:12]}... is not the {digest[:12]}... that was verified; the"
                                f" metadata changed after the gate checked it, refusing to load")
    key = (sha, str(path.resolve()) if listed is None else tuple(sorted(
        (n, e["size"] if isinstance(e, dict) and type(e.get("size")) is int else None)
        for n, e in listed.items())))
    with _CHECKED_LOCK:
        meta = _CHECKED.get(key)
    if meta is None:
        try:
            meta = dcp_index.decode(data) if name == INDEX_FILE else RestrictedUnpickler(
                io.BytesIO(data), allowed=_allowed, buildable=_buildable(), keys=metadata_key,
                what="a DCP checkpoint's metadata").load()
        except Exception as exc:  # UnpicklingError, ValueError, TypeError, RecursionError... for a bad file
            what = "Ballast's index of a DCP checkpoint's metadata" if name == INDEX_FILE else "a DCP checkpoint's metadata"
            raise CheckpointFailure(f"{f}: not {what} ({type(exc).__name__}: {str(exc)[:300]})") from exc
        try:
            problem = _metadata_problem(meta, path, listed)
        except Exception as exc:  # noqa: BLE001  (what the checks did not foresee is still this file's fault)
            problem = f"malformed ({type(exc).__name__})"
        if problem:
            raise CheckpointFailure(f"{f}: {problem}; refusing to read the checkpoint")
        with _CHECKED_LOCK:
            _CHECKED[key] = meta
            while len(_CHECKED) > _CHECKED_KEPT:
                _CHECKED.popitem(last=False)
    return meta, sha


_CHECKED: collections.OrderedDict[tuple[str, Any], Any] = collections.OrderedDict()
"""Metadata already parsed and checked, by (sha256 of its bytes, the manifest's file names and sizes
it was checked against): a resume's load after its gate, and the gate of each of several checkpoints,
hash the bytes again but parse them once. Building from the index costs ~10 us a stored piece with its
checks; the restricted unpickler, pure Python and checked as it goes, 56-150 (1,200 pieces: 0.18 s)."""
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

    return (type(v) is torch.Size and len(v) <= _MAX_DIMS and (rank is None or len(v) == rank)
            and all(n >= 0 for n in v))  # a torch.Size holds ints only


_MAX_DIMS = 64
"""The most dimensions a stored tensor may have."""


def _show(v: Any) -> str:
    """An untrusted value for a message: a short string or number shown, anything else by its type
    only (a pickle can build a value that costs 2^n to print)."""
    if type(v) is str:
        return repr(v[:120]) + ("..." if len(v) > 120 else "")
    if type(v) in (int, bool) and abs(v) < 1 << 64 or v is None:
        return repr(v)
    return f"a {type(v).__name__}"


def metadata_key(key: Any) -> bool:
    """A mapping key a `.metadata` may use: a plain value, or a MetadataIndex of a name and a size."""
    kind = type(key)
    if kind in ATOMS:
        return True
    index, size = _index_types()
    return kind is index and type(key.fqn) is str and (
        key.offset is None or type(key.offset) is size and len(key.offset) <= _MAX_DIMS)


@functools.cache
def _index_types() -> tuple[type, type]:
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex, torch.Size


def _tiles(size: tuple[int, ...], chunks: dict[tuple[int, ...], tuple[int, ...]]) -> bool:
    """Whether the pieces (offsets -> sizes, each inside the tensor) cover a tensor of `size` exactly
    once: their volumes add up to the tensor's and no two overlap. A sweep along the dimension the pieces
    are split most along (a sharded save splits one or two: each piece then meets few others), its work
    bounded (a crafted split that would make the sweep quadratic is refused, not checked for hours)."""
    if sum(math.prod(s) for s in chunks.values()) != math.prod(size):
        return False
    if not size:
        return len(chunks) == 1
    axis = max(range(len(size)), key=lambda d: len({o[d] for o in chunks}))
    budget = 32 * len(chunks) + 10_000  # a 2-D split up to 32 pieces across, any number along
    active: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    for o, s in sorted(chunks.items(), key=lambda kv: kv[0][axis]):
        if not math.prod(s):
            continue
        budget -= len(active) + 1
        if budget < 0:
            return False
        active = [a for a in active if a[0] > o[axis]]
        for _, ao, asz in active:
            if all(ao[d] < o[d] + s[d] and o[d] < ao[d] + asz[d] for d in range(len(s))):
                return False
        active.append((o[axis] + s[axis], o, s))
    return True


def _metadata_problem(meta: Any, path: Path, listed: dict[str, Any] | None) -> str | None:
    """What is wrong with unpickled metadata (None: nothing): every field's type and range as the
    planner and the readers use them, and the pieces of each tensor stored once each, covering it
    exactly, each within its file and no larger than its stored bytes."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    if type(meta) is not Metadata or type(getattr(meta, "state_dict_metadata", None)) is not dict:
        return f"holds {_show(meta)}, not DCP's Metadata"
    pickled = [k for k, e in meta.state_dict_metadata.items() if type(e) is BytesStorageMetadata]
    if pickled:
        names = ", ".join(k[:120] if type(k) is str else _show(k) for k in pickled[:3])
        return (f"holds pickled values ({names}); a Ballast checkpoint holds"
                f" tensors only, refusing to unpickle")
    stored = _stored_dtypes()
    chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    itemsize: dict[str, int] = {}
    for fqn, e in meta.state_dict_metadata.items():
        if type(fqn) is not str or type(e) is not TensorStorageMetadata:
            return f"entry {_show(fqn)} is {_show(e)}, not a tensor's"
        p = getattr(e, "properties", None)
        if (type(p) is not TensorProperties or getattr(p, "dtype", None) not in stored
                or getattr(p, "layout", None) is not torch.strided or not _is_size(getattr(e, "size", None))
                or type(getattr(e, "chunks", None)) is not list):
            return f"entry {_show(fqn)} has malformed tensor properties (or a dtype no plain tensor has)"
        mine: dict[tuple[int, ...], tuple[int, ...]] = {}
        for c in e.chunks:
            if (type(c) is not ChunkStorageMetadata or not _is_size(getattr(c, "offsets", None), len(e.size))
                    or not _is_size(getattr(c, "sizes", None), len(e.size))
                    or any(o + n > d for o, n, d in zip(c.offsets, c.sizes, e.size))):
                return f"entry {_show(fqn)} has a piece outside its tensor"
            if tuple(c.offsets) in mine:
                return f"entry {_show(fqn)} has two pieces at offsets {tuple(c.offsets)}"
            mine[tuple(c.offsets)] = tuple(c.sizes)
        if not _tiles(tuple(e.size), mine):
            return (f"entry {_show(fqn)}'s pieces do not cover its tensor exactly once (or are split too finely"
                    f" to check)")
        chunks[fqn], itemsize[fqn] = mine, p.dtype.itemsize
    if type(meta.storage_data) is not dict:
        return "has no table of where each piece is stored"
    if len(meta.storage_data) > _MAX_PIECES:
        return f"lists {len(meta.storage_data)} stored pieces, over the {_MAX_PIECES} a checkpoint may have"
    sizes = _file_sizes(path, listed, meta.storage_data.values())
    for index, info in meta.storage_data.items():
        if type(index) is not MetadataIndex or not metadata_key(index):
            return f"stores {_show(index)} where a piece's index belongs"
        at = tuple(index.offset) if index.offset is not None else None
        piece = chunks.get(index.fqn, {}).get(at)
        if piece is None:
            return f"stores a piece no tensor has ({_show(index.fqn)} at {at})"
        if type(info) is not _StorageInfo:
            return f"piece of {_show(index.fqn)}: {_show(info)}, not DCP's storage entry"
        name = getattr(info, "relative_path", None)
        if type(name) is not str or not PIECE_FILE.match(name):
            return (f"piece of {_show(index.fqn)} is in {_show(name)}, not a shard file of this checkpoint"
                    f" (__<rank>_<n>.distcp)")
        if name not in sizes:
            return (f"piece of {_show(index.fqn)} is in {name}, which the manifest does not list" if listed is not None
                    else f"piece of {_show(index.fqn)} is in {name}, which is no regular file of the checkpoint")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            return f"piece of {_show(index.fqn)} has offset {_show(offset)} and length {_show(length)}"
        if offset + length > sizes[name]:
            return f"piece of {_show(index.fqn)} lies past the end of {name} ({sizes[name]} bytes)"
        if math.prod(piece) * itemsize[index.fqn] > length:
            return f"piece of {_show(index.fqn)} needs more bytes than the {length} stored"
        if getattr(info, "transform_descriptors", None):
            return (f"piece of {_show(index.fqn)} is stored transformed ({_show(info.transform_descriptors)});"
                    f" a Ballast checkpoint stores plain tensors")
    if len(meta.storage_data) != sum(map(len, chunks.values())):  # the keys are distinct (fqn, offsets)
        return "stores some tensor's piece nowhere"
    if meta.storage_meta is not None and type(meta.storage_meta) is not StorageMeta:
        return f"storage_meta is {_show(meta.storage_meta)}"
    planner = meta.planner_data
    if planner is not None and not (type(planner) is dict and all(
            type(k) is str and type(v) in (tuple, list) and all(type(x) in (str, int) for x in v)
            for k, v in planner.items())):
        return "planner_data is not DCP's map of names to key paths"
    return None


def _file_sizes(path: Path, listed: dict[str, Any] | None, infos: Any) -> dict[str, int]:
    """The shard files a checkpoint's pieces may lie in, and their sizes: the manifest's (a committed
    checkpoint, whose files the gate holds to them); in a bare DCP directory, the regular files of
    DCP's names the pieces name."""
    if listed is not None:
        return {n: e["size"] for n, e in listed.items()
                if PIECE_FILE.match(n) and isinstance(e, dict) and type(e.get("size")) is int}
    out = {}
    for name in {getattr(i, "relative_path", None) for i in infos}:
        if type(name) is str and PIECE_FILE.match(name):
            try:
                st = os.lstat(path / name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out[name] = st.st_size
    return out


@functools.cache
def _stored_dtypes() -> frozenset[Any]:
    import torch

    return frozenset(getattr(torch, name) for name in STORED_DTYPES)
