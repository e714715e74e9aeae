"""Sharded checkpoints under FSDP (ballast.training.checkpoint.dcp), with real torchrun processes on gloo:
one shard set per rank and no file holding the whole state, exact resume at the same world size,
resharding to another (2 -> 4, 4 -> 2) restoring every parameter and optimizer value element for
element, a rank killed in the middle of a sharded save leaving the previous checkpoint the valid one, the
gate refusing a corrupted shard, pruning, and resuming from the mean of the last checkpoints per shard.
The full state is gathered only here, in the test (tests/sharded_worker.py), never by the trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ballast.training import checkpoint as ckpt
from ballast.training.checkpoint import dcp, gate
from ballast.training.failure import CheckpointFailure
from helpers import torchrun
from workload_data import lm_config

pytestmark = pytest.mark.integration
WORKER = Path(__file__).with_name("sharded_worker.py")
FSDP = {"distributed.parallelism": "fsdp", "checkpoint.every_steps": 4, "checkpoint.keep_last": 2}


def _train(tmp: Path, lm, procs: int, *, changes: dict | None = None, restarts: int = 0) -> subprocess.CompletedProcess:
    ctx, cache = lm
    cfg = lm_config(tmp, ctx, cache, changes={**FSDP, **(changes or {})}, procs=procs)
    run = subprocess.run(torchrun(cfg, "--standalone", f"--nproc-per-node={procs}", f"--max-restarts={restarts}"),
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def _worker(tmp: Path, lm, procs: int, *args: str) -> subprocess.CompletedProcess:
    """The test worker on the run config under `tmp` (its checkpoints), at `procs` processes."""
    ctx, cache = lm
    cfg = lm_config(tmp, ctx, cache, changes=FSDP, procs=procs)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
            str(WORKER), str(cfg), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)


def _saved(path: Path) -> tuple[dict, dict]:
    """(model, optimizer state) of a sharded checkpoint, read whole (test only) through DCP's reader."""
    import torch
    import torch.distributed.checkpoint as dcp_api

    meta = dcp.metadata(path)
    full = {k: torch.empty(tuple(e.size), dtype=e.properties.dtype) for k, e in meta.state_dict_metadata.items()}
    dcp_api.load(full, storage_reader=dcp.reader(path), no_dist=True)
    model = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    optim = {k[len("optim."):]: v for k, v in full.items() if k.startswith("optim.")}
    return model, optim


def _bytes_per_file(path: Path) -> dict[str, int]:
    """Tensor bytes each shard file of a sharded checkpoint holds, by DCP's metadata."""
    import math

    meta, held = dcp.metadata(path), {}
    for index, info in meta.storage_data.items():
        entry = meta.state_dict_metadata[index.fqn]
        chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
        held[info.relative_path] = held.get(info.relative_path, 0) + math.prod(chunk.sizes) * entry.properties.dtype.itemsize
    return held


def _flat_optim(state: dict) -> dict:
    return {f"{fqn}.{name}": v for fqn, entry in state.items() for name, v in entry.items()}


def _assert_equal(a: dict, b: dict, what: str) -> None:
    import torch

    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())[:5]}"
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k].reshape(v.shape)), f"{what}: {k} differs"


