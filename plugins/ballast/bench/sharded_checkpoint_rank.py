"""One rank of `ballast bench sharded-checkpoint` (started by `ballast.bench.sharded_checkpoint`).

The rank builds the `gpt` model, shards it with Ballast's FSDP2 per block (training.fsdp through
training.distributed), trains it with the fused AdamW of training.models and checkpoints it through
Ballast's CheckpointManager, on synthetic token ids (the data path is not what is measured). It measures:

* memory: its resident set (VmRSS, with its checkpoint writer process's private memory) sampled every 2 ms
  from just before a save until the save is
  committed (asynchronous: until its background write is done), less the RSS just before it; for the
  first save (the snapshot buffers are allocated then), the following ones (reused), and plain DCP;
* time lost: the same stretch of training steps without a save, with one synchronous and with one
  asynchronous save in its middle, each stretch ending when the save is committed, in rotated order;
  with the CPU time the save's writing thread used and the machine's idle core-seconds in the stretch;
* save and load: Ballast's synchronous save until it has committed (DCP shards hashed as written,
  manifest, commit marker; the pruning it then starts in the background is not timed) and resume
  (`CheckpointManager.load`) against `torch.distributed.checkpoint.save`/`load` of the same sharded
  state to a fresh directory, in alternating order, each after every write is on disk and the page
  cache dropped where the bench may (root); and the resume gate a restart runs before that load (split
  between the ranks), timed apart.

Timings are taken between barriers on every rank; the parent takes the slowest rank. The rank writes
`rank-<R>.json` into the output directory. Importing this module does not import torch.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any


WRITER: list[int] = []
"""The pid of this rank's checkpoint writer process, once it runs (training.checkpoint.writer_process)."""


def _rss() -> int:
    """This process's resident set, plus the private memory (RssAnon) of its checkpoint writer process:
    the shared snapshot it writes from is counted once, here."""
    return _status_kib("self", "VmRSS:") + sum(_status_kib(str(pid), "RssAnon:") for pid in WRITER)


def _status_kib(pid: str, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:  # the writer process ended
        pass
    return 0


class _Peak:
    """The largest RSS above the RSS at start, sampled every `interval` seconds in a thread."""

    def __init__(self, interval: float = 0.002):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss()) - self.base


class _Metrics:
    """What the CheckpointManager reports to (the trainer's Prometheus gauges and event log): kept here."""

    def __init__(self):
        self.events: list[dict[str, Any]] = []

    def set(self, **_: Any) -> None:
        pass

    def event(self, name: str, step: int, **fields: Any) -> None:
        self.events.append({"event": name, "step": step, **fields})


