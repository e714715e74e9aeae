"""A checkpoint is data, never code or a path (the second security pass): whoever can write to a
pipeline's storage can change a checkpoint's files, and no read of them runs code, opens a file outside
the checkpoint, changes the process, waits on a FIFO or inflates a bomb. Each test starts from the
issue's input, or a smaller one of the same shape."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pathlib
import pickle
import signal
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp_api
from ballast.training.checkpoint import dcp, dcp_metadata, direct_read, gate
from ballast.training.checkpoint.commit import COMMIT_MARKER, MANIFEST
from ballast.training.failure import CheckpointFailure
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _bounded_time():
    """A read that waits (a FIFO) fails the test in 20 s instead of hanging the suite (every 5 s after
    that: a blocked read DCP turned into its own error is interrupted again)."""
    def stop(*_):
        raise TimeoutError("a checkpoint read blocked")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 20, 5)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def _save(path: Path, w: torch.Tensor | None = None) -> Path:
    dcp_api.save({"model": {"w": torch.arange(6.0) if w is None else w}}, checkpoint_id=str(path), no_dist=True)
    return path


def _meta(path: Path):
    return pickle.loads((path / ".metadata").read_bytes())  # the test's own file: plain pickle


def _put_meta(path: Path, meta) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def _commit(path: Path) -> Path:
    """A manifest over the directory's files (sizes and sha256) and the commit marker, as commit.Writer
    leaves them; `path` named like a step directory by the caller when the gate reads it."""
    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(path.iterdir()) if p.is_file() and p.name not in (MANIFEST, COMMIT_MARKER)}
    (path / MANIFEST).write_text(json.dumps({"files": files}))
    (path / COMMIT_MARKER).write_text("")
    return path


class _Marker:
    """A pickled object whose unpickling creates `path` (what `print` stands for in the issue)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# --- 1. a bytes entry never reaches DCP's unpickling load -----------------------------------------------

def test_a_bytes_entry_in_the_metadata_is_refused_by_every_read_and_never_unpickled(tmp_path):
    ck = _save(tmp_path / "ck")
    marker = tmp_path / "ran"
    payload = io.BytesIO()
    torch.save(_Marker(marker), payload)
    (ck / "__0_0.distcp").write_bytes(payload.getvalue())
    meta = _meta(ck)
    meta.state_dict_metadata["model.w"] = BytesStorageMetadata()
    index = next(iter(meta.storage_data))
    meta.storage_data = {MetadataIndex("model.w"): meta.storage_data[index]}
    meta.storage_data[MetadataIndex("model.w")].length = len(payload.getvalue())
    _put_meta(ck, meta)
    state = {"model": {"w": torch.zeros(6)}}

    for read in (lambda: dcp.metadata(ck), lambda: dcp.model_weights(ck), lambda: dcp.check(ck),
                 lambda: dcp.load(state, ck, no_dist=True)):
        with pytest.raises(CheckpointFailure, match=r"ck/\.metadata: holds pickled values \(model\.w\); a Ballast"
                                                    r" checkpoint holds tensors only"):
            read()
    with pytest.raises(BaseException, match=r"holds pickled values"):  # DCP's own load, given Ballast's reader
        dcp_api.load(state, storage_reader=dcp.reader(ck), no_dist=True)
    # Had a bytes entry got past the reader, the planner would not unpickle it either.
    with pytest.raises(BaseException, match=r"model\.w: a pickled value in a checkpoint"):
        dcp_api.load({"model": {"w": "a value"}}, storage_reader=dcp_api.FileSystemReader(str(ck)),
                     planner=dcp.load_planner(), no_dist=True)
    assert not marker.exists(), "the stored object was unpickled"


def test_a_transformed_piece_is_refused_in_the_metadata(tmp_path):
    ck = _save(tmp_path / "ck")
    meta = _meta(ck)
    for info in meta.storage_data.values():
        info.transform_descriptors = ["zstd"]
    _put_meta(ck, meta)
    with pytest.raises(CheckpointFailure, match=r"model\.w' is stored transformed \(a list\); a Ballast checkpoint"
                                                r" stores plain tensors"):
        dcp.model_weights(ck)