@pytest.mark.parametrize("procs,other", [(2, 4), (4, 2)])
def test_each_rank_writes_its_shards_and_a_resume_at_another_world_size_reshards(tmp_path, lm_cache, procs, other):
    run = _train(tmp_path, lm_cache, procs, changes={"rehearsal.max_steps": 9})
    assert "has no ballast_blocks" not in run.stdout
    path = ckpt.committed(tmp_path / "ckpt")[-1]
    files = set(ckpt.verify(path)["files"])
    shards = sorted(f for f in files if f.endswith(".distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(procs)] and ".metadata" in files
    assert not files & {"model.pt", "optim-part0.pt"}
    assert json.loads((path / "trainer.json").read_text())["state_format"] == "dcp"
    model, optim = _saved(path)
    total = sum(t.numel() * t.element_size() for t in [*model.values(), *optim.values()])
    # One shard set per rank: by DCP's own index, each file holds about its rank's share of the state.
    held = _bytes_per_file(path)
    assert sorted(held) == shards and sum(held.values()) == total
    assert max(held.values()) < 1.1 * total / procs, (held, total)
    gate.check(path)
    # The orchestrator's stages rebuild the model from the shards (verify_checkpoint's probe, evaluate).
    from ballast.stages.verify_checkpoint import load_model

    _assert_equal(model, {k: v for k, v in load_model(path).state_dict().items()}, "rebuilt model")
    # Another world size: every rank reads its new pieces; gathered (here only) they are what was saved.
    done = _worker(tmp_path, lm_cache, other, "dump", str(tmp_path / "restored.pt"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"world size changed {procs} -> {other}" in done.stdout
    import torch

    restored = torch.load(tmp_path / "restored.pt", weights_only=True)
    assert restored["step"] == ckpt.step_of_name(path.name)
    _assert_equal(model, restored["model"], "model")
    _assert_equal(optim, _flat_optim(restored["optim"]), "optimizer")


@pytest.mark.parametrize("procs", [2, 4])
def test_a_crashed_rank_resumes_bit_exact_at_the_same_world_size(tmp_path, lm_cache, procs):
    _train(tmp_path / "ref", lm_cache, procs, changes={"rehearsal.max_steps": 14})
    run = _train(tmp_path / "killed", lm_cache, procs, restarts=2,
                 changes={"rehearsal.max_steps": 14, "rehearsal.faults": [{"kind": "crash", "step": 10, "rank": 1}]})
    assert "resumed from" in run.stdout, run.stdout[-3000:]
    a, b = ckpt.committed(tmp_path / "ref" / "ckpt")[-1], ckpt.committed(tmp_path / "killed" / "ckpt")[-1]
    assert a.name == b.name == "step-00000014"
    for x, y, what in zip(_saved(a), _saved(b), ("model", "optimizer")):
        _assert_equal(x, y, what)
    # Pruning kept the last two and removed the rest, shards and all.
    assert [p.name for p in ckpt.committed(tmp_path / "killed" / "ckpt")] == ["step-00000012", "step-00000014"]


@pytest.mark.parametrize("mode", ["crash-save", "crash-write"])
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_valid(tmp_path, lm_cache, mode):
    """Rank 1 dies after writing its shard (before the commit), or in the middle of writing it."""
    _train(tmp_path, lm_cache, 2, changes={"rehearsal.max_steps": 4})
    root = tmp_path / "ckpt"
    before = ckpt.committed(root)
    crashed = _worker(tmp_path, lm_cache, 2, mode)
    assert crashed.returncode != 0
    partial = root / ".step-00000005.tmp"
    assert (partial / "__1_0.distcp").is_file()
    if mode == "crash-write":  # a part of rank 1's shard on disk, nothing in any manifest
        assert 1 << 16 < (partial / "__1_0.distcp").stat().st_size and not (partial / "manifest.json").exists()
    assert ckpt.committed(root) == before and not (root / "step-00000005").exists()
    assert gate.latest_passing(root, quarantine_failures=False) == before[-1]
    dumped = _worker(tmp_path, lm_cache, 2, "dump", str(tmp_path / "restored.pt"))
    assert dumped.returncode == 0 and f"resumed from {before[-1]}" in dumped.stdout, dumped.stderr[-3000:]


def test_the_gate_quarantines_a_sharded_checkpoint_with_a_corrupted_shard(tmp_path, lm_cache):
    import torch

    _train(tmp_path, lm_cache, 2, changes={"rehearsal.max_steps": 8})
    root = tmp_path / "ckpt"
    older, newest = ckpt.committed(root)
    # A shard whose bytes changed: the manifest's sha256 refuses it.
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointFailure, match=r"__1_0\.distcp: sha256 does not match the manifest"):
        gate.check(newest)
    # A shard holding NaN, committed as such (its manifest agrees): the contents check names the shard.
    meta = dcp.metadata(older)
    index, info = next((i, s) for i, s in meta.storage_data.items() if i.fqn.startswith("model.blocks.0.mlp"))
    fqn, f = index.fqn, older / info.relative_path
    chunk = next(c for c in meta.state_dict_metadata[fqn].chunks if tuple(c.offsets) == tuple(index.offset))
    whole = _saved(older)[0][fqn[len("model."):]]
    mine = whole[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))].contiguous().numpy().tobytes()
    raw = f.read_bytes()
    at = raw.index(mine)  # this rank's piece of the tensor, where the shard file holds it
    f.write_bytes(raw[:at] + torch.full((len(mine) // 4,), float("nan")).numpy().tobytes() + raw[at + len(mine):])
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["files"][f.name] = {"size": f.stat().st_size, "sha256": ckpt.sha256_file(f)}
    (older / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointFailure, match=rf"{info.relative_path}: non-finite values in {fqn}"):
        gate.check(older)
    assert gate.latest_passing(root) is None
    assert sorted(r["checkpoint"] for r in gate.quarantined(root)) == [older.name, newest.name]


def test_resume_from_the_mean_of_the_last_sharded_checkpoints(tmp_path, lm_cache):
    import torch

    _train(tmp_path, lm_cache, 2, changes={"rehearsal.max_steps": 12, "checkpoint.keep_last": 3})
    paths = ckpt.committed(tmp_path / "ckpt")
    assert len(paths) == 3
    models = [_saved(p)[0] for p in paths]
    ctx, cache = lm_cache
    lm_config(tmp_path, ctx, cache, changes={**FSDP, "checkpoint.keep_last": 3, "checkpoint.resume_average_last": 3})
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(WORKER),
            str(tmp_path / "run.json"), "dump", str(tmp_path / "restored.pt")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from the average of 3 checkpoints" in done.stdout
    restored = torch.load(tmp_path / "restored.pt", weights_only=True)["model"]
    for k, v in restored.items():
        mean = (torch.stack([m[k].double() for m in models]).mean(0)).to(v.dtype)
        assert torch.allclose(v, mean, rtol=0, atol=1e-6), k
    assert any(not torch.equal(restored[k], models[-1][k]) for k in restored)  # not just the newest
    # The export CLI reads sharded checkpoints too (the mean model in one file is what it exports).
    from ballast.training.checkpoint.average import main

    assert main([str(tmp_path / "ckpt"), "--last", "3", "--out", str(tmp_path / "mean.pt")]) == 0
    exported = torch.load(tmp_path / "mean.pt", weights_only=True)
    for k, v in exported.items():
        assert torch.allclose(v, restored[k], rtol=0, atol=1e-6), k
    # Only checkpoints that pass the gate are averaged: the oldest, damaged, is left out (the ranks agree).
    shard = paths[0] / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from the average of 2 checkpoints" in done.stdout, done.stdout[-3000:]
    assert f"not averaged: {shard}: sha256 does not match the manifest" in done.stdout
    restored = torch.load(tmp_path / "restored.pt", weights_only=True)["model"]
    for k, v in restored.items():
        mean = (torch.stack([m[k].double() for m in models[1:]]).mean(0)).to(v.dtype)
        assert torch.allclose(v, mean, rtol=0, atol=1e-6), k


def test_bf16_with_activation_checkpointing_trains_sharded_and_resumes(tmp_path, lm_cache):
    """FSDP's bf16 mixed-precision policy and per-block activation checkpointing, under torchrun: the
    sharded parameters and optimizer state stay fp32, and a second run resumes from the shards."""
    import torch

    opts = {"numerics.precision": "bf16", "distributed.activation_checkpointing": True}
    _train(tmp_path, lm_cache, 2, changes={**opts, "rehearsal.max_steps": 5})
    first = ckpt.committed(tmp_path / "ckpt")[-1]
    model, optim = _saved(first)
    assert {v.dtype for v in model.values()} == {torch.float32} and optim
    gate.check(first)
    again = _train(tmp_path, lm_cache, 2, changes={**opts, "rehearsal.max_steps": 8})
    assert f"resumed from {first}" in again.stdout
    assert ckpt.committed(tmp_path / "ckpt")[-1].name == "step-00000008"
