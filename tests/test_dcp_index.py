"""Ballast's JSON index of a sharded checkpoint's DCP metadata (training/checkpoint/dcp_index): written
by every sharded save, hashed into the manifest, and what every read of a committed checkpoint builds
its metadata from, never unpickling `.metadata`. The index is as untrusted as the pickle was (whoever
writes to storage can change it): the inputs of the security issue, written as JSON, are refused the
same way, naming the file, in bounded time."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from ballast.training.checkpoint import dcp, dcp_index, dcp_metadata, gate
from ballast.training.checkpoint.commit import MANIFEST, Writer
from ballast.training.failure import CheckpointFailure

pytestmark = pytest.mark.unit

INDEX = dcp_index.INDEX_FILE


def _committed(root: Path, step: int = 10, *, fill: float | None = None) -> Path:
    """A checkpoint as a sharded save commits it: DCP's files through dcp.write, the trainer state,
    a manifest of every file."""
    w = Writer(root, step, rank=0, barrier=lambda: None)
    w.begin()
    weights = {f"layer{i}.w": torch.randn(8, 4) if fill is None else torch.full((8, 4), fill) for i in range(3)}
    for name, digest in dcp.write({"model": weights, "optim": {"step": torch.tensor(3.0)}}, w.tmp, rank=0,
                                  group=None).items():
        w.adopt(name, digest)
    w.write_json("trainer.json", {"step": step})
    return w.commit()


def _rewrite(ck: Path, name: str, data: bytes) -> None:
    """`name` replaced by `data` and the manifest rewritten to match (what a storage writer can do)."""
    (ck / name).write_bytes(data)
    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any unpickling of the metadata fails the test."""
    def refuse(*_, **__):
        raise AssertionError("the metadata was unpickled")

    monkeypatch.setattr(dcp_metadata, "RestrictedUnpickler", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    dcp_metadata._CHECKED.clear()


def test_a_sharded_save_writes_the_index_and_every_read_builds_the_metadata_from_it(tmp_path, no_unpickling):
    ck = _committed(tmp_path / "ckpts")
    files = json.loads((ck / MANIFEST).read_text())["files"]
    assert {INDEX, ".metadata"} <= set(files)
    with open(ck / ".metadata", "rb") as f:
        pickled = pickle.Unpickler(f).load()  # the test's own file, read with the real unpickler
    built = dcp.metadata(ck)
    assert built.state_dict_metadata == pickled.state_dict_metadata
    assert built.storage_data == pickled.storage_data and built.planner_data == pickled.planner_data

    verified: dict[Path, str] = {}
    assert gate.latest_passing(tmp_path / "ckpts", quarantine_failures=False, verified=verified) == ck
    assert verified[ck] == files[INDEX]["sha256"]  # the gate checked the index
    state = {"model": {f"layer{i}.w": torch.zeros(8, 4) for i in range(3)}}
    dcp.load(state, ck, no_dist=True, digest=verified[ck])
    assert torch.equal(state["model"]["layer1.w"], dcp.model_weights(ck)["layer1.w"])


def test_an_index_swapped_in_after_the_gate_is_refused_by_the_digest_it_checked(tmp_path):
    ck = _committed(tmp_path / "ckpts")
    verified: dict[Path, str] = {}
    gate.latest_passing(tmp_path / "ckpts", quarantine_failures=False, verified=verified)
    other = _committed(tmp_path / "other", fill=7.0)
    _rewrite(ck, INDEX, (other / INDEX).read_bytes())  # valid, its pieces in this one's file
    state = {"model": {f"layer{i}.w": torch.zeros(8, 4) for i in range(3)}}
    with pytest.raises(CheckpointFailure, match=rf"step-00000010/{INDEX}: sha256 \w+\.\.\. is not the \w+\.\.\. that"
                                                r" was verified"):
        dcp.load(state, ck, no_dist=True, digest=verified[ck])
    (ck / INDEX).write_bytes((ck / INDEX).read_bytes() + b" ")  # and without a digest, the manifest's
    with pytest.raises(CheckpointFailure, match=r"metadata changed after the gate checked it"):
        dcp.model_weights(ck)


def test_a_checkpoint_saved_before_the_index_reads_its_metadata_pickle(tmp_path):
    ck = _committed(tmp_path / "ckpts")
    manifest = json.loads((ck / MANIFEST).read_text())
    del manifest["files"][INDEX]
    (ck / MANIFEST).write_text(json.dumps(manifest))
    os.unlink(ck / INDEX)
    assert dcp.check(ck) == manifest["files"][".metadata"]["sha256"]
    assert dcp.model_weights(ck)["layer0.w"].shape == (8, 4)


def _edit(piece=None, tensor=None, doc=None):
    def apply(index: dict) -> dict:
        t = index["tensors"]["model.layer0.w"]
        if piece:
            piece(t["pieces"][0])
        if tensor:
            tensor(t)
        if doc:
            doc(index)
        return index
    return apply


@pytest.mark.parametrize("edit, problem", [
    (_edit(piece=lambda p: p.__setitem__(2, "/elsewhere/theirs/__0_0.distcp")),
     r"piece of 'model\.layer0\.w' is in '/elsewhere/theirs/__0_0\.distcp', not a shard file of this checkpoint"),
    (_edit(piece=lambda p: p.__setitem__(2, "../theirs/__0_0.distcp")), r"is in '\.\./theirs/__0_0\.distcp', not a shard"),
    (_edit(piece=lambda p: p.__setitem__(2, "__7_0.distcp")), r"is in __7_0\.distcp, which the manifest does not list"),
    (_edit(piece=lambda p: p.__setitem__(3, True)), r"has offset True and length"),
    (_edit(piece=lambda p: p.__setitem__(4, 1 << 40)), r"lies past the end of __0_0\.distcp"),
    (_edit(piece=lambda p: p.__setitem__(4, 4)), r"needs more bytes than the 4 stored"),
    (_edit(piece=lambda p: p.__setitem__(1, [-8, 4])), r"has a piece outside its tensor"),
    (_edit(piece=lambda p: p.__setitem__(1, [4, 4])), r"pieces do not cover its tensor exactly once"),
    (_edit(piece=lambda p: p.__setitem__(0, [1 << 70, 0])), r"has a piece outside its tensor"),
    (_edit(piece=lambda p: p.__setitem__(0, ["a", 0])), r"not Ballast's index .* \(TypeError:"),
    (_edit(piece=lambda p: p.append(0)), r"not Ballast's index .* is not \[offsets, sizes, file, offset, length\]"),
    (_edit(tensor=lambda t: t.__setitem__("dtype", "object")), r"has no dtype a Ballast checkpoint stores"),
    (_edit(tensor=lambda t: t["pieces"].append(t["pieces"][0])), r"two pieces at offsets \(0, 0\)"),
    (_edit(tensor=lambda t: t.__setitem__("size", [8, 4, 1])), r"has a piece outside its tensor"),
    (_edit(doc=lambda d: d.__setitem__("format", "something-else/1")), r"not a ballast-dcp-index/1 document"),
    (_edit(doc=lambda d: d.__setitem__("storage_meta", {"modules": [{"a": 1}]})), r"storage_meta is not"),
    (_edit(doc=lambda d: d.__setitem__("planner_data", {"a": [1.5]})), r"planner_data is not DCP's map"),
], ids=["absolute", "dotdot", "unlisted", "bool", "past-end", "short", "negative", "gap", "huge", "string",
        "arity", "dtype", "twice", "rank", "format", "storage-meta", "planner-data"])
def test_what_a_storage_writer_puts_in_the_index_is_refused_naming_the_file(tmp_path, edit, problem):
    ck = _committed(tmp_path / "ckpts")
    _rewrite(ck, INDEX, json.dumps(edit(json.loads((ck / INDEX).read_bytes()))).encode())
    for read in (lambda: dcp.metadata(ck), lambda: dcp.model_weights(ck), lambda: dcp.check(ck)):
        with pytest.raises(CheckpointFailure, match=rf"step-00000010/{INDEX}: .*{problem}"):
            read()


@pytest.mark.parametrize("data", [b"[" * 200_000 + b"]" * 200_000, b"\xff\xfe not json", b'{"format": "ballast-dcp-index/1"}',
                                  b'{"format": "ballast-dcp-index/1", "tensors": {"w": {"pieces": [], "dtype": "float32",'
                                  b' "size": [' + b"9" * 5000 + b"]}}}"],
                         ids=["nested", "bytes", "no-tensors", "long-int"])
def test_an_index_that_is_no_json_document_of_its_shape_is_refused_in_bounded_time(tmp_path, data):
    ck = _committed(tmp_path / "ckpts")
    _rewrite(ck, INDEX, data)
    t0 = time.monotonic()
    with pytest.raises(CheckpointFailure, match=rf"step-00000010/{INDEX}: not Ballast's index of a DCP checkpoint's"
                                                r" metadata \(\w+"):
        dcp.metadata(ck)
    assert time.monotonic() - t0 < 5


def test_a_save_refuses_a_state_the_index_cannot_hold(tmp_path):
    with pytest.raises(CheckpointFailure, match=r"optim\.note: a BytesStorageMetadata in the state to save; a Ballast"
                                                r" checkpoint stores tensors only"):
        dcp.write({"model": {"w": torch.ones(2)}, "optim": {"note": "hello"}}, tmp_path, rank=0, group=None)


def test_an_index_the_manifest_lists_without_dcps_own_metadata_is_refused(tmp_path):
    """The gate checks a sharded checkpoint's values when its manifest lists `.metadata`: an index listed
    without it would skip that check, so it is not read."""
    ck = _committed(tmp_path / "ckpts")
    manifest = json.loads((ck / MANIFEST).read_text())
    del manifest["files"][".metadata"]
    (ck / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointFailure, match=rf"manifest\.json: lists {INDEX} but not \.metadata; a sharded"
                                                r" checkpoint has both"):
        dcp.metadata(ck)


def _one_tensor(pieces: list, size: list[int]) -> dict:
    return {"format": dcp_index.FORMAT, "version": "1", "planner_data": None, "storage_meta": None,
            "tensors": {"model.w": {"dtype": "float32", "size": size, "requires_grad": False, "pieces": pieces}}}


def test_a_tensor_split_finely_is_checked_in_linear_time_and_a_crafted_grid_refused(tmp_path):
    """The issue's review input: 20,000 one-element pieces of a [1, 20000] tensor, all at row 0, made the
    sweep along the first dimension quadratic (4,000 pieces took 8 s, 100,000 would take hours). The sweep
    goes along the dimension the pieces split most, so that is checked at once; a 200 x 200 grid of
    one-element pieces, which no sharded save writes, is refused for its split, in bounded time."""
    ck = _committed(tmp_path / "ckpts")
    row = [[[0, i], [1, 1], "__0_0.distcp", 0, 4] for i in range(20_000)]
    _rewrite(ck, INDEX, json.dumps(_one_tensor(row, [1, 20_000])).encode())
    t0 = time.monotonic()
    meta = dcp.metadata(ck)
    assert len(meta.storage_data) == 20_000 and time.monotonic() - t0 < 10  # ~1 s here; quadratic: minutes
    grid = [[[i, j], [1, 1], "__0_0.distcp", 0, 4] for i in range(200) for j in range(200)]
    _rewrite(ck, INDEX, json.dumps(_one_tensor(grid, [200, 200])).encode())
    t0 = time.monotonic()
    with pytest.raises(CheckpointFailure, match=r"'model\.w''s pieces do not cover its tensor exactly once \(or are"
                                                r" split too finely to check\)"):
        dcp.metadata(ck)
    assert time.monotonic() - t0 < 10