def test_a_load_reads_the_metadata_the_gate_checked_not_one_swapped_in_since(tmp_path):
    root = tmp_path / "ckpts"
    ck = _commit(_save(root / "step-00000010"))
    (ck / "trainer.json").write_text(json.dumps({"step": 10}))
    _commit(ck)
    verified: dict[Path, str] = {}
    assert gate.latest_passing(root, quarantine_failures=False, verified=verified) == ck
    assert verified[ck] == hashlib.sha256((ck / ".metadata").read_bytes()).hexdigest()
    state = {"model": {"w": torch.zeros(6)}}
    dcp.load(state, ck, no_dist=True, digest=verified[ck])
    assert torch.equal(state["model"]["w"], torch.arange(6.0))

    # Another checkpoint's metadata (valid, its pieces in this one's file) swapped in after the gate,
    # the manifest rewritten to match: the load still refuses it, by the digest the gate checked.
    other = _save(tmp_path / "other", torch.full((6,), 7.0))
    os.replace(other / ".metadata", ck / ".metadata")
    _commit(ck)
    with pytest.raises(CheckpointFailure, match=r"step-00000010/\.metadata: sha256 \w+\.\.\. is not the \w+\.\.\. that"
                                                r" was verified; the metadata changed after the gate checked it"):
        dcp.load(state, ck, no_dist=True, digest=verified[ck])
    # Without a digest a read holds the metadata to the manifest's sha256.
    (ck / ".metadata").write_bytes((ck / ".metadata").read_bytes() + b"\0")
    with pytest.raises(CheckpointFailure, match=r"metadata changed after the gate checked it"):
        dcp.model_weights(ck)


# --- 2. pieces confined to the checkpoint ----------------------------------------------------------------

def test_pieces_pointing_at_another_pipelines_shards_are_refused(tmp_path):
    theirs = _commit(_save(tmp_path / "theirs", torch.full((6,), 42.0)))
    ours = _save(tmp_path / "ours")
    meta = _meta(ours)
    for info in meta.storage_data.values():
        info.relative_path = str(theirs / "__0_0.distcp")  # absolute: Path / absolute is the absolute path
    _put_meta(ours, meta)
    _commit(ours)
    for read in (lambda: dcp.model_weights(ours), lambda: dcp.check(ours)):
        with pytest.raises(CheckpointFailure, match=r"ours/\.metadata: piece of 'model\.w' is in '/.+/theirs/__0_0\.distcp',"
                                                    r" not a shard file of this checkpoint"):
            read()
    for name in ("../theirs/__0_0.distcp", "sub/__0_0.distcp", ".metadata", "__0_0.distcp/"):
        meta = _meta(ours)
        for info in meta.storage_data.values():
            info.relative_path = name
        _put_meta(ours, meta)
        _commit(ours)
        with pytest.raises(CheckpointFailure, match=r"not a shard file of this checkpoint"):
            dcp.model_weights(ours)


