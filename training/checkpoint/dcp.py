"""Sharded checkpoints under FSDP: the model and optimizer state through torch.distributed.checkpoint (DCP).

Each rank writes only its own shards (`__<rank>_0.distcp`), rank 0 also DCP's `.metadata` (which shard
holds which piece of which tensor); a load reads, on each rank, only the pieces its own shards need,
whatever the world size that wrote them (resharding is DCP's planner). No process ever holds the whole
model or optimizer state: the state dicts here are sharded (DTensor) ones.

Only tensors go through DCP: DCP stores any other value pickled and unpickles it at load, so the
optimizer's parameter groups (learning rate, betas...; JSON values) are written by the manager as
`optim_groups.json`. DCP's `.metadata` is a pickle too: it is read by `SafeReader`, whose unpickler
accepts only DCP's own metadata classes and torch's sizes and dtypes, and only after the manifest's
sha256 of it matched. The files join the commit protocol like any other (commit.Writer.adopt).
Importing this module does not import torch.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ballast.training.checkpoint.commit import DCP_METADATA
from ballast.training.checkpoint.fileio import _FileWriter, load_tensors, staging_buffer
from ballast.training.failure import CheckpointFailure

MODEL, OPTIM = "model", "optim"
GROUPS_FILE = "optim_groups.json"
"""The optimizer's parameter groups (hyper-parameters and the names of their parameters), as JSON."""
_CHECK_BYTES = 64 << 20  # the gate reads tensors in batches of about this size (one larger tensor alone)
_SAFE_MODULES = ("torch.distributed.checkpoint.",)
_SAFE_GLOBALS = {("torch", "Size"), ("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
                 ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path")}


def sharded_state(model: Any, optimizer: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """({model: sharded model state, optim: sharded optimizer state}, the parameter groups); collective.
    An optimizer without state yet gets it (a zero step, as DCP's state_dict helpers do) so a load has
    somewhere to put it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=False))
    return {MODEL: msd, OPTIM: osd["state"]}, osd["param_groups"]


def groups_json(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The parameter groups as JSON values (a tensor learning rate as its float)."""
    def plain(v: Any) -> Any:
        if hasattr(v, "item") and getattr(v, "numel", lambda: 2)() == 1:
            return v.item()
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise CheckpointFailure(f"{GROUPS_FILE}: optimizer group value {v!r} ({type(v).__name__}) is not JSON")

    return [{k: plain(v) for k, v in g.items()} for g in groups]


def write(state: dict[str, Any], directory: Path, *, rank: int, group: Any,
          staging: Any = None) -> dict[str, tuple[str, int] | None]:
    """DCP save of `state` into `directory` (collective over `group`): the files this rank wrote (its
    shards; rank 0 also the metadata), each with its sha256 and size where they were hashed as DCP wrote
    them (the shards: the commit protocol need not read them back), for the manifest. `staging`: the
    page-aligned buffer the shards go to disk through (fileio.staging_buffer; the saver reuses one).

    The shards are written the way the commit protocol writes its own files (fileio._FileWriter):
    O_DIRECT through the staging buffer, each slice hashed while it is in the CPU cache, so a save
    neither copies ~1 GB into the page cache nor reads it back to hash it. On this project's 2-core
    machine, 4 processes saving 256 MiB each through DCP took 1.2-1.4 s with buffered files and a sha256
    thread beside them (~0.3 s of kernel time each), 0.7 s direct and hashed (~0.02 s), 0.5-1.0 s for
    DCP's own unhashed save (`ballast bench sharded-checkpoint` measures the whole save against it).
    The zip records' CRC32 is skipped (the manifest's sha256 covers every byte; torch.load does not
    check it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.utils.serialization import config

    digests: dict[str, tuple[str, int]] = {}
    writer = FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True, thread_count=1)
    writer.fs = _hashing_file_system(digests, staging)
    with config.patch({"save.compute_crc32": False}):
        dcp.save(state, storage_writer=writer, process_group=group)
    names = sorted(p.name for p in Path(directory).glob(f"__{rank}_*.distcp"))
    return {**{n: digests.get(n) for n in names}, **({DCP_METADATA: None} if rank == 0 else {})}


def _hashing_file_system(digests: dict[str, tuple[str, int]], staging: Any = None) -> Any:
    """DCP's local file system whose files opened for writing are fileio._FileWriter streams (O_DIRECT
    from the staging buffer, hashed as the bytes pass; the last partial block written and fsynced at
    close); `digests`: file name -> (sha256, size) of each file completed."""
    import contextlib

    from torch.distributed.checkpoint.filesystem import FileSystem

    buffer = staging if staging is not None else staging_buffer()

    class HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            stream = _FileWriter(Path(path), buffer)
            try:
                yield stream
            except BaseException as exc:
                stream.abandon()
                if stream.error is not None and stream.error is not exc:
                    # torch.save's zip writer turns a failed write into "unexpected pos N vs M": name
                    # what failed (a full disk, an I/O error) instead
                    raise stream.error from exc
                raise
            stream.close()  # done by DCP already, after its fsync
            digests[Path(path).name] = (stream.digest.hexdigest(), stream.size)

    return HashingFileSystem()


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_SAFE_MODULES) or (module, name) in _SAFE_GLOBALS or (
                module == "torch" and name.endswith(("32", "64", "16", "8", "bool"))):  # dtypes: torch.float32...
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


def reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """DCP's reader, whose metadata is unpickled with DCP's own classes only."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            f = Path(path) / DCP_METADATA
            try:
                metadata = _Unpickler(io.BytesIO(f.read_bytes())).load()
            except Exception as exc:  # UnpicklingError, EOFError, AttributeError... for a bad file
                raise CheckpointFailure(f"{f}: not a DCP checkpoint's metadata ({type(exc).__name__}: {exc})") from exc
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def metadata(path: Path) -> Any:
    return reader(path).read_metadata()


def read_into(model: Any, optimizer: Any, path: Path, *, groups: list[dict[str, Any]], group: Any) -> None:
    """Load the sharded checkpoint at `path` into `model` and `optimizer` (collective over `group`): each
    rank reads the pieces of its own shards, at this run's world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state, _ = sharded_state(model, optimizer)
    dcp.load(state, storage_reader=reader(path), process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state[MODEL],
                   optim_state_dict={"state": state[OPTIM], "param_groups": groups})


def average_into(model: Any, paths: list[Path], *, group: Any) -> None:
    """Set `model`'s weights to the mean of the model weights of the checkpoints at `paths`, shard by
    shard: each rank reads and averages only its own pieces (float64 sums)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    current = get_model_state_dict(model)
    sums: dict[str, Any] = {}
    buf = {k: torch.empty_like(v) for k, v in current.items()}
    for path in paths:
        dcp.load({MODEL: buf}, storage_reader=reader(path), process_group=group)
        for k, v in buf.items():
            local = _local(v)
            if torch.is_floating_point(local):
                sums[k] = local.double() if k not in sums else sums[k].add_(local)
    for k, total in sums.items():
        _local(buf[k]).copy_(total / len(paths))
    set_model_state_dict(model, buf)


def first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_batches(meta: Any) -> Iterator[dict[str, Any]]:
    """Empty full-size CPU tensors for the floating-point entries of a DCP checkpoint, in batches of
    about _CHECK_BYTES."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    batch, size = {}, 0
    for fqn, entry in meta.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        dtype = entry.properties.dtype
        if not dtype.is_floating_point:
            continue
        batch[fqn] = torch.empty(tuple(entry.size), dtype=dtype)
        size += batch[fqn].numel() * dtype.itemsize
        if size >= _CHECK_BYTES:
            yield batch
            batch, size = {}, 0
    if batch:
        yield batch


def check(path: Path, *, share: tuple[int, int] | None = None) -> None:
    """The gate's contents check of a sharded checkpoint: tensors only (no pickled value), and every
    floating-point tensor finite; a failure names the shard files that hold the tensor. Reads through
    DCP's reader, a bounded batch of tensors at a time (in one process, without a process group)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = Path(path)
    meta = metadata(path)
    pickled = [fqn for fqn, e in meta.state_dict_metadata.items() if isinstance(e, BytesStorageMetadata)]
    if pickled:
        raise CheckpointFailure(f"{path / DCP_METADATA}: holds pickled values ({', '.join(pickled[:3])}); a Ballast"
                                " checkpoint holds tensors only, refusing to unpickle")
    files: dict[str, set[str]] = {}  # tensor -> the shard files holding its pieces
    piece_file = {}  # (tensor, offsets of a piece) -> the shard file holding it
    for index, info in meta.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
        piece_file[(index.fqn, tuple(index.offset))] = info.relative_path
    for i, batch in enumerate(_tensor_batches(meta)):
        if share and i % share[1] != share[0]:
            continue  # another rank's share of the batches
        try:
            dcp.load(batch, storage_reader=reader(path), no_dist=True)
        except CheckpointFailure:
            raise
        except (Exception, CheckpointException) as exc:  # DCP's wraps what its reader raised (a damaged
            # record); it derives from BaseException, not Exception
            names = ", ".join(sorted({f for fqn in batch for f in files.get(fqn, ())}))
            raise CheckpointFailure(f"{path}: cannot read the shards {names} through DCP"
                                    f" ({first_line(exc)})") from exc
        for fqn, t in batch.items():
            if not torch.isfinite(t).all():
                bad = sorted({piece_file.get((fqn, tuple(c.offsets)), "?")
                              for c in meta.state_dict_metadata[fqn].chunks
                              if not torch.isfinite(t[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))]).all()})
                raise CheckpointFailure(f"{', '.join(str(path / f) for f in bad)}: non-finite values in {fqn}")


def model_weights(path: Path) -> dict[str, Any]:
    """The whole model's weights of a checkpoint in this one process: its model.pt, or a sharded one's
    model pieces read through DCP. For the orchestrator's stages that need the model (the gate's probe,
    evaluation, publishing), never in training."""
    import torch

    if (Path(path) / "model.pt").is_file() or not (Path(path) / DCP_METADATA).is_file():
        return load_tensors(Path(path) / "model.pt")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = metadata(path)
    out = {fqn[len(MODEL) + 1:]: torch.empty(tuple(e.size), dtype=e.properties.dtype)
           for fqn, e in meta.state_dict_metadata.items()
           if fqn.startswith(MODEL + ".") and isinstance(e, TensorStorageMetadata)}
    try:
        dcp.load({MODEL: out}, storage_reader=reader(path), no_dist=True)
    except CheckpointFailure:
        raise
    except (Exception, CheckpointException) as exc:
        raise CheckpointFailure(f"{path}: cannot read the model's shards through DCP"
                                f" ({first_line(exc)})") from exc
    return out
