"""Checkpoints between a node's disk and storage (issue 21, item 7): `keep_last` prunes storage as it
prunes the disk, a node pulls only what it resumes from, a replaced checkpoint loses its marker before
its files, and pushing and pruning trust a checkpoint only when it verifies (`training.checkpoint.verify`),
never because its COMMITTED marker exists."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from test_storage_s3 import bucket, s3_endpoint, s3_env  # noqa: F401  (moto's server on loopback)

from ballast.storage import checkpoints as checkpoint_sync
from ballast.pipeline.context import RunContext
from ballast.spec import parse_spec
from helpers import example_data
from ballast.training import checkpoint as ckpt
from ballast.training.checkpoint import gate

BACKENDS = [pytest.param("local", marks=pytest.mark.unit), pytest.param("s3", marks=pytest.mark.integration)]


@pytest.fixture(params=BACKENDS)
def storage_uri(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    return f"s3://{request.getfixturevalue('bucket')}/{uuid.uuid4().hex}"  # the bucket outlives a test


def context(uri: str, **checkpoint) -> RunContext:
    d = example_data()
    d["storage"]["uri"] = uri
    d["training"]["checkpoint"] = {**(d["training"].get("checkpoint") or {}), **checkpoint}
    return RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id="r1")


def save(saver: ckpt.AsyncSaver, step: int, *, best: int | None = None) -> None:
    import torch

    state = {"step": step, "best": {"step": best, "epoch": 0, "value": 0.5} if best else None}
    saver.save(step, {"model.pt": {"w": torch.ones(3) * step}}, {ckpt.TRAINER_STATE: state},
               keep={best} if best else set(), asynchronous=False)


def stored(ctx: RunContext) -> list[str]:
    return [n.rstrip("/") for n in ctx.storage.list_dir(f"{ctx.run_key}/checkpoints/")]


def steps(*numbers: int) -> list[str]:
    return [ckpt.step_dir_name(n) for n in numbers]


def test_keep_last_prunes_storage_as_it_prunes_the_disk(storage_uri, tmp_path):
    """keep_last 2 over four saves, each pushed as a node's sync does: two checkpoints in storage."""
    ctx = context(storage_uri, keep_last=2)
    saver = ckpt.AsyncSaver(tmp_path / "ckpt", rank=0, barrier=lambda: None, keep_last=2)
    for step in (10, 20, 30, 40):
        save(saver, step)
        checkpoint_sync.push(ctx, tmp_path / "ckpt")
    assert stored(ctx) == steps(30, 40)
    assert [p.name for p in ckpt.committed(tmp_path / "ckpt")] == steps(30, 40)
    assert not any(f"/{steps(10)[0]}/" in k for k in ctx.storage.list(f"{ctx.run_key}/"))  # every file of it gone
    # The best checkpoint stays beside the last two, in storage as on the disk.
    for step in (50, 60):
        save(saver, step, best=40)
        checkpoint_sync.push(ctx, tmp_path / "ckpt")
    assert stored(ctx) == steps(40, 50, 60)


def test_a_node_resuming_pulls_only_the_checkpoint_it_resumes_from(storage_uri, tmp_path, caplog):
    ctx = context(storage_uri, keep_last=5)
    saver = ckpt.AsyncSaver(tmp_path / "worker", rank=0, barrier=lambda: None, keep_last=5)
    for step in (10, 20, 30):
        save(saver, step)
    checkpoint_sync.push(ctx, tmp_path / "worker")
    assert checkpoint_sync.pull_for_resume(ctx, tmp_path / "node1") == steps(30)
    assert sorted(p.name for p in (tmp_path / "node1").iterdir()) == steps(30)
    ckpt.verify(tmp_path / "node1" / steps(30)[0])
    # Averaging the last two on resume takes two; a damaged newest one in storage is skipped, not kept.
    ctx = context(storage_uri, keep_last=5, resume_average_last=2)
    key = f"{ctx.run_key}/checkpoints/{steps(30)[0]}/model.pt"
    ctx.storage.write_bytes(key, bytes(len(ctx.storage.read_bytes(key))))
    with caplog.at_level(logging.WARNING, logger="ballast"):
        assert checkpoint_sync.pull_for_resume(ctx, tmp_path / "node2") == steps(10, 20)
    assert sorted(p.name for p in (tmp_path / "node2").iterdir()) == steps(10, 20)
    assert "model.pt: sha256 does not match the manifest" in caplog.text
    # checkpoint.resume false: the node starts from step 0 and pulls nothing.
    assert checkpoint_sync.pull_for_resume(context(storage_uri, resume=False), tmp_path / "node3") == []
    # Non-finite weights verify against their manifest but fail the resume gate: the node goes on to the
    # next (30 is damaged in storage above), as the trainer's resume would have.
    import torch

    saver.save(40, {"model.pt": {"w": torch.full((3,), float("nan"))}}, {ckpt.TRAINER_STATE: {"step": 40}},
               keep=set(), asynchronous=False)
    checkpoint_sync.push(ctx, tmp_path / "worker")
    assert checkpoint_sync.pull_for_resume(context(storage_uri, keep_last=5), tmp_path / "node4") == steps(20)
    assert sorted(p.name for p in (tmp_path / "node4").iterdir()) == steps(20)