def run(rank: int, world: int, port: int, parent: int, opts: dict[str, Any]) -> None:
    """The rank's whole bench; `opts` as `ballast.bench.sharded_checkpoint` passes them."""
    import signal

    from ballast.training.parentdeath import die_with_parent

    die_with_parent(signal.SIGKILL, parent)  # never outlives the bench
    if opts["backend"] == "gloo":  # the CPU bench, also on a machine with GPUs (torch not imported yet)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    out = Path(opts["out"])
    try:
        result = _bench(rank, opts)
        (out / f"rank-{rank}.json").write_text(json.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - recorded for the bench, which kills the other ranks
        import traceback

        (out / f"rank-{rank}.error").write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise SystemExit(1) from None  # the bench reports the error file


def _bench(rank: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ballast.training.checkpoint import dcp as ballast_dcp
    from ballast.training.checkpoint.manager import CheckpointManager
    from ballast.training.config.run import CheckpointConfig, DistributedConfig, ModelConfig
    from ballast.training.distributed import Distributed
    from ballast.training.models import build_optimizer
    from ballast.training.state import TrainState

    torch.set_num_threads(int(opts["threads"]))
    d = Distributed(DistributedConfig(parallelism="fsdp", backend=opts["backend"], timeout_seconds=900))
    if not d.enabled:
        _group_of_one(d, opts["backend"])
    torch.manual_seed(0)
    seq, vocab = int(opts["seq_len"]), int(opts["vocab"])
    section = ModelConfig(name="gpt", options={"layers": opts["layers"], "width": opts["width"],
                                               "heads": opts["heads"], "vocab_size": vocab},
                          data={"task": "causal_lm", "input_shape": [seq], "input_dtype": "int64", "seq_len": seq,
                                "vocab_size": vocab, "inputs": {"tokens": {"shape": [seq], "dtype": "int64"}}})
    _, model = d.build_model(section, precision="fp32", seed=0, log=lambda m: None)  # as the trainer builds it
    opt = build_optimizer("adamw", model.parameters(), lr=1e-4, weight_decay=0.0)
    scaler = torch.amp.GradScaler(d.device.type, enabled=False)
    state, metrics = TrainState(), _Metrics()
    root = Path(opts["dir"])
    manager = CheckpointManager(
        CheckpointConfig(directory=str(root / "ballast"), keep_last=2, asynchronous=True,
                         writer_priority=opts["writer_priority"], writer_process=opts.get("writer_process", True)),
        dist=d, model=model, optimizer=opt, scaler=scaler, state=state, states={}, model_section=section,
        parallelism="fsdp", metrics=metrics, log=lambda m: None)
    manager.saver.start_process()  # where it runs: before the first save, as the trainer's prepare() starts it
    if manager.saver.process is not None:
        WRITER.append(manager.saver.process.pid)
        manager.saver.process.ready(timeout=60)  # its start does not share the CPU with the steps timed next
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, vocab, (int(opts["batch"]), seq + 1), generator=gen).to(d.device)

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state.step += 1

    def barrier() -> None:
        dist.barrier()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)

    def timed(fn) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - t0

    for _ in range(int(opts["warmup_steps"])):
        step()  # the optimizer's state exists from here: the state is its final size
    steps = int(opts["stretch_steps"])
    step_seconds = timed(lambda: [step() for _ in range(2)]) / 2
    if opts.get("stretch_seconds"):  # as many steps as fill it, the same on every rank (the slowest's)
        longest = d.all_sum([step_seconds if r == rank else 0.0 for r in range(d.world)])
        step_seconds = max(longest)
        steps = max(steps, 2 * math.ceil(float(opts["stretch_seconds"]) / step_seconds / 2))
    sharded, _ = ballast_dcp.sharded_state(model, opt)
    own = sum(_local(t).numel() * _local(t).element_size() for t in _leaves(sharded))
    result: dict[str, Any] = {"rank": rank, "own_shard_bytes": own, "stretch_steps": steps,
                              "step_seconds": round(step_seconds, 4), "rss_before_first_save": _rss(),
                              "parameters": sum(p.numel() for p in model.parameters()),
                              "memory": {}, "stretch_seconds": {"none": [], "sync": [], "async": []},
                              "async_blocked_seconds": [], "sync_blocked_seconds": [],
                              "idle_core_seconds": {"none": [], "sync": [], "async": []},
                              "write_cpu_seconds": {"sync": [], "async": []},
                              "async_write_done_inside_stretch": [],
                              "save_seconds": {"ballast": [], "dcp": []}, "load_seconds": {"ballast": [], "dcp": []},
                              "gate_seconds": [], "gate_found_newest": [],
                              "state_equal_after_load": []}

    def memory(label: str, fn) -> None:
        barrier()
        peak = _Peak()
        fn()
        barrier()
        result["memory"].setdefault(label, []).append(peak.stop())

    def save(asynchronous: bool) -> None:
        manager.save("bench", asynchronous=asynchronous)
        manager.wait()

    # (a) memory a save adds: the first save allocates the snapshot buffers; later ones reuse them.
    memory("ballast_async_first", lambda: save(True))
    step()
    memory("ballast_sync", lambda: save(False))
    step()
    memory("ballast_async", lambda: save(True))
    fresh = iter(range(1_000_000))

    def dcp_dir() -> Path:
        path = root / f"dcp-{next(fresh)}"
        if rank == 0:
            path.mkdir(parents=True)
        barrier()
        return path

    def dcp_save(path: Path) -> None:
        """DCP's own recipe: the sharded state dicts (get_state_dict), `dcp.save` with its defaults."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

    path = dcp_dir()
    memory("dcp_save", lambda: dcp_save(path))
    _drop(path, rank, barrier)

    # (b) training time lost: one save in the middle of a stretch of steps, the stretch ending once it is committed.
    middle = steps // 2
    modes = ["none", "sync", "async"]
    for rep in range(int(opts["repeats"])):
        for mode in modes[rep % 3:] + modes[:rep % 3]:
            done_inside = [True]

            def stretch(mode: str = mode, done_inside: list[bool] = done_inside) -> None:
                for i in range(steps):
                    if i == middle and mode != "none":
                        t0 = time.perf_counter()
                        manager.save("bench", asynchronous=mode == "async")
                        result[f"{mode}_blocked_seconds"].append(time.perf_counter() - t0)
                    step()
                if mode == "async":
                    thread = manager.saver._thread
                    done_inside[0] = thread is None or not thread.is_alive()
                manager.wait()

            idle0 = _idle_core_seconds()
            result["stretch_seconds"][mode].append(timed(stretch))
            result["idle_core_seconds"][mode].append(_idle_core_seconds() - idle0)
            if mode != "none":  # the CPU the save's writing thread used (the training thread's, for a sync one)
                written = [e for e in metrics.events if e["event"] == "checkpoint_written"]
                result["write_cpu_seconds"][mode].append(written[-1]["write_cpu_seconds"])
            if mode == "async":
                result["async_write_done_inside_stretch"].append(done_inside[0])

    # (c) save and load against DCP's own, alternating which saves and which loads first.
    for rep in range(int(opts["io_repeats"])):
        step()
        before = _checksum(model, opt)
        path = dcp_dir()
        saves = {"ballast": lambda: manager.save("bench", asynchronous=False),
                 "dcp": lambda path=path: dcp_save(path)}
        for kind in (("ballast", "dcp") if rep % 2 == 0 else ("dcp", "ballast")):
            result["page_cache_dropped"] = _settle(rank, barrier)
            result["save_seconds"][kind].append(timed(saves[kind]))  # Ballast's: until committed
            manager.wait()  # the pruning that follows a synchronous save, in the background: not timed
        loads = {"ballast": lambda latest=manager.saver.last_path: manager.load(latest),
                 "dcp": lambda path=path: _dcp_load(model, opt, path)}
        # The loads' order crossed with the saves' (every pair of orders as often): after Ballast's
        # save and its pruning, the first load of either kind ran up to 2x slower on this machine.
        for kind in (("dcp", "ballast") if rep // 2 % 2 == 0 else ("ballast", "dcp")):
            _perturb(model)
            _settle(rank, barrier)
            result["load_seconds"][kind].append(timed(loads[kind]))
            result["state_equal_after_load"].append(_checksum(model, opt) == before)
        # What a resume adds before that load: the gate (the ranks split it: hashes and values of the
        # newest checkpoint, which passes), which DCP's load has no counterpart of.
        _settle(rank, barrier)
        found: list[Any] = []
        result["gate_seconds"].append(timed(lambda: found.append(manager.latest())))
        result["gate_found_newest"].append(found == [manager.saver.last_path])
        _drop(path, rank, barrier)
    result["rss_end"] = _rss()
    result["events"] = [e for e in metrics.events if e["event"] == "checkpoint"][-3:]
    from ballast.training.checkpoint.commit import read_trainer_state

    result["writer"] = "process" if WRITER else "thread"
    result["state_format"] = read_trainer_state(manager.saver.last_path)["state_format"]  # "dcp": sharded
    barrier()
    d.close()
    return result


def _group_of_one(d: Any, backend: str) -> None:
    """One rank alone (a machine of one GPU): a process group of one, so that the model is sharded with
    FSDP2 and checkpointed through DCP as on many ranks (Ballast itself trains one process unsharded)."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    if d.device.type == "cuda":
        torch.cuda.set_device(d.device)
    timeout = dt.timedelta(seconds=900)
    dist.init_process_group(backend, rank=0, world_size=1, timeout=timeout)
    d.ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
    d.enabled = True


