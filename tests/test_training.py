"""The trainer under real torchrun processes (gloo on CPU), its checkpoints and its failure contract."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ballast.launch.config import run_config, torchrun_argv
from ballast.recovery.adapt import adapt_micro_batch
from ballast.spec import load_spec, parse_spec
from ballast.stages import convert, validate, warm_cache
from helpers import EXAMPLE_SPEC, example_data, make_ctx, run_chain, warm_cache_rest, write_raw

from ballast.training import checkpoint as ckpt
from ballast.training.checkpoint import gate
from ballast.training.failure import EXIT_CODES


def launch(tmp: Path, cache: dict, *, epochs: int, edit=None, out: str = "out") -> tuple[subprocess.CompletedProcess, Path]:
    d = example_data()
    d["training"]["epochs"] = epochs
    d["evaluation"]["patience"] = 50
    if edit:
        edit(d)
    spec = parse_spec(d)
    out_dir = tmp / out
    out_dir.mkdir(exist_ok=True)
    cfg = run_config(spec, data_dir=cache.cache_dir, data_format=cache.format,
                     checkpoint_dir=str(tmp / "ckpt"), output_dir=str(out_dir))
    cfg.dump(out_dir / "run.json")
    proc = subprocess.run(torchrun_argv(spec, out_dir / "run.json"), capture_output=True, text=True, timeout=300)
    return proc, out_dir


@pytest.mark.integration
def test_torchrun_two_processes_train_and_commit_checkpoints(tmp_path, digits_cache):
    proc, out = launch(tmp_path, digits_cache, epochs=4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 4
    assert summary["best"]["value"] > 0.85
    done = ckpt.committed(tmp_path / "ckpt")
    assert 1 <= len(done) <= 4  # keep_last 3, plus the best
    for path in done:
        ckpt.verify(path)
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {e["event"] for e in events} >= {"step", "epoch", "checkpoint", "checkpoint_written", "grad_stats"}
    for e in (e for e in events if e["event"] == "checkpoint_written"):  # the writer's wall and CPU time
        assert 0 < e["write_cpu_seconds"] and e["write_seconds"] > 0
    for e in (e for e in events if e["event"] == "grad_stats"):  # every gradient entry is counted once
        counted = sum(e["histogram_log2_abs"]) + e["nonfinite"] + round(e["zero_fraction"] * e["entries"])
        assert counted == e["entries"] > 0 and 0 < e["max_abs"] < 1e3
    # Each rank wrote a share of the (replicated) optimizer state; rank 0's share counts the model.
    newest = done[-1]
    sizes = {p.name: p.stat().st_size for p in newest.glob("*.pt")}
    assert {"model.pt", "optim-part0.pt", "optim-part1.pt", "rng-rank0.pt", "rng-rank1.pt"} <= set(sizes)
    rank0, rank1 = sizes["model.pt"] + sizes["optim-part0.pt"], sizes["optim-part1.pt"]
    assert 0.5 < rank0 / rank1 < 2.0, sizes


@pytest.mark.integration
def test_resume_from_committed_checkpoint_matches_an_uninterrupted_run(tmp_path, digits_cache):
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir(), b.mkdir()
    full, _ = launch(a, digits_cache, epochs=4)
    assert full.returncode == 0, full.stderr[-3000:]
    first, _ = launch(b, digits_cache, epochs=2)
    assert first.returncode == 0, first.stderr[-3000:]
    second, out = launch(b, digits_cache, epochs=4)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    import torch

    wa = ckpt.load_tensors(ckpt.committed(a / "ckpt")[-1] / "model.pt")
    wb = ckpt.load_tensors(ckpt.committed(b / "ckpt")[-1] / "model.pt")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "resumed weights differ from the uninterrupted run"


@pytest.mark.integration
def test_bad_run_config_exits_with_config_code_and_record(tmp_path, digits_cache):
    d = example_data()
    spec = parse_spec(d)
    cfg = run_config(spec, data_dir=digits_cache.cache_dir, data_format="petastorm",
                     checkpoint_dir=str(tmp_path / "ckpt"), output_dir=str(tmp_path / "out"))
    data = cfg.model_dump(mode="json")
    data["model"]["name"] = "resnet9000"  # past the spec's check: the trainer's own load refuses it too
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "ballast.training", "--config", str(cfg_path)], capture_output=True, text=True)
    assert proc.returncode == EXIT_CODES["config"]
    assert "training.model.name: unknown model 'resnet9000'; registered: cnn, embed, gpt" in proc.stderr


@pytest.mark.integration
def test_missing_data_is_a_data_failure(tmp_path):
    spec = parse_spec(example_data())
    out = tmp_path / "out"
    out.mkdir()
    cfg = run_config(spec, data_dir=str(tmp_path / "nowhere"), data_format="petastorm",
                     checkpoint_dir=str(tmp_path / "ckpt"), output_dir=str(out))
    cfg.dump(tmp_path / "run.json")
    proc = subprocess.run([sys.executable, "-m", "ballast.training", "--config", str(tmp_path / "run.json")],
                          capture_output=True, text=True)
    assert proc.returncode == EXIT_CODES["data"]
    record = json.loads((out / "failure.json").read_text())
    assert record["class"] == "data" and "retryable" not in record
    assert "manifest missing; was the cache warmed?" in record["exception"]


def _fake_checkpoint(root: Path, step: int) -> Path:
    import torch

    w = ckpt.Writer(root, step, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", {"w": torch.ones(3)})
    w.write_json("trainer.json", {"step": step})
    return w.commit()


@pytest.mark.unit
def test_uncommitted_checkpoint_is_invisible_to_resume(tmp_path):
    good = _fake_checkpoint(tmp_path, 10)
    later = _fake_checkpoint(tmp_path, 20)
    (later / ckpt.COMMIT_MARKER).unlink()  # as if killed before the marker landed
    (tmp_path / ".step-00000030.tmp").mkdir()  # a save killed mid-write
    assert gate.latest_passing(tmp_path, quarantine_failures=False) == good
    with pytest.raises(ckpt.CheckpointFailure, match=r"step-00000020: no COMMITTED marker"):
        ckpt.verify(later)


@pytest.mark.unit
def test_tampered_or_truncated_checkpoint_is_refused(tmp_path):
    good = _fake_checkpoint(tmp_path, 10)
    bad = _fake_checkpoint(tmp_path, 20)
    data = bytearray((bad / "model.pt").read_bytes())
    data[-5] ^= 0xFF
    (bad / "model.pt").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointFailure, match=r"model\.pt: sha256 does not match the manifest"):
        ckpt.verify(bad)
    skipped = []
    assert gate.latest_passing(tmp_path, quarantine_failures=False, log=skipped.append) == good
    assert "sha256 does not match" in skipped[0]
    (good / "model.pt").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointFailure, match=r"size 0 does not match the manifest .*truncated"):
        ckpt.verify(good)


@pytest.mark.unit
def test_checkpoint_loads_refuse_pickled_objects(tmp_path):
    import pickle

    evil = tmp_path / "model.pt"

    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    evil.write_bytes(pickle.dumps(Boom()))
    with pytest.raises(ckpt.CheckpointFailure, match=r"model\.pt: cannot load as a tensor file"):
        ckpt.load_tensors(evil)


@pytest.mark.unit
def test_prune_keeps_last_k_and_best(tmp_path):
    for step in (10, 20, 30, 40, 50):
        _fake_checkpoint(tmp_path, step)
    ckpt.prune(tmp_path, keep_last=2, keep={20})
    assert [p.name for p in ckpt.committed(tmp_path)] == ["step-00000020", "step-00000040", "step-00000050"]


@pytest.mark.unit
def test_checkpoint_recorded_model_rebuilds_the_model_without_the_spec(tmp_path):
    import torch

    from ballast.training.config.run import ModelConfig
    from ballast.training.models import build_configured_model

    section = {"name": "mlp", "options": {"hidden_size": 16, "dropout": 0.2},
               "data": {"task": "classification", "input_shape": [4, 4], "input_dtype": "float32", "num_classes": 3,
                        "inputs": {"x": {"shape": [4, 4], "dtype": "float32"}}}}
    trained = build_configured_model(ModelConfig.model_validate(section))
    w = ckpt.Writer(tmp_path, 10, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", trained.state_dict())
    w.write_json("trainer.json", {"step": 10, "model": section})
    good = w.commit()
    recorded = ckpt.recorded_model(good)
    assert recorded == section
    rebuilt = build_configured_model(ModelConfig.model_validate(recorded))
    rebuilt.load_state_dict(ckpt.load_tensors(good / "model.pt"))  # the recorded shapes fit the weights
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.state_dict().values(), trained.state_dict().values()))

    old = _fake_checkpoint(tmp_path, 20)  # trainer.json of a version that recorded no model
    with pytest.raises(ckpt.CheckpointFailure, match=r"step-00000020/trainer\.json: records no model section \(name,"
                                                     r" options, data\); the model cannot be rebuilt"):
        ckpt.recorded_model(old)
    earlier = json.loads((old / "trainer.json").read_text())  # the previous version's: the fields flat
    (old / "trainer.json").write_text(json.dumps({**earlier, "model": "mlp", "input_shape": [4, 4], "num_classes": 3,
                                                  "hidden_size": 16}))
    with pytest.raises(ckpt.CheckpointFailure, match=r"step-00000020/trainer\.json: written by an earlier Ballast"
                                                     r" \(model 'mlp' without its options and data\)"):
        ckpt.recorded_model(old)
    (old / "trainer.json").unlink()
    with pytest.raises(ckpt.CheckpointFailure, match=r"step-00000020/trainer\.json: unreadable trainer state"):
        ckpt.recorded_model(old)


@pytest.mark.unit
def test_launch_specs_are_pure_functions():
    spec = load_spec(EXAMPLE_SPEC)
    argv = torchrun_argv(spec, "/run/cfg.json", python="/py")
    assert argv == ["/py", "-m", "ballast.training.torchrun", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=3",
                    "--monitor-interval=0.1", "--standalone", "--module", "ballast.training", "--config", "/run/cfg.json"]
    multi = parse_spec({**example_data(), "training": {**example_data()["training"], "nodes": 2, "global_batch_size": 128},
                        "execution": {"backend": "slurm", "slurm": {"partition": "debug"}}})
    argv = torchrun_argv(multi, "c.json", python="/py", rdzv_endpoint="head:29400", run_id="r1")
    assert "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=head:29400" in argv and "--standalone" not in argv
    cfg = run_config(spec, data_dir="d", data_format="petastorm", checkpoint_dir="c", output_dir="o",
                     micro_batch_size=16)
    assert (cfg.batch.micro_batch_size, cfg.batch.grad_accum_steps) == (16, 2)  # global batch 64 kept


@pytest.mark.unit
def test_oom_adaptation_keeps_global_batch():
    spec = load_spec(EXAMPLE_SPEC)  # per process: 64 / 2 = 32
    assert adapt_micro_batch(spec, 32, 0.5) == 16
    assert adapt_micro_batch(spec, 16, 0.7) == 8  # 11 does not divide 32
    assert adapt_micro_batch(spec, 1, 0.5) == 1


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["petastorm", "tfrecord"])
def test_epoch_loader_shards_per_rank_and_resumes_mid_epoch(tmp_path, digits_raw, digits_cache, fmt):
    import numpy as np
    import torch

    from ballast.training.dataset.loader import EpochLoader

    if fmt == "tfrecord":
        ctx = make_ctx(tmp_path, digits_raw, lambda d: d["training"].update(data_format="tfrecord"))
        digits_cache = run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)["warm_cache"]

    def collect(rank, workers, start=0, epoch=1, batch=16):
        loader = EpochLoader(Path(digits_cache.cache_dir), fmt=fmt, rank=rank, world=2, seed=5, workers=workers)
        xs, ys = zip(*loader.batches(epoch, batch=batch, start=start))
        return torch.cat(xs), torch.cat(ys), loader

    x0, y0, loader = collect(0, workers=0)
    assert len(y0) == loader.samples_per_rank // 16 * 16
    x2, y2, _ = collect(0, workers=2)
    assert torch.equal(x0, x2) and torch.equal(y0, y2)          # the order does not depend on the workers
    xr, yr, _ = collect(0, workers=2, start=48)                  # resume after three batches of 16
    assert torch.equal(xr, x0[48:]) and torch.equal(yr, y0[48:])
    x1, _, _ = collect(1, workers=2)
    rows0 = {r.numpy().tobytes() for r in x0}
    assert not rows0 & {r.numpy().tobytes() for r in x1}         # ranks see disjoint samples
    xe, _, _ = collect(0, workers=0, epoch=2)
    assert not torch.equal(xe, x0)                               # another epoch, another order
    assert np.isclose(float(x0.sum()), float(collect(0, workers=1)[0].sum()))


@pytest.mark.integration
def test_loader_workers_are_not_forked_while_the_checkpoint_writer_serialises(digits_cache):
    """A worker forked while the writer's thread held a lock inside torch.save kept it held for good and
    hung its rank (CI: a 600 s stall at an epoch's start, just after that epoch's checkpoint). The fork
    waits for the writer's file; the writer's next file waits for the fork."""
    import threading
    import time

    from ballast.training.dataset.loader import EpochLoader
    from ballast.training.forkgate import GATE

    loader = EpochLoader(Path(digits_cache.cache_dir), fmt="petastorm", rank=0, world=2, seed=5, workers=2)
    released = []

    def writer():  # a file being serialised in the background, as AsyncSaver's thread does
        with GATE:
            time.sleep(0.5)
            released.append(time.monotonic())

    t = threading.Thread(target=writer)
    GATE.acquire()
    t.start()
    GATE.release()
    while not GATE.locked():
        time.sleep(0.001)
    batches = loader.batches(1, batch=16)
    next(batches)
    forked_after = time.monotonic()
    t.join()
    assert released and forked_after >= released[0]
    batches.close()


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["petastorm", "tfrecord"])
def test_truncated_or_damaged_shards_are_named(tmp_path, digits_raw, fmt):
    import shutil

    from ballast.training.dataset.reader import load_split
    from ballast.training.failure import DataFailure

    ctx = make_ctx(tmp_path, digits_raw, lambda d: d["training"].update(data_format=fmt))
    cache = Path(run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)["warm_cache"].cache_dir)
    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)
    ext = "parquet" if fmt == "petastorm" else "tfrecord"
    shard = copy / fmt / "test" / f"part-00000.{ext}"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(DataFailure, match=rf"test/part-00000\.{ext}: size \d+ differs from the manifest"):
        load_split(copy, "test", fmt=fmt)
    # Same size, damaged bytes (the warm-up's sha256 would catch it; the reader still names the file).
    shard.write_bytes(data[:40] + b"\xff" * 200 + data[240:])
    with pytest.raises(DataFailure, match=rf"test/part-00000\.{ext}: "):
        load_split(copy, "test", fmt=fmt)


@pytest.mark.unit
def test_embeddings_stay_fp32_under_bf16_autocast():
    import torch

    from ballast.training.models.classic import embed

    model = embed({"hidden_size": 32}, {"task": "classification", "input_shape": [8, 8], "num_classes": 10,
                                        "inputs": {"image": {"shape": [8, 8], "dtype": "uint8"}}})
    x = torch.randint(0, 256, (4, 8, 8)).float()
    seen = {}
    model.values.register_forward_hook(lambda m, i, o: seen.update(embedding=o.dtype))
    model.head[1].register_forward_hook(lambda m, i, o: seen.update(linear=o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert seen == {"embedding": torch.float32, "linear": torch.bfloat16}
    out.float().sum().backward()
    assert model.values.weight.dtype == torch.float32 and model.values.weight.grad.dtype == torch.float32


@pytest.mark.integration
def test_embed_model_trains_in_bf16_on_uint8_images(tmp_path):
    """The embed model under torchrun with bf16 autocast on a PNG-coded uint8 dataset."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(0)
    protos = rng.integers(0, 256, (10, 64))
    labels = rng.integers(0, 10, 1200)
    images = protos[labels].astype(np.uint8)
    salt = rng.random(images.shape) < 0.2  # a fifth of the pixels replaced by random values
    images[salt] = rng.integers(0, 256, int(salt.sum()))
    raw = write_raw(tmp_path / "raw" / "part-0.parquet", images, labels, image_type=pa.list_(pa.uint8()))

    def edit(d):
        d["dataset"]["fields"][0] = {"name": "image", "type": "uint8", "shape": [8, 8]}
        d["validation"]["rules"] = [r for r in d["validation"]["rules"] if r["kind"] in ("in_set", "row_count")]
        d["training"].update(model="embed", precision="bf16", hidden_size=32, learning_rate=0.01)

    ctx = make_ctx(tmp_path, raw.parent, edit)
    cache = run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)["warm_cache"]
    proc, out = launch(tmp_path, cache, epochs=3, edit=edit)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["value"] > 0.5  # learns the 10 noisy prototypes in bf16