def test_a_piece_file_the_manifest_does_not_list_is_refused(tmp_path):
    ck = _save(tmp_path / "ck")
    os.link(ck / "__0_0.distcp", ck / "__7_0.distcp")  # a file of DCP's pattern the save never wrote
    _commit(ck)
    manifest = json.loads((ck / MANIFEST).read_text())
    del manifest["files"]["__7_0.distcp"]
    meta = _meta(ck)
    for info in meta.storage_data.values():
        info.relative_path = "__7_0.distcp"
    _put_meta(ck, meta)
    manifest["files"][".metadata"]["sha256"] = hashlib.sha256((ck / ".metadata").read_bytes()).hexdigest()
    (ck / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointFailure, match=r"piece of 'model\.w' is in __7_0\.distcp, which the manifest does"
                                                r" not list"):
        dcp.model_weights(ck)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_piece_file_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    theirs = _save(tmp_path / "theirs", torch.full((6,), 42.0))
    ck = _save(tmp_path / "ck")
    target = ck / "__1_0.distcp"
    if kind == "fifo":
        os.mkfifo(target)  # a read of it would wait for a writer forever
    elif kind == "symlink":
        target.symlink_to(theirs / "__0_0.distcp")
    else:
        target.mkdir()
    meta = _meta(ck)
    for info in meta.storage_data.values():
        info.relative_path = target.name
    _put_meta(ck, meta)  # no manifest: a bare DCP directory, the names its own
    with pytest.raises(CheckpointFailure, match=r"ck/\.metadata: piece of 'model\.w' is in __1_0\.distcp, which is no"
                                                r" regular file of the checkpoint"):
        dcp.model_weights(ck)
    # One swapped in after the metadata was checked: the reader's own open refuses it, at once.
    with pytest.raises((ValueError, OSError), match=r"__1_0\.distcp is not a regular file|Too many levels of symbolic"):
        direct_read.open_piece_file(ck, target.name)


def test_dcps_own_read_path_opens_only_the_checkpoints_own_shard_files(tmp_path):
    """What the direct reader leaves to DCP (here a stored non-contiguous tensor) opens its file the same
    confined way."""
    ck = _save(tmp_path / "ck", torch.arange(12.0).reshape(3, 4).t())
    fs = direct_read._confined_file_system()
    with pytest.raises(ValueError, match=r"'\.\./x' is not a file of the checkpoint"):
        fs.concat_path(ck, "../x")
    os.mkfifo(ck / "__5_0.distcp")
    with pytest.raises(ValueError, match=r"__5_0\.distcp is not a regular file"), \
            fs.create_stream(ck / "__5_0.distcp", "rb"):
        pass
    assert torch.equal(dcp.model_weights(ck)["w"], torch.arange(12.0).reshape(3, 4).t())


# --- 4. no pickle sets the attributes of a class or a function ------------------------------------------

def test_a_metadata_pickle_cannot_replace_a_method_of_an_allowed_class(tmp_path):
    """GLOBAL pathlib.PosixPath, then BUILD with slot state {is_file: OrderedDict}: the C unpickler sets
    PosixPath.is_file for the whole process before the load fails on the result."""
    original = pathlib.PosixPath.is_file
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".metadata").write_bytes(
        b"\x80\x04cpathlib\nPosixPath\nN}X\x07\x00\x00\x00is_fileccollections\nOrderedDict\ns\x86b.")
    try:
        with pytest.raises(CheckpointFailure, match=r"ck/\.metadata: not a DCP checkpoint's metadata \(UnpicklingError:"
                                                    r" sets the attributes of a class \(PosixPath\)"):
            dcp.metadata(tmp_path / "ck")
        assert pathlib.PosixPath.is_file is original
    finally:
        pathlib.PosixPath.is_file = original


def test_no_state_is_set_through_slots_nor_a_state_method_planted_by_the_pickle(tmp_path):
    """An instance of a class the format needs may get its fields, never another class (`__class__` by
    slot state) nor a `__setstate__` of the pickle's choosing."""
    (tmp_path / "ck").mkdir()
    chunk = b"ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\n)\x81"
    for body, problem in ((chunk + b"N}X\t\x00\x00\x00__class__cpathlib\nPosixPath\ns\x86b.", "sets slot attributes"),
                          (chunk + b"}X\x0c\x00\x00\x00__setstate__ctorch\nSize\nsb.", "sets a special attribute")):
        (tmp_path / "ck" / ".metadata").write_bytes(b"\x80\x04" + body)
        with pytest.raises(CheckpointFailure, match=rf"not a DCP checkpoint's metadata \(UnpicklingError: {problem}"):
            dcp.metadata(tmp_path / "ck")