def _idle_core_seconds() -> float:
    """The machine's idle CPU time so far, all cores together (/proc/stat: idle and iowait), in seconds;
    0.0 where there is no /proc/stat."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return 0.0
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def _dcp_load(model: Any, opt: Any, path: Path) -> None:
    """DCP's own recipe: the sharded state dicts, `dcp.load` into them, set back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _settle(rank: int, barrier) -> bool:
    """Before a timed save or load: every write so far on disk and, where this process may (root), the
    page cache dropped, so that neither side writes into memory the other has just freed (on this
    machine a save right after a pruning or deletion ran up to twice as fast as one that was not) or
    reads what the other left cached. Whether the cache was dropped."""
    os.sync()
    barrier()
    dropped = False
    if rank == 0:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1")
            dropped = True
        except OSError:
            pass
    barrier()
    return dropped


def _drop(path: Path, rank: int, barrier) -> None:
    barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    barrier()


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _leaves(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj] if torch.is_tensor(obj) else []


def _checksum(model: Any, opt: Any) -> list[float]:
    """This rank's parameters and optimizer moments, summed in float64 (equal after a load of what was saved)."""
    import torch

    out = [float(_local(p.detach()).double().sum()) for p in model.parameters()]
    for s in opt.state.values():
        out += [float(_local(v).double().sum()) for v in s.values() if torch.is_tensor(v)]
    return out


def _perturb(model: Any) -> None:
    """Change every local parameter before a load, so that a load that restores nothing is seen."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            _local(p).add_(1.0)
