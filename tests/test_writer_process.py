"""The checkpoint writer process (training.checkpoint.writer_process): a background save's bytes written and
hashed by a process of its own from the shared-memory snapshot, falling back to the trainer's thread."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
import warnings

import pytest
from ballast.training import checkpoint as ckpt
from ballast.training.checkpoint import arena, fileio, writer_process
from ballast.training.checkpoint.saver import AsyncSaver
from ballast.training.checkpoint.snapshot import Snapshot

pytestmark = pytest.mark.skipif(not arena.available(), reason="the writer process needs Linux's memfd")


def _state():
    import torch

    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(700, 1024, generator=g), "b": torch.arange(7), "m": torch.randn(300_000, generator=g)}


def _saver(tmp_path, **kw):
    return AsyncSaver(tmp_path / "ckpt", rank=0, barrier=lambda: None, keep_last=2, log=lambda m: None,
                      process=True, **kw)


def _parent_bytes(monkeypatch):
    """The bytes this process writes to checkpoint files (the writer process's writes are not seen)."""
    seen = {"bytes": 0}
    real = fileio._FileWriter._write_out

    def spy(self, out, length):
        seen["bytes"] += length
        return real(self, out, length)

    monkeypatch.setattr(fileio._FileWriter, "_write_out", spy)
    return seen


@pytest.mark.integration
def test_a_background_save_is_written_by_the_writer_process(tmp_path, monkeypatch):
    """The tensors' bytes (a torch.save file and a DCP shard, as DDP and FSDP saves write them) reach the disk
    from the writer process, hashed there: the checkpoint verifies and loads back equal, the trainer's process
    wrote only the small JSON files, and the write's CPU is accounted to the save."""
    import torch
    from ballast.training.checkpoint import dcp

    snap = Snapshot(shared=True)
    state = _state()
    copy = snap.copy(state)
    written_cpu = []
    saver = _saver(tmp_path, on_written=lambda step, s, cpu: written_cpu.append(cpu))
    parent = _parent_bytes(monkeypatch)

    def shards(d):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: torch.distributed uninitialized (one process)
            return dcp.write({"model": copy}, d, rank=0, group=None)

    saver.save(5, {"model.pt": copy}, {"trainer.json": {"step": 5}}, keep=set(), asynchronous=True, shards=shards)
    pid = saver.process.pid
    saver.wait()
    path = saver.last_path
    ckpt.verify(path)  # every file's bytes match the sha256 the writer process took as it wrote them
    back = torch.load(path / "model.pt", weights_only=True)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert (path / "__0_0.distcp").stat().st_size > 3_000_000
    assert parent["bytes"] < 64 << 10  # trainer.json, the manifest: the tensors went through the process
    assert written_cpu and written_cpu[0] > 0
    assert saver.process.alive() and saver.process.pid == pid  # one process for every save of the run
    saver.save(6, {"model.pt": copy}, {}, keep=set(), asynchronous=True)
    saver.wait()
    assert saver.process.pid == pid
    ckpt.verify(saver.last_path)
    saver.close()
    assert saver.process.proc.wait(timeout=10) == 0  # ends with its saver


@pytest.mark.integration
def test_a_writer_process_that_dies_mid_file_leaves_the_file_to_the_trainer(tmp_path):
    """Killed while a file is planned, the writer process is gone at close: the trainer's thread writes the
    same plan from the same shared buffers; the digest is the file's. The next save starts a new process."""
    snap = Snapshot(shared=True)
    copy = snap.copy(_state())
    logs = []
    proc = writer_process.WriterProcess(idle=False, log=logs.append)
    import torch

    out = proc.open(tmp_path / "model.pt", fileio.staging_buffer())
    torch.save(copy, out)
    os.kill(proc.pid, signal.SIGKILL)
    proc.proc.wait(timeout=10)
    out.close()
    assert out.digest.hexdigest() == ckpt.sha256_file(tmp_path / "model.pt")
    assert out.size == (tmp_path / "model.pt").stat().st_size
    back = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(back[k], copy[k]) for k in copy)
    assert any("is gone" in m and str(proc.pid) in m for m in logs)

    saver = _saver(tmp_path)
    saver.start_process()
    first = saver.process.pid
    os.kill(first, signal.SIGKILL)
    saver.process.proc.wait(timeout=10)
    saver.save(3, {"model.pt": copy}, {}, keep=set(), asynchronous=True)
    saver.wait()
    ckpt.verify(saver.last_path)
    assert saver.process.alive() and saver.process.pid != first
    saver.close()


