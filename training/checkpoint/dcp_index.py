"""Ballast's own index of a sharded checkpoint's DCP metadata, as JSON (`dcp_index.json`): what DCP's
`.metadata` pickle says, written beside it by the rank that saved the metadata (`dcp.save` returns it),
hashed into the manifest like every file. A load builds DCP's Metadata from it with `json` (C) and the
metadata classes' own constructors, so no read of a Ballast checkpoint unpickles `.metadata`; the
restricted unpickler (dcp_metadata) is left for a DCP directory without an index (a bare one, or one
saved before the index). What it builds is checked as the unpickled metadata is (dcp_metadata's
`_metadata_problem`). DCP's `.metadata` stays, so other tools read the checkpoint as DCP's.

Measured on this project's 2-core machine, 1,200 stored pieces: 0.18 s through the restricted
unpickler, 0.009 s through C pickle (unchecked), ~0.01 s from this index (see `ballast bench
sharded-checkpoint`, whose load includes it). Importing this module does not import torch.
"""

from __future__ import annotations

import json
from typing import Any

from ballast.training.checkpoint.direct_read import STORED_DTYPES
from ballast.training.failure import CheckpointFailure

INDEX_FILE = "dcp_index.json"
FORMAT = "ballast-dcp-index/1"


def encode(meta: Any) -> bytes:
    """The index of DCP's Metadata `meta` (as a save returns it): per tensor its dtype, size and pieces,
    each piece [offsets, sizes, shard file, byte offset, byte length]. A Ballast checkpoint stores plain
    tensors only: anything else (a pickled value, a transformed piece) is refused here, at save."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    tensors: dict[str, Any] = {}
    for fqn, entry in meta.state_dict_metadata.items():
        if type(entry) is not TensorStorageMetadata:
            raise CheckpointFailure(f"{fqn}: a {type(entry).__name__} in the state to save; a Ballast checkpoint"
                                    f" stores tensors only (other values go to JSON files)")
        dtype = str(entry.properties.dtype).removeprefix("torch.")
        if dtype not in STORED_DTYPES:
            raise CheckpointFailure(f"{fqn}: dtype {dtype} is not one a Ballast checkpoint stores")
        pieces = []
        for chunk in entry.chunks:
            info = meta.storage_data[MetadataIndex(fqn, chunk.offsets)]
            if getattr(info, "transform_descriptors", None):
                raise CheckpointFailure(f"{fqn}: stored transformed ({info.transform_descriptors}); a Ballast"
                                        f" checkpoint stores plain tensors")
            pieces.append([list(chunk.offsets), list(chunk.sizes), info.relative_path, info.offset, info.length])
        tensors[fqn] = {"dtype": dtype, "size": list(entry.size), "requires_grad": bool(entry.properties.requires_grad),
                        "pieces": pieces}
    planner = meta.planner_data
    storage = meta.storage_meta
    doc = {"format": FORMAT, "version": meta.version, "tensors": tensors,
           "planner_data": None if planner is None else {k: list(v) for k, v in planner.items()},
           "storage_meta": None if storage is None else {"save_id": storage.save_id, "modules": list(storage.modules)}}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """DCP's Metadata from an index's bytes (untrusted: a storage writer may have written them), built
    with the metadata classes' constructors from JSON's values; raises ValueError (or TypeError...) for
    what is not an index. The caller checks what it built (every type and range, the pieces' files)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    doc = json.loads(data)
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} document")
    tensors = doc["tensors"]
    if type(tensors) is not dict:
        raise TypeError("tensors is not a mapping")
    size_of, dtypes = torch.Size, {name: getattr(torch, name) for name in STORED_DTYPES}
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for fqn, t in tensors.items():
        if type(t) is not dict or type(t["pieces"]) is not list or type(t.get("requires_grad", False)) is not bool:
            raise TypeError(f"tensor {fqn[:120]!r} is not a mapping of its dtype, size and pieces")
        chunks = []
        for piece in t["pieces"]:
            if type(piece) is not list or len(piece) != 5:
                raise TypeError(f"a piece of {fqn[:120]!r} is not [offsets, sizes, file, offset, length]")
            offsets, sizes, name, at, length = piece
            offsets = size_of(offsets)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=size_of(sizes)))
            storage[MetadataIndex(fqn, offsets)] = _StorageInfo(relative_path=name, offset=at, length=length)
        dtype = dtypes.get(t["dtype"]) if type(t["dtype"]) is str else None
        if dtype is None:
            raise TypeError(f"tensor {fqn[:120]!r} has no dtype a Ballast checkpoint stores")
        entries[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype, requires_grad=t.get(
            "requires_grad", False)), size=size_of(t["size"]), chunks=chunks)
    planner, kept, version = doc.get("planner_data"), doc.get("storage_meta"), doc.get("version")
    if type(planner) is dict:
        planner = {k: tuple(v) if type(v) is list else v for k, v in planner.items()}
    if kept is not None:
        if type(kept) is not dict or type(kept.get("modules", [])) is not list or not all(
                type(m) is str for m in kept.get("modules", [])) or type(kept.get("save_id")) not in (str, type(None)):
            raise TypeError("storage_meta is not a save id and a list of module names")
        kept = StorageMeta(save_id=kept.get("save_id"), modules=kept.get("modules", []))
    if type(version) not in (str, type(None)):
        raise TypeError("version is not a string")
    return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage, storage_meta=kept,
                    version=version)