def _doubling(depth: int, *, as_key: bool) -> bytes:
    """A pickle whose value doubles `depth` times through the memo (t = (t, t)): ~7 bytes a level, 2^depth
    work to hash or print; used as a mapping's key, or as torch.Size's argument."""
    out = b"\x80\x04" + (b"}" if as_key else b"ctorch\nSize\n") + b")\x94"
    for i in range(depth):
        out += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"
    return out + (b"K\x01s." if as_key else b"\x85R.")


@pytest.mark.parametrize("as_key", [True, False], ids=["mapping-key", "call-argument"])
def test_a_value_that_doubles_through_the_memo_is_refused_before_it_is_hashed_or_printed(tmp_path, as_key):
    import time

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".metadata").write_bytes(_doubling(60, as_key=as_key))  # ~430 bytes, 2^60 to hash
    started = time.monotonic()
    with pytest.raises(CheckpointFailure, match=r"not a DCP checkpoint's metadata \(UnpicklingError: (keys a mapping"
                                                r" by a tuple|calls a global with other than plain arguments)"):
        dcp.metadata(tmp_path / "ck")
    assert time.monotonic() - started < 2


def test_a_pieces_layout_that_doubles_is_refused_in_a_short_line(tmp_path):
    deep: list = []
    for _ in range(40):
        deep = [deep, deep]
    ck = _with_piece(tmp_path, _piece(_layout_pickle(size=deep)))
    with pytest.raises(CheckpointFailure, match=r"is damaged \(UnpicklingError: calls a global with other than plain"
                                                r" arguments") as info:
        dcp.model_weights(ck)
    assert len(str(info.value)) < 1000


