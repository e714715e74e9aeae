"""The resume gate split between ranks (`gate.latest_passing(share=, agree=)`): each rank hashes and
reads its share of a checkpoint's files and tensors, so a resume reads the checkpoint once for the gate
however many ranks there are, and the ranks agree on the outcome (one rank's failure skips the
checkpoint on all of them; a checkpoint one rank's disk lacks is no candidate)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ballast.training import checkpoint as ckpt
from ballast.training.checkpoint import commit, gate

pytestmark = pytest.mark.unit


def _save(root: Path, step: int, files: int = 5) -> Path:
    import torch

    saver = ckpt.AsyncSaver(root, rank=0, barrier=lambda: None, keep_last=10)
    tensors = {f"part{i}.pt": {"w": torch.full((64,), float(step + i))} for i in range(files)}
    saver.save(step, tensors, {ckpt.TRAINER_STATE: {"step": step}}, keep=set(), asynchronous=False)
    saver.wait()
    return root / ckpt.step_dir_name(step)


def _hashed(monkeypatch) -> list[str]:
    names: list[str] = []
    real = commit.sha256_file
    monkeypatch.setattr(commit, "sha256_file", lambda path, *a, **k: (names.append(Path(path).name),
                                                                      real(path, *a, **k))[1])
    return names


def test_the_shares_hash_every_file_once_and_only_the_share_holding_a_damaged_one_fails(tmp_path, monkeypatch):
    path = _save(tmp_path, 10)
    hashed = _hashed(monkeypatch)
    parts = 3
    for part in range(parts):
        gate.check(path, share=(part, parts))
    files = sorted(commit.verify(path)["files"])
    assert sorted(hashed[:-len(files)]) == files  # the three shares together: each file once (then verify's own)
    damaged = path / "part3.pt"
    damaged.write_bytes(bytes(damaged.stat().st_size))
    failed = []
    for part in range(parts):
        try:
            gate.check(path, share=(part, parts))
        except ckpt.CheckpointFailure as exc:
            failed.append((part, str(exc)))
    assert [p for p, _ in failed] == [files.index("part3.pt") % parts]
    assert "part3.pt: sha256 does not match the manifest" in failed[0][1]
    # a truncated file is every share's failure: sizes are checked by all
    damaged.write_bytes(b"x")
    for part in range(parts):
        with pytest.raises(ckpt.CheckpointFailure, match=r"part3\.pt: size 1 does not match"):
            gate.check(path, share=(part, parts))


def test_ranks_agree_one_ranks_failure_skips_the_checkpoint_on_all(tmp_path):
    older, newest = _save(tmp_path, 10), _save(tmp_path, 20)
    calls: list = []

    def agree(value):  # rank 0 of 2; the peer sees both checkpoints and fails the newest
        calls.append(value)
        if isinstance(value, list):
            return [value, [newest.name, older.name]]
        return [value, f"{newest}/part1.pt: sha256 does not match the manifest" if len(calls) == 2 else None]

    logs: list[str] = []
    got = gate.latest_passing(tmp_path, quarantine_failures=False, log=logs.append, share=(0, 2), agree=agree)
    assert got == older and calls == [[newest.name, older.name], None, None]
    assert logs == [f"checkpoint skipped: {newest}/part1.pt: sha256 does not match the manifest"]


def test_a_checkpoint_one_rank_lacks_is_no_candidate(tmp_path):
    older, _newest = _save(tmp_path, 10), _save(tmp_path, 20)

    def agree(value):  # the peer's disk holds only the older one (a save committed on this node only)
        return [value, [older.name]] if isinstance(value, list) else [value, None]

    assert gate.latest_passing(tmp_path, quarantine_failures=False, log=lambda _: None, share=(0, 2),
                               agree=agree) == older


def _save_sharded(root: Path, step: int) -> tuple[Path, dict]:
    import torch

    from ballast.training.checkpoint import dcp

    model = {"w": torch.randn(8, 4), "b": torch.zeros(4)}
    state = {dcp.MODEL: model, dcp.OPTIM: {"w": {"exp_avg": torch.ones(8, 4)}}}
    saver = ckpt.AsyncSaver(root, rank=0, barrier=lambda: None, keep_last=10)
    saver.save(step, {}, {ckpt.TRAINER_STATE: {"step": step}}, keep=set(), asynchronous=False,
               shards=lambda d: dcp.write(state, d, rank=0, group=None))
    saver.wait()
    return root / ckpt.step_dir_name(step), model


def test_the_launch_gate_gives_a_sharded_checkpoint_no_forward_pass_and_gathers_nothing(tmp_path, monkeypatch):
    from ballast.training.checkpoint import dcp

    path, _ = _save_sharded(tmp_path, 10)
    seen: list[Path] = []

    def probe(p):
        seen.append(p)
        return float("nan")

    gathered: list[Path] = []
    real = dcp.model_weights
    monkeypatch.setattr(dcp, "model_weights", lambda p: (gathered.append(p), real(p))[1])
    gate.check(path, probe=probe, probe_sharded=False)  # hashes and values only
    assert seen == [] and gathered == []
    with pytest.raises(ckpt.CheckpointFailure, match="a forward pass on a held-out batch gives loss nan"):
        gate.check(path, probe=probe)  # the verification stage's: the probe reads the pieces it needs
    assert gathered == [] and seen == [path]  # itself (whole or block by block: checkpoint.streamed)
