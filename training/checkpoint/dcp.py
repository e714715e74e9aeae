"""Sharded checkpoints under FSDP: the model and optimizer state through torch.distributed.checkpoint (DCP).

Each rank writes only its own shards (`__<rank>_0.distcp`), rank 0 also DCP's `.metadata` (which shard
holds which piece of which tensor); a load reads, on each rank, only the pieces its own shards need,
whatever the world size that wrote them (resharding is DCP's planner), each piece read straight into
the tensor it fills where it lies in one run of its file (direct_read). No process ever holds the
whole model or optimizer state: the state dicts here are sharded (DTensor) ones.

Only tensors go through DCP: DCP stores any other value pickled and unpickles it at load, so the
optimizer's parameter groups (learning rate, betas...; JSON values) are written by the manager as
`optim_groups.json`. DCP's `.metadata` is a pickle too: rank 0 writes it again as Ballast's JSON index
(dcp_index), and every read takes the metadata from `dcp_metadata` (hashed against what the gate
verified, built from the index, never unpickled; every entry checked), and every load goes through `load`, whose planner refuses to unpickle a stored value. The
files join the commit protocol like any other (commit.Writer.adopt).
Importing this module does not import torch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ballast.training.checkpoint import dcp_index
from ballast.training.checkpoint.commit import DCP_METADATA, share_of
from ballast.training.checkpoint.dcp_index import INDEX_FILE
from ballast.training.checkpoint.dcp_metadata import read_metadata
from ballast.training.checkpoint.fileio import expected_bytes, load_tensors, open_file, staging_buffer
from ballast.training.failure import CheckpointFailure

MODEL, OPTIM = "model", "optim"
GROUPS_FILE = "optim_groups.json"
"""The optimizer's parameter groups (hyper-parameters and the names of their parameters), as JSON."""
_CHECK_BYTES = 64 << 20  # the gate reads pieces in batches of about this size (one larger piece alone)
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
    shards; rank 0 also the metadata and its JSON index), each with its sha256 and size where they were hashed as DCP wrote
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
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.utils.serialization import config

    digests: dict[str, tuple[str, int]] = {}
    writer = FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True, thread_count=1)
    writer.fs = _hashing_file_system(digests, staging, expected_bytes(state, per_tensor=2048))
    # What every rank holds alike (the optimizer's step counts, unsharded buffers: small) goes to rank 0's
    # file, not spread over every file: a rank resuming reads its own shards' files and rank 0's, never
    # every file for a scalar each (what a node of several fetches from storage: `needed_files`).
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    with config.patch({"save.compute_crc32": False}):
        meta = dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
    names = sorted(p.name for p in Path(directory).glob(f"__{rank}_*.distcp"))
    if rank != 0:
        return {n: digests.get(n) for n in names}
    # The metadata rank 0 just wrote as DCP's pickle, also as Ballast's JSON index: what loads read.
    with writer.fs.create_stream(Path(directory) / INDEX_FILE, "wb") as out:
        out.write(dcp_index.encode(meta))
    return {**{n: digests.get(n) for n in names}, DCP_METADATA: None, INDEX_FILE: digests[INDEX_FILE]}


def _hashing_file_system(digests: dict[str, tuple[str, int]], staging: Any = None, shard_bytes: int = 0) -> Any:
    """DCP's local file system whose files opened for writing are fileio._FileWriter streams (O_DIRECT
    from the staging buffer, hashed as the bytes pass; the last partial block written and fsynced at
    close); `digests`: file name -> (sha256, size) of each file completed. `shard_bytes`: a shard file's
    expected size, reserved as it is opened (fileio._FileWriter's `size`)."""
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
            size = shard_bytes if Path(path).suffix == ".distcp" else 0  # not DCP's .metadata
            stream = open_file(Path(path), buffer, size)  # within fileio.offloading: by the writer process
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


def load_planner() -> Any:
    """DCP's default load planner whose `load_bytes`, the one method that unpickles a stored value, refuses."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise CheckpointFailure(f"{read_item.storage_index.fqn}: a pickled value in a checkpoint; a Ballast"
                                    f" checkpoint holds tensors only, refusing to unpickle")

    return TensorsOnlyLoadPlanner()


def reader(path: Path, *, digest: str | None = None) -> Any:
    """DCP's reader of the checkpoint at `path`, whose metadata is `read_metadata`'s (checked, read once;
    `digest`: the sha256 the gate checked it at) and whose pieces are read straight into their targets,
    each opened as a regular file of DCP's own name inside `path` (direct_read)."""
    return _safe_reader()(str(path), digest=digest)