@pytest.mark.unit
def test_checkpoint_files_are_hashed_while_written(tmp_path):
    import torch

    w = ckpt.Writer(tmp_path, 7, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", {"w": torch.randn(64, 64)})
    w.write_json("trainer.json", {"step": 7})
    final = w.commit()
    assert sorted(p.name for p in final.iterdir()) == ["COMMITTED", "manifest.json", "model.pt", "trainer.json"]
    manifest = ckpt.verify(final)  # the digests taken while writing match a fresh read
    assert manifest["files"]["model.pt"]["sha256"] == ckpt.sha256_file(final / "model.pt")
    # A file changed between its write and the commit is refused, not committed with a stale digest.
    w = ckpt.Writer(tmp_path, 8, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", {"w": torch.randn(8)})
    with open(w.tmp / "model.pt", "ab") as fh:
        fh.write(b"extra")
    with pytest.raises(ckpt.CheckpointFailure, match="refusing to commit"):
        w.commit()
    assert gate.latest_passing(tmp_path, quarantine_failures=False).name == final.name


@pytest.mark.unit
def test_optimizer_state_split_over_ranks_merges_back(tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    shares = ckpt.optimizer_shares(sd, 3, rank0_bytes=10_000)
    assert sorted(k for share in shares for k in share) == sorted(sd["state"])  # each parameter exactly once
    assert shares == ckpt.optimizer_shares(opt.state_dict(), 3, rank0_bytes=10_000)  # the same on every rank
    assert shares[0] == []  # rank 0 already writes the (larger) model
    w = ckpt.Writer(tmp_path, 1, rank=0, barrier=lambda: None)
    w.begin()
    for r, share in enumerate(shares):
        w.write_tensors(f"optim-part{r}.pt", ckpt.optimizer_part(sd, share, first=r == 0), zip_crc=False)
    path = w.commit()
    merged = ckpt.load_optimizer(path, 3)
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(merged)
    for k, v in sd["state"].items():
        assert torch.equal(fresh.state_dict()["state"][k]["exp_avg_sq"], v["exp_avg_sq"])
    (path / "optim-part2.pt").unlink()
    with pytest.raises(ckpt.CheckpointFailure, match="optim-part2.pt: missing; .* in 3 parts"):
        ckpt.load_optimizer(path, 3)


@pytest.mark.unit
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
@pytest.mark.parametrize("idle", [True, False])
def test_background_writer_runs_at_idle_priority_and_is_waited_for(tmp_path, idle):
    import threading

    import torch

    seen = []
    release = threading.Event()

    def barrier():  # called by the writer at begin and commit: note its policy; hold it at begin
        seen.append(os.sched_getscheduler(0))
        if len(seen) == 1:
            release.wait(30)

    saver = ckpt.AsyncSaver(tmp_path, rank=0, barrier=barrier, keep_last=2, idle=idle)
    saver.save(5, {"model.pt": {"w": torch.randn(64, 64)}}, {"trainer.json": {"step": 5}}, keep=set())
    while not seen:
        threading.Event().wait(0.01)
    assert seen[0] == (os.SCHED_IDLE if idle else os.SCHED_OTHER)
    threading.Timer(0.2, release.set).start()
    saver.wait()  # lifts the writer back to normal priority where allowed (root here), then joins it
    if idle and os.geteuid() == 0:
        assert seen[-1] == os.SCHED_OTHER
    ckpt.verify(tmp_path / "step-00000005")
    saver.save(6, {"model.pt": {"w": torch.randn(64, 64)}}, {}, keep=set(), asynchronous=False)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # a synchronous save runs at the caller's priority
    ckpt.verify(tmp_path / "step-00000006")


@pytest.mark.unit
@pytest.mark.parametrize("refuse", [None, "open", "write"])
def test_checkpoint_files_written_direct_or_buffered_are_torch_save_bytes(tmp_path, monkeypatch, refuse):
    import io
    import os

    import torch

    import mmap

    from torch.utils.serialization import config

    # "c" lives in page-aligned memory, as the trainer's snapshot buffers do: written with O_DIRECT, its
    # blocks go to the file straight from it, without the staging copy.
    aligned = torch.frombuffer(mmap.mmap(-1, 600 * 1024 * 4), dtype=torch.float32).view(600, 1024)
    aligned.copy_(torch.randn(600, 1024))
    state = {"a": torch.randn(1000, 77), "b": torch.arange(5), "c": aligned}
    expected = io.BytesIO()
    with config.patch({"save.storage_alignment": 4096}):
        torch.save(state, expected)
    real_open, real_write = os.open, os.write
    seen = {"direct": 0, "unstaged": 0}
    real_emit = ckpt._FileWriter._emit

    def spy_emit(self, out, length=None):
        seen["unstaged"] += out.obj is not self.view.obj
        return real_emit(self, out, length)

    monkeypatch.setattr(ckpt._FileWriter, "_emit", spy_emit)

    def fake_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            seen["direct"] += 1
            if refuse == "open":
                raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    def fake_write(fd, data):  # a filesystem that takes O_DIRECT at open and refuses the I/O
        if refuse == "write" and fcntl_direct(fd):
            raise OSError(22, "Invalid argument")
        return real_write(fd, data)

    def fcntl_direct(fd):
        import fcntl

        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "write", fake_write)
    # A small staging buffer: the 2.8 MB file goes through it in many slices and ends on a partial block.
    w = ckpt.Writer(tmp_path, 3, rank=0, barrier=lambda: None, staging=ckpt.staging_buffer(1 << 16))
    w.begin()
    w.write_tensors("model.pt", state)
    path = w.commit()
    monkeypatch.undo()
    assert (path / "model.pt").read_bytes() == expected.getvalue()
    ckpt.verify(path)  # the digest taken while writing matches the bytes on disk
    if hasattr(os, "O_DIRECT"):
        assert seen["direct"] >= 1
        assert (seen["unstaged"] > 0) == (refuse is None)  # the aligned tensor skipped the staging buffer


@pytest.mark.unit
def test_large_slices_are_hashed_in_a_thread_while_they_are_written(tmp_path, monkeypatch):
    """A slice of 1 MiB or more is hashed in a thread of its own beside its write; the digest is still the
    sha256 of the bytes on disk, in order, with small slices (the file's last) hashed inline."""
    import hashlib
    import threading

    from ballast.training.checkpoint import fileio

    started = []

    class Spy(threading.Thread):
        def start(self):
            started.append(self.name)
            super().start()

    monkeypatch.setattr(fileio.threading, "Thread", Spy)
    data = os.urandom((8 << 20) + 12345)  # 4 slices of 2 MiB through the staging buffer, then a small one
    w = ckpt._FileWriter(tmp_path / "f.bin", ckpt.staging_buffer(2 << 20))
    for lo in range(0, len(data), 3 << 20):
        w.write(memoryview(data)[lo:lo + (3 << 20)])
    w.close()
    assert (tmp_path / "f.bin").read_bytes() == data
    assert w.digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert started == ["ckpt-hash"] * 4
    assert fileio.helper_cpu_seconds() > 0  # their CPU, for this thread's account (the saver's write_cpu_seconds)


def _extents(path: Path) -> int | None:
    """The number of extents `path` has on an ext4 filesystem (filefrag), or None elsewhere."""
    try:
        out = subprocess.run(["filefrag", str(path)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r": (\d+) extents? found", out)
    return int(found.group(1)) if found else None


@pytest.mark.integration
def test_a_checkpoint_file_written_beside_another_gets_its_blocks_in_one_run_where_its_size_is_known(tmp_path):
    """Files written side by side with O_DIRECT (ranks' shards) take their blocks from the filesystem as
    the writes come, often in turns (ext4 here: 1-10 extents for 24-64 MiB in 2 MiB slices); a file whose
    size was reserved at open has one run (ext4: an extent up to 128 MiB), and ends at the size written
    whatever was reserved."""
    data = os.urandom(24 << 20)

    def side_by_side(names: list[str], reserve: int) -> list[Path]:
        writers = [ckpt._FileWriter(tmp_path / n, ckpt.staging_buffer(2 << 20), reserve) for n in names]
        for lo in range(0, len(data), 2 << 20):
            for w in writers:
                w.write(memoryview(data)[lo:lo + (2 << 20)])
        for w in writers:
            w.close()
        return [tmp_path / n for n in names]

    for reserve in (len(data) + (4 << 20), len(data) - (4 << 20)):  # more than written, and less
        for path in side_by_side(["a.bin", "b.bin"], reserve):
            assert path.read_bytes() == data
    probe = ckpt._FileWriter(tmp_path / "probe", ckpt.staging_buffer(1 << 12))
    probe.close()
    if _extents(tmp_path / "a.bin") is None or not probe.direct:
        pytest.skip("counts extents with filefrag on a filesystem that takes O_DIRECT (ext4)")
    for trial in range(3):  # unreserved, a third of such pairs came out in one run each
        assert [_extents(p) for p in side_by_side([f"r{trial}", f"s{trial}"], len(data))] == [1, 1]


@pytest.mark.unit
@pytest.mark.parametrize("refuse", [None, "open"])
def test_dcp_shards_are_written_direct_and_hashed_as_they_go(tmp_path, monkeypatch, refuse):
    """checkpoint.dcp.write: DCP's shard file goes through the O_DIRECT writer (a small staging buffer
    here: many slices, a partial last block), its digest is the sha256 of the bytes on disk, and DCP
    reads it back; where O_DIRECT is refused, the same through buffered writes."""
    import os
    import warnings

    import torch

    from ballast.training.checkpoint import dcp
    from ballast.training.checkpoint.fileio import sha256_file

    real_open = os.open
    seen = {"direct": 0}

    def fake_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0) and str(path).endswith(".distcp"):
            seen["direct"] += 1
            if refuse == "open":
                raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", fake_open)
    state = {"w": torch.randn(300, 77), "step": torch.arange(7), "m": torch.randn(5000)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is ... uninitialized" (one process)
        written = dcp.write(state, tmp_path, rank=0, group=None, staging=ckpt.staging_buffer(1 << 14))
        monkeypatch.undo()
        shard = tmp_path / "__0_0.distcp"
        index = tmp_path / dcp.INDEX_FILE  # rank 0 also writes the metadata as JSON
        assert written == {"__0_0.distcp": (sha256_file(shard), shard.stat().st_size), ".metadata": None,
                           index.name: (sha256_file(index), index.stat().st_size)}
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        import torch.distributed.checkpoint as tdcp

        tdcp.load(back, storage_reader=dcp.reader(tmp_path), no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state)
    if hasattr(os, "O_DIRECT"):
        assert seen["direct"] == 1


@pytest.mark.unit
def test_a_dcp_shard_write_that_fails_records_no_digest_and_closes_its_file(tmp_path, monkeypatch):
    import errno
    import os
    import warnings

    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from ballast.training.checkpoint import dcp

    real_write = os.write
    calls = {"n": 0}

    def full_disk(fd, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    fds = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "write", full_disk)
    digests: dict = {}
    fs = dcp._hashing_file_system(digests, ckpt.staging_buffer(1 << 14))
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(tmp_path), single_file_per_rank=True, sync_files=True, thread_count=1)
    writer.fs = fs
    import torch.distributed.checkpoint as tdcp

    with warnings.catch_warnings(), pytest.raises((OSError, CheckpointException), match="No space left"):
        warnings.simplefilter("ignore")
        tdcp.save({"w": torch.randn(100_000)}, storage_writer=writer, no_dist=True)
    monkeypatch.undo()
    assert digests == {} and len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.integration
def test_forked_loader_worker_drops_the_ranks_tcp_sockets():
    # A loader worker holding copies of a rank's gloo sockets kept a SIGKILLed rank's connections open
    # until the worker noticed the death (5 s), and the surviving ranks waited that long to fail.
    import os
    import socket

    from ballast.training.dataset import loader as data

    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    unix_a, unix_b = socket.socketpair()  # what loader queues are made of: kept
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        data._drop_inherited_sockets(0)
        alive = ""
        for fd in (tcp.fileno(), unix_a.fileno(), w):
            try:
                os.fstat(fd)
                alive += "1"
            except OSError:
                alive += "0"
        os.write(w, alive.encode())
        os._exit(0)
    os.close(w)
    out = os.read(r, 10)
    os.waitpid(pid, 0)
    tcp.close(), unix_a.close(), unix_b.close(), os.close(r)
    assert out == b"011"


@pytest.mark.unit
def test_resume_keeps_the_fused_optimizer_kernel():
    """A state saved by a foreach AdamW (an older version) must not switch a fused one back."""
    import torch

    from ballast.training.models import build_optimizer, keeping_optimizer_kernel

    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    old = torch.optim.AdamW([w], lr=0.1, foreach=True)
    old.step()
    opt = build_optimizer("adamw", [w], lr=0.1, weight_decay=0.0)
    assert opt.param_groups[0]["fused"] is True
    with keeping_optimizer_kernel(opt):
        opt.load_state_dict(old.state_dict())
    assert opt.param_groups[0]["fused"] is True and not opt.param_groups[0]["foreach"]
    assert torch.equal(opt.state[w]["exp_avg"], old.state[w]["exp_avg"])
    opt.step()  # the fused kernel accepts the loaded state (its step counter a CPU float tensor)


@pytest.mark.integration
def test_training_processes_keep_freed_host_memory_for_reuse(tmp_path):
    """Blocks above glibc's mmap threshold come back as fresh pages at every allocation unless the
    thresholds are raised: count the page faults of the same loop both ways."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import resource, sys\n"
        "import torch\n"
        "from ballast.training.hostmem import keep_freed_memory\n"
        "done = keep_freed_memory() if sys.argv[1] == 'keep' else {}\n"
        "def step():\n"  # two 64 MB blocks: above glibc's largest dynamic mmap threshold (32 MiB)
        "    x = torch.ones(16_000_000)\n"
        "    y = x * 2\n"
        "for _ in range(4):\n"  # the heap settles in the first steps
        "    step()\n"
        "faults = []\n"
        "for _ in range(8):\n"
        "    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    step()\n"
        "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)\n"
        "print(sorted(faults)[len(faults) // 2], sorted(done))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    faults = {}
    for mode in ("keep", "system"):
        out = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, check=True)
        count, names = out.stdout.split(" ", 1)
        faults[mode] = int(count)  # the median step's page faults
        if mode == "keep":
            assert names.strip() == "['malloc_mmap_threshold', 'malloc_trim_threshold']"
    pages = 64_000_000 // 4096
    assert faults["system"] > 2 * pages * 0.9, faults  # every step faults both blocks in again
    # A settled step reuses the heap's pages (a CI run once saw the heap take a few more steps to
    # settle, so the median step is compared, not the sum).
    assert faults["keep"] < pages * 0.1, faults
    # An explicit environment setting wins over the trainer's.
    out = subprocess.run([sys.executable, str(script), "keep"], env={**env, "MALLOC_MMAP_THRESHOLD_": "65536",
                         "MALLOC_TRIM_THRESHOLD_": "65536"}, capture_output=True, text=True, check=True)
    assert out.stdout.split(" ", 1)[1].strip() == "[]"