def test_pushing_a_checkpoint_whose_marker_exists_but_manifest_fails_is_refused(storage_uri, tmp_path, caplog):
    ctx = context(storage_uri, keep_last=5)
    saver = ckpt.AsyncSaver(tmp_path / "ckpt", rank=0, barrier=lambda: None, keep_last=5)
    save(saver, 10)
    save(saver, 20)
    bad = tmp_path / "ckpt" / steps(20)[0] / "model.pt"
    bad.write_bytes(bytes(bad.stat().st_size))  # the marker and the manifest stay; the weights do not match
    with caplog.at_level(logging.WARNING, logger="ballast"):
        pushed = checkpoint_sync.push(ctx, tmp_path / "ckpt")
    assert [p.rsplit("/", 1)[-1] for p in pushed] == steps(10)
    assert stored(ctx) == steps(10)
    assert "not uploaded" in caplog.text and "sha256 does not match the manifest" in caplog.text


def test_a_pushed_checkpoint_saved_again_is_replaced_marker_first(storage_uri, tmp_path):
    """The same step saved again after a resume: storage gets the new files, never the old marker over them."""
    ctx = context(storage_uri, keep_last=5)
    saver = ckpt.AsyncSaver(tmp_path / "ckpt", rank=0, barrier=lambda: None, keep_last=5)
    save(saver, 10)
    checkpoint_sync.push(ctx, tmp_path / "ckpt")
    import torch

    saver.save(10, {"model.pt": {"w": torch.zeros(3)}}, {ckpt.TRAINER_STATE: {"step": 10}}, keep=set(),
               asynchronous=False)
    deleted = []
    real_delete = ctx.storage.delete
    ctx.storage.delete = lambda key: (deleted.append(key), real_delete(key))[1]
    assert len(checkpoint_sync.push(ctx, tmp_path / "ckpt")) == 1
    assert deleted[0].endswith(f"{steps(10)[0]}/{ckpt.COMMIT_MARKER}")
    checkpoint_sync.pull(ctx, tmp_path / "back")
    back = ckpt.load_tensors(tmp_path / "back" / steps(10)[0] / "model.pt")
    assert back["w"].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.unit
def test_a_replace_interrupted_after_removing_the_marker_is_not_valid(tmp_path, monkeypatch):
    """A crash while the old directory of a step saved again is being removed leaves no marker over
    what remains of it."""
    import shutil

    import torch

    from ballast.training.checkpoint import commit

    saver = ckpt.AsyncSaver(tmp_path, rank=0, barrier=lambda: None, keep_last=5)
    save(saver, 10)

    def crash(path, *args, **kwargs):
        (Path(path) / "model.pt").unlink()  # part of the old directory is gone when the process dies
        raise OSError("killed")

    monkeypatch.setattr(commit.shutil, "rmtree", crash)
    w = ckpt.Writer(tmp_path, 10, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", {"w": torch.zeros(3)})
    with pytest.raises(OSError, match="killed"):
        w.commit()
    monkeypatch.setattr(commit.shutil, "rmtree", shutil.rmtree)
    old = tmp_path / steps(10)[0]
    assert not ckpt.is_committed(old) and ckpt.committed(tmp_path) == []
    assert gate.latest_passing(tmp_path, quarantine_failures=False) is None
    with pytest.raises(ckpt.CheckpointFailure, match="no COMMITTED marker"):
        ckpt.verify(old)


@pytest.mark.unit
def test_pruning_counts_only_checkpoints_that_verify(tmp_path):
    """The newest checkpoint's marker is there but its weights do not match: pruning keeps the two
    newest that verify, and leaves the damaged one for the gate to quarantine."""
    saver = ckpt.AsyncSaver(tmp_path, rank=0, barrier=lambda: None, keep_last=5)
    for step in (10, 20, 30):
        save(saver, step)
    bad = tmp_path / steps(30)[0] / "model.pt"
    bad.write_bytes(bytes(bad.stat().st_size))
    ckpt.prune(tmp_path, keep_last=2)
    assert [p.name for p in ckpt.committed(tmp_path)] == steps(10, 20, 30)
    assert gate.latest_passing(tmp_path, quarantine_failures=False, log=lambda _: None) == tmp_path / steps(20)[0]
    save(saver, 40)
    ckpt.prune(tmp_path, keep_last=2)
    assert [p.name for p in ckpt.committed(tmp_path)] == steps(20, 30, 40)


@pytest.mark.unit
def test_a_background_write_shortens_the_switch_interval_while_it_runs_and_restores_it(tmp_path):
    """Training waits for the GIL up to one switch interval each time it comes back from an op, while the
    writer holds it in DCP's Python code: the writer shortens the interval for its write, a synchronous save
    (training's own thread) leaves it as it is."""
    import sys

    import torch
    from ballast.training.checkpoint.saver import SWITCH_INTERVAL

    seen = []
    saver = ckpt.AsyncSaver(tmp_path / "ckpt", rank=0, barrier=lambda: None, keep_last=2,
                            on_written=lambda step, s, cpu: seen.append((step, sys.getswitchinterval())))
    before = sys.getswitchinterval()
    for step, asynchronous in ((1, True), (2, False)):
        saver.save(step, {"model.pt": {"w": torch.ones(4)}}, {ckpt.TRAINER_STATE: {"step": step}}, keep=set(),
                   asynchronous=asynchronous)
        saver.wait()
        assert sys.getswitchinterval() == before
    assert seen == [(1, SWITCH_INTERVAL), (2, before)] and SWITCH_INTERVAL < before