@functools.cache
def _safe_reader() -> type:
    from ballast.training.checkpoint.direct_read import reader_class
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(reader_class(FileSystemReader)):  # type: ignore[misc]
        def __init__(self, path: str, *, digest: str | None = None) -> None:
            super().__init__(path)
            self.digest, self.checked = digest, None

        def read_metadata(self) -> Any:  # no **kwargs: DCP then never tries a rank's own metadata file
            import dataclasses

            from torch.distributed.checkpoint.metadata import StorageMeta

            if self.checked is None:
                self.checked = read_metadata(Path(self.path), digest=self.digest)
            meta = self.checked[0]  # shared by the reads of the same bytes: this load's id on a copy
            return dataclasses.replace(meta, storage_meta=dataclasses.replace(meta.storage_meta or StorageMeta(),
                                                                              load_id=self.load_id))

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(checkpoint_id)
            self.checked = None

    return SafeReader


def metadata(path: Path) -> Any:
    return reader(path).read_metadata()


def load(state: dict[str, Any], path: Path, *, group: Any = None, no_dist: bool = False,
         digest: str | None = None, read: Any = None) -> None:
    """DCP's load of `state` from the checkpoint at `path` (collective over `group`, or `no_dist`: this
    process alone), through `reader` and a planner that never unpickles: every load of a sharded
    checkpoint goes this way. `read`: a `reader(path)` already made (its metadata read once for several
    loads)."""
    import torch.distributed.checkpoint as dcp

    read = read if read is not None else reader(path, digest=digest)
    if group is not None and not no_dist and read.checked is None:
        _checked_by_first_rank(read, group)
    read.read_metadata()  # a bad file named here, not after DCP's warning and its AssertionError
    dcp.load(state, storage_reader=read, planner=load_planner(), process_group=group, no_dist=no_dist)


def _checked_by_first_rank(read: Any, group: Any) -> None:
    """The group's first rank reads and checks the metadata (`read_metadata`, at the reader's digest);
    the others take what it found over the group, as DCP's ranks take each other's plans (a peer of the
    same job), instead of each parsing it again with the restricted unpickler: on 4 CPU ranks of a
    2-core machine, that parse four times over was ~0.3 s of a ~1 s load. A failure is every rank's."""
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = read_metadata(Path(read.path), digest=read.digest)
        except CheckpointFailure as exc:
            box[0] = str(exc)
    dist.broadcast_object_list(box, group=group, group_src=0)
    if isinstance(box[0], str):
        raise CheckpointFailure(box[0])
    read.checked = box[0]


