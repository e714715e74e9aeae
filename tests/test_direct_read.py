"""DCP shard files read straight into their targets (ballast.training.checkpoint.direct_read): the same
values as DCP's own reader for every dtype and layout, plain pieces read directly and everything else
left to DCP, a piece narrowed as a reshard narrows it, and a damaged or truncated file named."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp_api
from ballast.training.checkpoint import dcp, direct_read
from ballast.training.failure import CheckpointFailure

pytestmark = pytest.mark.unit


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(20, 6, generator=gen)
    return {"view": base[:15],  # a view of a larger storage, as FSDP2's padded shards are
            "bf16": torch.randn(4, 5, generator=gen).to(torch.bfloat16), "scalar": torch.tensor(3.5),
            "int": torch.arange(12).reshape(3, 4), "bool": torch.rand(5, generator=gen) > 0.5,
            "complex": torch.randn(3, dtype=torch.complex64, generator=gen),
            "transposed": base.t(),  # stored non-contiguous: DCP's way
            "big": torch.randn(300, 1000, generator=gen)}


def _count_direct(monkeypatch) -> list[str]:
    seen: list[str] = []
    region = direct_read._region
    def counted(layout, offsets, lengths):
        found = region(layout, offsets, lengths)  # a region not in one run raises first: not counted
        seen.append(layout.dtype)
        return found

    monkeypatch.setattr(direct_read, "_region", counted)
    return seen


def test_a_load_through_the_direct_reader_equals_dcps_own_for_every_dtype_and_layout(tmp_path, monkeypatch):
    state = _state()
    dcp_api.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    seen = _count_direct(monkeypatch)
    ours = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_api.load(ours, storage_reader=dcp.reader(tmp_path), no_dist=True)
    theirs = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_api.load(theirs, storage_reader=dcp_api.FileSystemReader(str(tmp_path)), no_dist=True)
    for k, v in state.items():
        assert torch.equal(ours[k], v) and torch.equal(theirs[k], v), k
    assert len(seen) == len(state) - 1, "every plain piece read directly; the transposed one by DCP"
    # A target of another dtype (DCP casts as it copies) goes DCP's way too, with DCP's result.
    cast = {"view": torch.zeros(15, 6, dtype=torch.float64)}
    dcp_api.load(cast, storage_reader=dcp.reader(tmp_path), no_dist=True)
    assert torch.equal(cast["view"], state["view"].double())


def test_a_piece_narrowed_as_a_reshard_reads_it_lands_where_it_belongs(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    stored = torch.arange(8 * 4 * 3, dtype=torch.float32).reshape(8, 4, 3)
    dcp_api.save({"w": stored}, checkpoint_id=str(tmp_path), no_dist=True)
    read = dcp.reader(tmp_path)
    read.set_up_storage_reader(read.read_metadata(), is_coordinator=False)
    index = MetadataIndex("w", torch.Size([0, 0, 0]))
    # rows 2-4 (one run of the file: direct), then column 1 of every row (several runs: DCP's way)
    asks = {"rows": ([2, 0, 0], [3, 4, 3]), "column": ([0, 1, 0], [8, 1, 3]), "one_row_part": ([5, 1, 0], [1, 2, 3])}
    targets = {name: torch.zeros(n) for name, (_, n) in asks.items()}
    plan = LoadPlan([ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(name), dest_offsets=torch.Size([0, 0, 0]),
                              storage_index=index, storage_offsets=torch.Size(o), lengths=torch.Size(n))
                     for name, (o, n) in asks.items()])

    committed: list[str] = []

    class Planner:
        def resolve_tensor(self, item):
            return targets[item.dest_index.fqn]

        def commit_tensor(self, item, tensor):
            committed.append(item.dest_index.fqn)

    seen = _count_direct(monkeypatch)
    read.read_data(plan, Planner()).wait()
    assert torch.equal(targets["rows"], stored[2:5])
    assert torch.equal(targets["column"], stored[:, 1:2])
    assert torch.equal(targets["one_row_part"], stored[5:6, 1:3])
    assert sorted(committed) == sorted(asks)
    assert len(seen) == 2  # the column's region is not one run of the file: DCP read it
    with pytest.raises(direct_read._NotPlain):
        direct_read._region(direct_read._Layout("float32", "0", 96, 0, (8, 4, 3), (12, 3, 1)), [0, 1, 0], [8, 1, 3])


def _rchar() -> int:
    """Bytes this process has read through read syscalls so far (/proc/self/io)."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts reads through Linux's /proc/self/io")
def test_a_reshard_reads_only_the_part_of_a_stored_piece_it_needs(tmp_path):
    """A run resharded to twice the ranks needs half of each stored piece: read directly, about half its
    bytes are read; DCP's own reader (torch.load of the piece) reads all of them."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    stored = torch.randn(1024, 2048)  # 8 MiB
    dcp_api.save({"w": stored}, checkpoint_id=str(tmp_path), no_dist=True)
    plan = LoadPlan([ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w"), dest_offsets=torch.Size([0, 0]),
                              storage_index=MetadataIndex("w", torch.Size([0, 0])), storage_offsets=torch.Size([512, 0]),
                              lengths=torch.Size([512, 2048]))])
    read_bytes = {}
    for kind, read in (("direct", dcp.reader(tmp_path)), ("dcp", dcp_api.FileSystemReader(str(tmp_path)))):
        read.set_up_storage_reader(read.read_metadata(), is_coordinator=False)
        target = torch.zeros(512, 2048)

        class Planner:
            def resolve_tensor(self, item, target=target):
                return target

            def commit_tensor(self, item, tensor):
                pass

        before = _rchar()
        read.read_data(plan, Planner()).wait()
        read_bytes[kind] = _rchar() - before
        assert torch.equal(target, stored[512:]), kind
    assert read_bytes["direct"] < 0.55 * stored.nbytes <= stored.nbytes <= read_bytes["dcp"], read_bytes


def test_a_truncated_or_damaged_shard_file_is_named_with_the_tensor(tmp_path):
    state = _state()
    dcp_api.save({"model": state}, checkpoint_id=str(tmp_path), no_dist=True)
    shard = next(Path(tmp_path).glob("*.distcp"))
    data = shard.read_bytes()
    meta = dcp.metadata(tmp_path)
    big = next(s for i, s in meta.storage_data.items() if i.fqn == "model.big")
    for cut in (big.offset + big.length - 4096, big.offset + 100):  # inside its bytes; inside its zip header
        shard.write_bytes(data[:cut])  # either way the record's zip directory is gone
        with pytest.raises(CheckpointFailure, match=rf"cannot read the shard {shard.name} through DCP \({shard.name}:"
                                                    rf" the record of model\.big at byte {big.offset} is damaged"):
            dcp.check(tmp_path)
    with pytest.raises(CheckpointFailure, match="cannot read the model's shards through DCP"):
        dcp.model_weights(tmp_path)


def test_a_records_pickle_naming_anything_but_a_plain_tensor_is_never_called_and_left_to_dcp():
    for payload in (pickle.dumps(os.system), pickle.dumps(print), pickle.dumps(Path("x"))):
        with pytest.raises(direct_read._NotPlain):
            direct_read._LayoutUnpickler(io.BytesIO(payload)).load()
    buf = io.BytesIO()
    torch.save(torch.zeros(3).to_sparse(), buf)  # another rebuild function: torch.load's (weights_only) way
    with pytest.raises(direct_read._NotPlain):
        direct_read._layout(torch._C.PyTorchFileReader(io.BytesIO(buf.getvalue())))