def _piece(data_pkl: bytes, payload: bytes = b"\0" * 24, *, compress: frozenset[str] = frozenset()) -> bytes:
    """A torch.save'd tensor's zip with its data.pkl (and any record named in `compress`, deflated)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in (("archive/data.pkl", data_pkl), ("archive/byteorder", b"little"),
                           ("archive/data/0", payload), ("archive/version", b"3\n")):
            z.writestr(zipfile.ZipInfo(name), data,
                       compress_type=zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED)
    return out.getvalue()


def _with_piece(tmp_path: Path, piece: bytes) -> Path:
    """A checkpoint of model.w (6 float32) whose one stored piece is `piece`."""
    ck = _save(tmp_path / "ck")
    (ck / "__0_0.distcp").write_bytes(piece)
    meta = _meta(ck)
    for info in meta.storage_data.values():
        info.offset, info.length = 0, len(piece)
    _put_meta(ck, meta)
    return ck


def _layout_pickle(offset=0, size=(6,), stride=(1,)) -> bytes:
    storage = object()

    class Tensor:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, collections.OrderedDict()))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", 6) if obj is storage else None

    out = io.BytesIO()
    Pickler(out, protocol=2).dump(Tensor())
    return out.getvalue()


def test_a_pieces_pickle_cannot_rewrite_the_readers_own_functions(tmp_path):
    defaults = direct_read._rebuild.__defaults__
    evil = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}X\x0c\x00\x00\x00__defaults__K\x01K\x02\x86s\x86b."
    ck = _with_piece(tmp_path, _piece(evil))
    try:
        for read in (lambda: dcp.model_weights(ck), lambda: dcp.check(ck)):
            with pytest.raises(CheckpointFailure, match=r"__0_0\.distcp: the record of model\.w at byte 0 is damaged"
                                                        r" \(UnpicklingError: sets the attributes of a function"):
                read()
        assert direct_read._rebuild.__defaults__ == defaults
    finally:
        direct_read._rebuild.__defaults__ = defaults
    assert torch.equal(dcp.model_weights(_with_piece(tmp_path / "ok", _piece(_layout_pickle(),
                       torch.arange(6.0).numpy().tobytes())))["w"], torch.arange(6.0))


@pytest.mark.parametrize(("layout", "problem"), [({"offset": "0"}, "offset a str"), ({"size": [6]}, "size a list"),
                                                 ({"offset": -1}, "offset -1"), ({"stride": (1, 1)}, "stride \\(1, 1\\)")])
def test_every_layout_field_has_the_type_it_must_have(tmp_path, layout, problem):
    ck = _with_piece(tmp_path, _piece(_layout_pickle(**layout)))
    with pytest.raises(CheckpointFailure, match=rf"the record of model\.w at byte 0 is damaged .*{problem}"):
        dcp.model_weights(ck)


def test_metadata_fields_of_the_wrong_type_or_range_are_refused(tmp_path):
    ck = _save(tmp_path / "ck")
    for edit, problem in ((lambda m: setattr(next(iter(m.storage_data.values())), "offset", -5), r"offset -5"),
                          (lambda m: setattr(next(iter(m.storage_data.values())), "length", "8"), r"length '8'"),
                          (lambda m: setattr(m.state_dict_metadata["model.w"], "size", [6]), r"malformed tensor"),
                          (lambda m: setattr(m.state_dict_metadata["model.w"].chunks[0], "sizes", torch.Size([7])),
                           r"a piece outside its tensor"),
                          (lambda m: setattr(m, "planner_data", {"model.w": 5}), r"planner_data"),
                          (lambda m: setattr(m.state_dict_metadata["model.w"].properties, "dtype", torch.qint8),
                           r"a dtype no plain tensor has"),
                          (lambda m: setattr(m.state_dict_metadata["model.w"].chunks[0], "sizes", torch.Size([5])),
                           r"'model\.w''s pieces do not cover its tensor exactly once"),
                          (lambda m: m.storage_data.clear(), r"stores some tensor's piece nowhere"),
                          (lambda m: setattr(next(iter(m.storage_data.values())), "length", 10),
                           r"piece of 'model\.w' needs more bytes than the 10 stored")):
        meta = _meta(_save(tmp_path / "fresh"))
        edit(meta)
        _put_meta(ck, meta)
        with pytest.raises(CheckpointFailure, match=problem):
            dcp.metadata(ck)


# --- 5. no record inflates past its piece ---------------------------------------------------------------

@pytest.mark.parametrize("record", ["archive/data.pkl", "archive/data/0"])
def test_a_compressed_record_that_would_inflate_is_refused_before_it_is_read(tmp_path, record):
    """The issue's bomb was 510 KB inflating to 512 MiB; 16 MiB of zeros in 16 KB is the same shape.
    Refused before anything is inflated, on the direct path and DCP's fallback (a data.pkl naming a
    global the direct reader leaves to DCP)."""
    bomb = b"\x80\x02." + b"\0" * (16 << 20)
    assert len(zlib.compress(bomb)) < 32 << 10
    pkl = _layout_pickle() if record != "archive/data.pkl" else bomb
    payload = b"\0" * (16 << 20) if record == "archive/data/0" else b"\0" * 24
    ck = _with_piece(tmp_path, _piece(pkl, payload, compress=frozenset({record})))
    assert (ck / "__0_0.distcp").stat().st_size < 64 << 10
    with pytest.raises(CheckpointFailure, match=rf"is damaged \(ValueError: its record .*{record.rsplit('/', 1)[-1]}"
                                                rf" inflates to ({16 << 20}|{(16 << 20) + 3}) bytes, more than the piece's"):
        dcp.model_weights(ck)


def test_the_metadata_file_is_read_only_as_a_regular_file_of_bounded_size(tmp_path, monkeypatch):
    ck = _save(tmp_path / "ck")
    monkeypatch.setattr(dcp_metadata, "_METADATA_MAX_BYTES", 64)
    with pytest.raises(CheckpointFailure, match=r"ck/\.metadata: \d+ bytes, over the 64 a checkpoint's metadata may have"):
        dcp.metadata(ck)
    monkeypatch.undo()
    os.replace(ck / ".metadata", tmp_path / "real")
    os.mkfifo(ck / ".metadata")
    with pytest.raises(CheckpointFailure, match=r"ck/\.metadata: not a regular file"):
        dcp.metadata(ck)