def read_into(model: Any, optimizer: Any, path: Path, *, groups: list[dict[str, Any]], group: Any,
              digest: str | None = None) -> None:
    """Load the sharded checkpoint at `path` into `model` and `optimizer` (collective over `group`): each
    rank reads the pieces of its own shards, at this run's world size. `digest`: the sha256 of the
    metadata the gate checked (`check`'s), which the load's must have."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state, _ = sharded_state(model, optimizer)
    load(state, path, group=group, digest=digest)
    set_state_dict(model, optimizer, model_state_dict=state[MODEL],
                   optim_state_dict={"state": state[OPTIM], "param_groups": groups})


def needed_files(model: Any, optimizer: Any, path: Path) -> set[str]:
    """The shard files that a load of the checkpoint at `path` into this rank's shards reads (DCP's own
    load plan for this rank, at this run's world size): what a node must hold before `read_into`."""
    state, _ = sharded_state(model, optimizer)
    meta = metadata(path)
    planner = load_planner()
    planner.set_up_planner(state, meta, is_coordinator=False)
    return {meta.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def average_into(model: Any, paths: list[Path], *, group: Any, digests: dict[Path, str] | None = None) -> None:
    """Set `model`'s weights to the mean of the model weights of the checkpoints at `paths`, shard by
    shard: each rank reads and averages only its own pieces (float64 sums). `digests`: the sha256 of
    each one's metadata as the gate checked it (`read_into`'s `digest`)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    current = get_model_state_dict(model)
    sums: dict[str, Any] = {}
    buf = {k: torch.empty_like(v) for k, v in current.items()}
    for path in paths:
        load({MODEL: buf}, path, group=group, digest=(digests or {}).get(path))
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


def _pieces(meta: Any) -> dict[str, list[tuple[Any, Any, Any]]]:
    """Per shard file, the tensor pieces it stores: (storage index, piece sizes, dtype), in file order."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sizes = {}
    for fqn, entry in meta.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            for chunk in entry.chunks:
                sizes[(fqn, tuple(chunk.offsets))] = (tuple(chunk.sizes), entry.properties.dtype)
    out: dict[str, list[tuple[Any, Any, Any]]] = {}
    for index, info in sorted(meta.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        size, dtype = sizes[(index.fqn, tuple(index.offset))]
        out.setdefault(info.relative_path, []).append((index, size, dtype))
    return out


class _Checker:
    """DCP's read path (FileSystemReader.read_data) for the gate: each piece read into a tensor of its own
    size, then checked; the planner methods read_data calls, and no other."""

    def __init__(self, targets: dict[Any, Any]) -> None:
        self.targets: dict[Any, Any] = targets
        self.bad: list[str] = []

    def resolve_tensor(self, item: Any) -> Any:
        return self.targets[item.storage_index]

    def commit_tensor(self, item: Any, tensor: Any) -> None:
        import torch

        if torch.is_floating_point(tensor) and not torch.isfinite(tensor).all():
            self.bad.append(item.storage_index.fqn)

    def load_bytes(self, item: Any, value: Any) -> None:  # never asked: pickled values are refused first
        raise CheckpointFailure(f"{item.storage_index.fqn}: a pickled value in a Ballast checkpoint")


def check(path: Path, *, share: tuple[int, int] | None = None, files: set[str] | None = None) -> str:
    """The gate's contents check of a sharded checkpoint: its metadata (`read_metadata`: tensors only, no
    pickled value, pieces inside the checkpoint), and every floating-point piece finite; a failure names
    the shard file. Returns the sha256 of the metadata checked (a load after the gate asks for it:
    `read_into`'s `digest`). Each shard file's pieces are read through the checkpoint's reader, a
    bounded batch of pieces at a time, each into a tensor of the piece's own size (never a whole
    tensor). `share` (part, parts): only this part's shard files (`commit.share_of`: the ranks that split
    the gate read each file once between them, whole files, the ones they hashed); `files`: only these
    shard files (a node's own, of a checkpoint whose other files are on other nodes)."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    path = Path(path)
    read = reader(path)
    meta = read.read_metadata()
    pieces = _pieces(meta)
    names = sorted(n for n in pieces if files is None or n in files)
    read.set_up_storage_reader(meta, is_coordinator=False)

    def read_batch(name: str, batch: list[tuple[Any, Any, Any]]) -> None:
        targets = {index: torch.empty(sizes, dtype=dtype) for index, sizes, dtype in batch}
        plan = LoadPlan([ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(index.fqn, index.offset),
                                  dest_offsets=torch.Size([0] * len(sizes)), storage_index=index,
                                  storage_offsets=torch.Size([0] * len(sizes)), lengths=torch.Size(sizes))
                         for index, sizes, _ in batch])  # each stored piece whole
        checker = _Checker(targets)
        try:
            read.read_data(plan, checker).wait()
        except CheckpointFailure:
            raise
        except (Exception, CheckpointException) as exc:  # a damaged record: torch.load's or the copy's error
            raise CheckpointFailure(f"{path}: cannot read the shard {name} through DCP ({first_line(exc)})") from exc
        if checker.bad:
            raise CheckpointFailure(f"{path / name}: non-finite values in {checker.bad[0]}")

    for name in sorted(share_of(names, share)):
        batch: list[tuple[Any, Any, Any]] = []
        size = 0
        for piece in pieces[name]:
            batch.append(piece)
            size += torch.Size(piece[1]).numel() * piece[2].itemsize
            if size >= _CHECK_BYTES:
                read_batch(name, batch)
                batch, size = [], 0
        if batch:
            read_batch(name, batch)
    return read.checked[1]


def model_weights(path: Path) -> dict[str, Any]:
    """The whole model's weights of a checkpoint in this one process: its model.pt, or a sharded one's
    model pieces read through DCP. For the orchestrator's stages that need the model (the gate's probe,
    evaluation, publishing), never in training."""
    import torch

    if (Path(path) / "model.pt").is_file() or not (Path(path) / DCP_METADATA).is_file():
        return load_tensors(Path(path) / "model.pt")
    from torch.distributed.checkpoint.api import CheckpointException

    meta = metadata(path)
    out = {fqn[len(MODEL) + 1:]: torch.empty(tuple(e.size), dtype=e.properties.dtype)
           for fqn, e in meta.state_dict_metadata.items() if fqn.startswith(MODEL + ".")}
    try:
        load({MODEL: out}, path, no_dist=True)
    except CheckpointFailure:
        raise
    except (Exception, CheckpointException) as exc:
        raise CheckpointFailure(f"{path}: cannot read the model's shards through DCP"
                                f" ({first_line(exc)})") from exc
    return out