@pytest.mark.integration
def test_a_write_error_in_the_writer_process_fails_the_save_with_its_cause(tmp_path):
    """An I/O error of the writer process (a file size limit here: EFBIG, as a full disk gives ENOSPC)
    fails the save with that error and the file it hit; nothing is committed."""
    snap = Snapshot(shared=True)
    copy = snap.copy(_state())
    saver = _saver(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # inherited by the process started now
    try:
        saver.start_process()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    saver.save(4, {"model.pt": copy}, {}, keep=set(), asynchronous=True)
    with pytest.raises(ckpt.CheckpointFailure, match=r"checkpoint save failed: .*File too large: .*model\.pt"):
        saver.wait()
    assert ckpt.committed(tmp_path / "ckpt") == []
    saver.close()


@pytest.mark.integration
def test_the_writer_process_gets_no_secret_and_dies_with_its_trainer(tmp_path):
    """Its environment holds only what Python needs (no credential of the trainer's), and a trainer killed
    outright takes it along (parent-death signal)."""
    code = ("import os, sys, time; os.environ['AWS_SECRET_ACCESS_KEY'] = 'hunter2'\n"
            "from ballast.training.checkpoint import writer_process\n"
            "p = writer_process.WriterProcess(idle=True)\n"
            "print(p.pid, flush=True); time.sleep(60)\n")
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(trainer.stdout.readline())
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert not [e for e in environ if e.startswith(b"AWS_")]
        trainer.kill()
        trainer.wait(timeout=10)
        deadline = time.monotonic() + 30  # an idle-priority process: on busy cores its exit waits its turn
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") \
                and open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z":
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"
    finally:
        trainer.kill()


@pytest.mark.integration
def test_a_groups_sigterm_leaves_the_writer_process_writing(tmp_path, monkeypatch):
    """A SIGTERM to the whole process group (a preemption notice, the end of a stalled group) reaches the
    writer process too: it must not die of it (the save in flight would fall back to the trainer) nor print
    anything. One sent at once, before its Python has started, is held blocked and dropped; one sent later
    is ignored. The saves after both still go through the same process."""
    import torch

    copy = Snapshot(shared=True).copy(_state())
    saver = _saver(tmp_path)
    saver.start_process()
    pid = saver.process.pid
    os.kill(pid, signal.SIGTERM)  # straight after the fork: the child still has the trainer's mask
    os.kill(pid, signal.SIGINT)
    assert saver.process.ready(timeout=30)
    os.kill(pid, signal.SIGTERM)
    parent = _parent_bytes(monkeypatch)
    saver.save(4, {"model.pt": copy}, {}, keep=set(), asynchronous=True)
    saver.wait()
    ckpt.verify(saver.last_path)
    assert parent["bytes"] == 0 and saver.process.alive() and saver.process.pid == pid
    back = torch.load(saver.last_path / "model.pt", weights_only=True)
    assert all(torch.equal(back[k], copy[k]) for k in copy)
    saver.close()
    assert saver.process.proc.wait(timeout=10) == 0


@pytest.mark.integration
@pytest.mark.parametrize("when", ["before_its_greeting", "mid_message", "after_a_save"])
def test_a_trainer_that_leaves_at_any_point_ends_the_writer_process_quietly(tmp_path, capfd, when):
    """The trainer closes its end (exits, or is ending) while the writer process is still starting, halfway
    through a message, or idle: the process exits 0 without a word. (A writer that had not yet greeted
    when its trainer left printed a BrokenPipeError traceback into the task log.)"""
    proc = writer_process.WriterProcess(idle=False)
    if when == "mid_message":
        assert proc.ready(timeout=30)
        proc.sock.sendall(b"M" + writer_process._HEAD.pack(1000, 0) + b'{"op": ')
    elif when == "after_a_save":
        import torch

        out = proc.open(tmp_path / "model.pt", fileio.staging_buffer())
        torch.save(Snapshot(shared=True).copy(_state()), out)
        out.close()
        assert ckpt.sha256_file(tmp_path / "model.pt") == out.digest.hexdigest()
    proc.close()  # before_its_greeting: at once, while its Python is still importing
    assert proc.proc.wait(timeout=10) == 0
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == "", captured


@pytest.mark.integration
def test_a_file_of_tensors_outside_the_shared_memory_is_written_by_the_trainer(tmp_path, monkeypatch):
    """Bytes not in the arena travel inline in the plan only up to INLINE_LIMIT: past it the trainer's thread
    writes the file itself (the plan never holds a copy of a large state), still hashed as it goes."""
    import torch

    monkeypatch.setattr(writer_process, "INLINE_LIMIT", 1 << 20)
    proc = writer_process.WriterProcess(idle=False)
    parent = _parent_bytes(monkeypatch)
    state = _state()  # ordinary tensors, not a shared snapshot
    out = proc.open(tmp_path / "model.pt", fileio.staging_buffer())
    torch.save(state, out)
    out.close()
    assert out.local is not None and parent["bytes"] == out.size == (tmp_path / "model.pt").stat().st_size
    assert out.digest.hexdigest() == ckpt.sha256_file(tmp_path / "model.pt")
    back = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(back[k], state[k]) for k in state)
    proc.close()


@pytest.mark.unit
def test_shared_snapshot_buffers_are_page_aligned_ranges_of_the_arena(monkeypatch):
    """A shared snapshot's large buffers are carved, page-aligned, from memfd regions of REGION bytes (one of
    its own for a larger buffer), and the arena finds the region and offset of any range inside them; small
    ones and ranges outside are not its."""
    import torch

    monkeypatch.setattr(arena, "REGION", 4 << 20)
    monkeypatch.setattr(arena, "_ARENA", None)
    snap = Snapshot(shared=True)
    big = {"a": torch.randn(300_000), "b": torch.randn(600_000), "c": torch.randn(2_000_000), "s": torch.arange(5)}
    copy = snap.copy(big)
    a = arena.arena()
    assert all(torch.equal(copy[k], big[k]) for k in big)
    for key in ("a", "b", "c"):
        address = copy[key].data_ptr()
        region, off = a.find(address, copy[key].nbytes)
        assert address % arena.PAGE == 0 and off % arena.PAGE == 0
        assert bytes(region.view[off:off + 16]) == copy[key].numpy().tobytes()[:16]
        assert a.find(address + 100, 1000) == (region, off + 100)
    assert a.find(copy["a"].data_ptr(), 1)[0] is a.find(copy["b"].data_ptr(), 1)[0]  # 1.2 + 2.4 MB in one region
    assert a.find(copy["c"].data_ptr(), 1)[0].size >= copy["c"].nbytes > arena.REGION  # one of its own
    assert a.find(copy["s"].data_ptr(), 1) is None and a.find(big["a"].data_ptr(), 4) is None
