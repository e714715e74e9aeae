"""The training loop run by every process that torchrun starts.

One process per rank. Rank 0 writes the summary, the event log and the checkpoint manifest. What
keeps a run alive, step by step:

* resume from the newest committed checkpoint (exact: weights, optimizer, loss scaler, LR schedule,
  data position, RNG of every rank, monitor state);
* one small all-reduce per step, started before backward and overlapping with it, carries the
  global loss and the flags every rank must agree on (preemption, a time-based checkpoint being due,
  the time budget), so ranks never diverge in their decisions; the gradient norm, the same on every
  rank after the gradient all-reduce, tells whether the gradients are finite;
* non-finite loss or gradients: the pre-step (last good) state is checkpointed with the offending
  batch on a skip list, and the process exits with the divergence code; the next try skips it;
* a loss spike (z-score over a trailing window): an alert event, and with `spike_action: rollback`
  a return to the last committed checkpoint with the batch skipped; otherwise the last good state is
  checkpointed at once (at most once per `anomaly_checkpoint_min_steps`);
* SIGTERM (preemption): a synchronous checkpoint within the grace period, then the preempted code;
* a watchdog ends a process that makes no progress for the hang timeout, after dumping stacks.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from training import checkpoint as ckpt
from training.config import RunConfig
from training.dataset.loader import EpochLoader
from training.dataset.reader import Split, load_split
from training.failure import EXIT_CODES, DataFailure, DivergenceFailure, Preempted, TrainingFailure, write_record
from training.faults import Injector, load_faults
from training.models import build_model, build_optimizer, keeping_optimizer_kernel
from training.monitor import Metrics, Nvml, SpikeDetector, Watchdog, grad_stats, memory_bytes


MAX_ROLLBACKS_PER_CHECKPOINT = 3


class _Dist:
    """The process group (plus a separate gloo group for checkpoint writes), or a single process."""

    def __init__(self, cfg: RunConfig):
        import torch
        import torch.distributed as dist

        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{self.local_rank}" if cuda else "cpu")
        self.backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
        self.enabled = self.world > 1
        self.ckpt_group = None
        if self.enabled:
            if cuda:
                torch.cuda.set_device(self.device)
            timeout = dt.timedelta(seconds=cfg.dist_timeout_seconds)
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # Under torchrun the agent's store outlives a group restart. Keys are namespaced per restart
                # so that a restarted group never reads the previous attempt's addresses (a stale address
                # is a gloo "connectFullMesh failed ... Connection refused").
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world,
                                     is_master=False, timeout=timeout)
                store = dist.PrefixStore(f"ballast/attempt-{attempt}", base)
                dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world,
                                        timeout=timeout)
            else:
                dist.init_process_group(self.backend, timeout=timeout)
            self.ckpt_group = dist.new_group(backend="gloo", timeout=timeout)

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()

    def ckpt_barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier(group=self.ckpt_group)

    def all_sum(self, values: list[float]) -> list[float]:
        return self.all_sum_async(values)()

    def all_sum_async(self, values) -> Callable[[], list[float]]:
        """Start summing `values` (floats, or a float64 tensor on the device) over ranks; the returned
        function waits for the result. Issued early, it overlaps with the rest of the step."""
        import torch

        t = values if torch.is_tensor(values) else torch.tensor(values, dtype=torch.float64, device=self.device)
        if not self.enabled:
            return t.tolist
        import torch.distributed as dist

        work = dist.all_reduce(t, async_op=True)

        def result() -> list[float]:
            work.wait()
            return t.tolist()
        return result

    def close(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.destroy_process_group()


class _Snapshot:
    """CPU copies of a nested state, into buffers kept from one save to the next.

    Reusing the buffers turns the snapshot into a plain memory copy (no allocation, no first-touch page
    faults), which is all an asynchronous save blocks training for. The caller must not snapshot while
    the previous save is still being written (Trainer.save waits for it first).
    """

    def __init__(self, pin: bool = False):
        self.pin = pin
        self.buffers: dict[tuple, Any] = {}

    def _empty(self, shape, dtype):
        """A buffer for a tensor; large CPU ones page-aligned (an anonymous mapping), so that the
        checkpoint writer can hand their pages to the disk directly (O_DIRECT) without a staging copy."""
        import mmap

        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        if self.pin or nbytes < (1 << 20):
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin)
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)

    def copy(self, obj: Any, path: tuple = ()) -> Any:
        import torch

        if torch.is_tensor(obj):
            buf = self.buffers.get(path)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = self._empty(obj.shape, obj.dtype)
                self.buffers[path] = buf
            buf.copy_(obj.detach())
            return buf
        if isinstance(obj, dict):
            return {k: self.copy(v, path + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy(v, path + (i,)) for i, v in enumerate(obj))
        return obj


class Trainer:
    def __init__(self, cfg: RunConfig):
        import torch

        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ckpt_root = Path(cfg.checkpoint_dir)
        self.dist = _Dist(cfg)
        self.rank = self.dist.rank
        self.step = 0
        self.epoch = 0
        self.pos = 0  # batches (optimizer steps or skipped batches) consumed in the current epoch
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.bad_epochs = 0
        self.skip: set[tuple[int, int]] = set()  # (epoch, pos) of batches never to train on again
        self._rollbacks: dict[str, int] = {}       # checkpoint name -> rollbacks to it in this process
        self.preempt_at: float | None = None
        self._last_save = time.monotonic()
        self._slow_at = 0.0          # last heartbeat-file write and slow-gauge read
        self._anomaly_save_step: int | None = None
        self.train_seconds = 0.0  # time inside the step loop (no evaluation, no end-of-epoch save)
        self.samples = 0
        self._resumed_at: float | None = None
        self._started = time.monotonic()
        self.limit_reached = False
        self.metrics = Metrics(out_dir=self.out, rank=self.rank, port=cfg.metrics_port)
        self.spikes = SpikeDetector(window=cfg.spike_window, zscore=cfg.spike_zscore)
        self.faults = Injector(load_faults(cfg.faults), rank=self.rank, out_dir=self.out)

        # Resource guards: leave ~20% of the cores to data loading; cap GPU memory per process.
        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, int(cores * (1 - cfg.cpu_reserve_fraction)) // max(1, self.dist.local_world)))
        if self.dist.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(cfg.gpu_memory_fraction, self.dist.device)
        self.nvml = Nvml(self.dist.device.index if self.dist.device.type == "cuda" else None)
        torch.manual_seed(cfg.seed)

        self.train_data = EpochLoader(Path(cfg.data_dir), fmt=cfg.data_format, rank=self.rank, world=self.dist.world,
                                      seed=cfg.seed, workers=cfg.loader_workers, prefetch=cfg.loader_prefetch,
                                      wait_seconds=cfg.data_wait_seconds)
        self._val_data: Split | None = None  # loaded at the first evaluation: a staged cache may bring it later
        if tuple(self.train_data.decoder.shape) != tuple(cfg.input_shape):
            raise DataFailure(f"{cfg.data_dir}: feature {cfg.feature!r} has shape {list(self.train_data.decoder.shape)},"
                              f" the model expects {cfg.input_shape}")

        model = build_model(cfg.model, input_shape=cfg.input_shape, num_classes=cfg.num_classes,
                            hidden=cfg.hidden_size, dropout=cfg.dropout).to(self.dist.device)
        self.raw_model = model
        self.model = model
        if self.dist.enabled and cfg.parallelism == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)  # ZeRO-3: parameters, gradients and optimizer state sharded over ranks
        elif self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model, device_ids=[self.dist.device.index] if self.dist.device.type == "cuda" else None)
            if cfg.gradient_compression != "none":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
                self.model.register_comm_hook(None, hook[cfg.gradient_compression])
        self.lr = cfg.learning_rate
        self.opt = build_optimizer(cfg.optimizer, self.model.parameters(), lr=self.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.opt, mode=cfg.mode, factor=cfg.lr_plateau_factor, patience=cfg.lr_plateau_patience)
        self.autocast_dtype = None
        if cfg.precision == "bf16":
            self.autocast_dtype = torch.bfloat16
        elif cfg.precision == "fp16" and self.dist.device.type == "cuda":
            self.autocast_dtype = torch.float16
        # Dynamic loss scaling (fp16 only). Seed documents: initial scale 8192, growth interval 100;
        # PyTorch's own defaults are 65536 and 2000.
        self.scaler = torch.amp.GradScaler(self.dist.device.type, enabled=self.autocast_dtype == torch.float16,
                                           init_scale=cfg.loss_scale_init,
                                           growth_interval=cfg.loss_scale_growth_interval)
        self.snapshot = _Snapshot(pin=self.dist.device.type == "cuda")
        self.saver = ckpt.AsyncSaver(self.ckpt_root, rank=self.rank, barrier=self.dist.ckpt_barrier,
                                     idle=cfg.checkpoint_writer_priority == "idle", on_written=self._written,
                                     keep_last=cfg.keep_last, log=self.log)
        self.watchdog = Watchdog(cfg.hang_timeout_seconds, out_dir=self.out, rank=self.rank,
                                 on_hang=self._on_hang).start()
        signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- lifecycle ---------------------------------------------------------------------------------

    def _on_sigterm(self, signum, frame) -> None:
        if self.preempt_at is None:
            self.preempt_at = time.monotonic()
            # Past the grace period the process goes without a checkpoint; the last committed one stands.
            timer = threading.Timer(self.cfg.preempt_grace_seconds, self._grace_expired)
            timer.daemon = True
            timer.start()

    def _grace_expired(self) -> None:
        write_record(self.out, Preempted(f"SIGTERM grace period of {self.cfg.preempt_grace_seconds:.0f}s expired"
                                         f" before a checkpoint was committed"), step=self.step, rank=self.rank)
        os._exit(EXIT_CODES["preempted"])

    def _on_hang(self) -> None:
        write_record(self.out, TrainingFailure(f"no progress for {self.cfg.hang_timeout_seconds:.0f}s (watchdog);"
                                               f" stacks in stacks-rank{self.rank}.txt", failure_class="hang"),
                     step=self.step, rank=self.rank)
        os._exit(EXIT_CODES["hang"])

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[train] {msg}", flush=True)

    def heartbeat(self, force: bool = True) -> None:
        """Progress for the watchdog (every step) and, at most once a second unless forced, for the
        outside: the heartbeat file the orchestrator watches and the slower gauges (process memory from
        /proc, NVML), which cost more than a step's other bookkeeping together."""
        self.watchdog.beat()
        now = time.monotonic()
        if not force and now - self._slow_at < 1.0:
            return
        self._slow_at = now
        self.metrics.set(memory_bytes=memory_bytes(self.dist.device), **self.nvml.read())
        if self.rank == 0:  # "<step> <unix time>", replaced atomically so readers never see it half written
            tmp = self.out / ".heartbeat.tmp"
            tmp.write_text(f"{self.step} {time.time()}\n")
            os.replace(tmp, self.out / "heartbeat")

    # -- checkpoints -------------------------------------------------------------------------------

    def _model_state(self) -> tuple[dict, dict]:
        """Full (unsharded) model and optimizer state on rank 0; collective under FSDP."""
        if self.cfg.parallelism == "fsdp" and self.dist.enabled:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            return get_state_dict(self.raw_model, self.opt,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.raw_model.state_dict(), self.opt.state_dict()

    def _load_model_state(self, model_sd: dict, optim_sd: dict | None) -> None:
        with keeping_optimizer_kernel(self.opt):
            if self.cfg.parallelism == "fsdp" and self.dist.enabled:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

                # Every rank read the full state from the (shared) checkpoint directory; each keeps its
                # shard. (broadcast_from_rank0 with empty dicts on the other ranks hung on gloo here.)
                set_state_dict(self.raw_model, self.opt, model_state_dict=model_sd, optim_state_dict=optim_sd or {},
                               options=StateDictOptions(full_state_dict=True))
                return
            self.raw_model.load_state_dict(model_sd)
            if optim_sd is not None:
                self.opt.load_state_dict(optim_sd)

    def save(self, reason: str, *, asynchronous: bool | None = None) -> None:
        t0 = time.monotonic()
        self.saver.wait()  # the snapshot buffers are reused: the previous write must be done
        tensors, parts = self._snapshot()
        jsons: dict[str, Any] = {}
        if self.rank == 0:
            jsons["trainer.json"] = {
                "step": self.step, "epoch": self.epoch, "pos": self.pos, "world_size": self.dist.world,
                "history": self.history, "best": self.best, "bad_epochs": self.bad_epochs,
                "skip": sorted(self.skip), "spike_window": self.spikes.state(),
                "lr_schedule": self.sched.state_dict(),
                "model": self.cfg.model, "input_shape": self.cfg.input_shape, "num_classes": self.cfg.num_classes,
                "hidden_size": self.cfg.hidden_size, "parallelism": self.cfg.parallelism, "reason": reason,
                "optim_parts": parts}
        keep = {self.best["step"]} if self.best else set()
        use_async = self.cfg.checkpoint_async if asynchronous is None else asynchronous
        self.saver.save(self.step, tensors, jsons, keep=keep, asynchronous=use_async)
        blocked = time.monotonic() - t0
        self._last_save = time.monotonic()
        self.metrics.set(checkpoint_save_seconds=blocked)
        self.metrics.event("checkpoint", self.step, reason=reason, blocked_seconds=round(blocked, 4),
                           asynchronous=use_async)

    def _written(self, step: int, seconds: float) -> None:
        """From the writer: checkpoint `step` is committed, `seconds` after its write began."""
        self.metrics.set(checkpoint_write_seconds=seconds)
        self.metrics.event("checkpoint_written", step, write_seconds=round(seconds, 3))

    def _snapshot(self) -> tuple[dict[str, Any], int]:
        """This rank's checkpoint tensors, copied into the reused snapshot buffers; and the number of
        optimizer parts."""
        import torch

        model_sd, optim_sd = self._model_state()
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state(self.dist.device)
        tensors: dict[str, Any] = {f"rng-rank{self.rank}.pt": self.snapshot.copy(rng, ("rng",))}
        if self.cfg.parallelism == "fsdp" and self.dist.enabled:
            parts = 1  # the gathered full state is on rank 0 only
            if self.rank == 0:
                tensors["optim-part0.pt"] = self.snapshot.copy(optim_sd, ("optim",))
        else:
            # Every rank holds the same optimizer state: each snapshots and writes its share.
            parts = self.dist.world
            model_bytes = sum(t.numel() * t.element_size() for t in model_sd.values())
            mine = ckpt.optimizer_shares(optim_sd, parts, rank0_bytes=model_bytes)[self.rank]
            tensors[f"optim-part{self.rank}.pt"] = self.snapshot.copy(
                ckpt.optimizer_part(optim_sd, mine, first=self.rank == 0), ("optim",))
        if self.rank == 0:
            tensors["model.pt"] = self.snapshot.copy(model_sd, ("model",))
            tensors["scaler.pt"] = {k: torch.tensor(v) for k, v in self.scaler.state_dict().items()
                                    if isinstance(v, (int, float))}
        return tensors, parts

    def resume(self, path: Path | None = None) -> bool:
        import torch

        t0 = time.monotonic()
        path = path or ckpt.latest_valid(self.ckpt_root, log=self.log)
        if path is None:
            self.log("no committed checkpoint; starting from scratch")
            return False
        state = ckpt.read_trainer_state(path)
        mine = (self.cfg.model, self.cfg.input_shape, self.cfg.num_classes, self.cfg.hidden_size)
        theirs = (state["model"], state["input_shape"], state["num_classes"], state.get("hidden_size"))
        if mine != theirs:
            raise ckpt.CheckpointFailure(f"{path}: checkpoint is for model {theirs[0]} {theirs[1]} -> {theirs[2]} classes"
                                         f" (hidden {theirs[3]}), not this run's {mine[0]} {mine[1]} -> {mine[2]}"
                                         f" (hidden {mine[3]}); refusing to resume")
        model_sd = ckpt.load_tensors(path / "model.pt")
        if self.cfg.resume_average_last > 1:
            recent = ckpt.committed(self.ckpt_root)[-self.cfg.resume_average_last:]
            model_sd = ckpt.average(recent)
            self.log(f"resuming from the average of {len(recent)} checkpoints: {', '.join(p.name for p in recent)}")
        try:
            parts = state.get("optim_parts")
            if not isinstance(parts, int) or parts < 1:
                raise ckpt.CheckpointFailure(f"{path / 'trainer.json'}: optim_parts is {parts!r}, expected the number"
                                             f" of optimizer state files (optim-part<R>.pt); refusing to resume")
            self._load_model_state(model_sd, ckpt.load_optimizer(path, parts))
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ckpt.CheckpointFailure(f"{path}: does not fit this model ({str(exc).splitlines()[0]})") from exc
        scaler = ckpt.load_tensors(path / "scaler.pt")
        if scaler:
            self.scaler.load_state_dict({k: v.item() for k, v in scaler.items()})
        rng_file = path / f"rng-rank{self.rank}.pt"
        if rng_file.exists() and state["world_size"] == self.dist.world:
            rng = ckpt.load_tensors(rng_file)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"], self.dist.device)
        elif state["world_size"] != self.dist.world:
            self.log(f"world size changed {state['world_size']} -> {self.dist.world}: weights and optimizer kept,"
                     f" RNG streams and the data order restart for the new world")
        self.step, self.epoch, self.pos = state["step"], state["epoch"], state["pos"]
        self.history, self.best, self.bad_epochs = state["history"], state["best"], state["bad_epochs"]
        self.skip = {tuple(x) for x in state.get("skip", [])}
        self.spikes.load(state.get("spike_window", []))
        if state.get("lr_schedule"):
            self.sched.load_state_dict(state["lr_schedule"])
        seconds = time.monotonic() - t0
        self.metrics.set(checkpoint_load_seconds=seconds)
        self._resumed_at = time.monotonic()
        self.log(f"resumed from {path} (epoch {self.epoch}, step {self.step}) in {seconds:.2f}s")
        self.metrics.event("resume", self.step, path=str(path), seconds=round(seconds, 4))
        return True

    # -- the loop ----------------------------------------------------------------------------------

    def _forward_loss(self, x, y, factor: float | None):
        import torch
        import torch.nn.functional as F

        ctx = torch.autocast(self.dist.device.type, dtype=self.autocast_dtype) \
            if self.autocast_dtype is not None else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(self.model(x).float(), y)
        return loss * factor if factor is not None else loss

    def _anomaly(self, kind: str, **fields: Any) -> None:
        self.metrics.anomaly(kind)
        self.metrics.event("anomaly", self.step, kind=kind, epoch=self.epoch, pos=self.pos, **fields)

    @property
    def val_data(self) -> Split:
        if self._val_data is None:
            cfg = self.cfg
            self._val_data = load_split(Path(cfg.data_dir), "validation", fmt=cfg.data_format,
                                        num_classes=cfg.num_classes, wait_seconds=cfg.data_wait_seconds)
        return self._val_data

    def train_epoch(self) -> bool:
        """Train the rest of the current epoch; False when a rollback moved to another epoch."""
        import torch

        cfg = self.cfg
        per_step = cfg.micro_batch_size * cfg.grad_accum_steps
        steps = self.train_data.samples_per_rank // per_step
        if steps == 0:
            raise TrainingFailure(f"no full optimizer step fits in an epoch: {self.train_data.samples_per_rank} rows"
                                  f" per rank for {per_step} samples per step", failure_class="data")
        self.model.train()
        t_epoch = time.monotonic()
        trained = 0
        epoch = self.epoch
        stream, stream_pos = None, -1
        while self.pos < steps:
            if self.epoch != epoch:
                return False  # rolled back into an earlier epoch: its data order must be rebuilt
            if stream_pos != self.pos:  # first step, or a rollback moved the position: restart the loader there
                stream = self.train_data.batches(epoch, batch=per_step, start=self.pos * per_step)
                stream_pos = self.pos
            if (self.epoch, self.pos) in self.skip:
                next(stream)
                stream_pos += 1
                self.pos += 1
                continue
            self.faults.fire(self.step + 1)
            t0 = time.monotonic()
            xb, yb = next(stream)
            stream_pos += 1
            mb = cfg.micro_batch_size
            batches = [(xb[i * mb:(i + 1) * mb].to(self.dist.device, non_blocking=True),
                        yb[i * mb:(i + 1) * mb].to(self.dist.device, non_blocking=True))
                       for i in range(cfg.grad_accum_steps)]
            t1 = time.monotonic()
            factor = self.faults.loss_factor(self.step + 1)
            local_loss = None
            for micro, (x, y) in enumerate(batches):
                last = micro == cfg.grad_accum_steps - 1
                sync = contextlib.nullcontext() if last or not isinstance(self.model, torch.nn.parallel.DistributedDataParallel) \
                    else self.model.no_sync()
                with sync:
                    loss = self._forward_loss(x, y, factor) / cfg.grad_accum_steps
                    part = loss.detach().double().reshape(1)
                    local_loss = part if local_loss is None else local_loss + part
                    if last:
                        # What every rank must agree on, summed while backward and clipping run: the loss
                        # (a non-finite one on any rank makes the sum non-finite), preemption, a time-based
                        # checkpoint being due, the time budget being spent.
                        now = time.monotonic()
                        host = torch.tensor([float(self.preempt_at is not None),
                                             float(now - self._last_save >= cfg.checkpoint_every_seconds),
                                             float(cfg.max_seconds is not None and now - self._started >= cfg.max_seconds)],
                                            dtype=torch.float64)
                        agreed = self.dist.all_sum_async(torch.cat([local_loss, host.to(self.dist.device)]))
                    self.scaler.scale(loss).backward()
            t2 = time.monotonic()
            self.scaler.unscale_(self.opt)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip_norm)
            # Gradients are the same on every rank after the all-reduce (under FSDP the norm is reduced),
            # so the norm, and whether it is finite, is already agreed.
            gnorm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # DTensor under FSDP
            loss_sum, preempted, due, limit = agreed()
            loss_global = loss_sum / self.dist.world
            nonfinite = not (math.isfinite(loss_global) and math.isfinite(gnorm))
            if nonfinite and not self.scaler.is_enabled():
                self._diverged(gnorm)
            if self.step % cfg.stats_every_steps == 0 and self.rank == 0:
                self.metrics.event("grad_stats", self.step, grad_norm=gnorm, **grad_stats(self.raw_model.parameters()))
            z = self.spikes.check(loss_global) if not nonfinite else None
            if z is not None:
                self._anomaly("loss_spike", loss=loss_global, zscore=round(z, 2), action=cfg.spike_action)
                if cfg.spike_action == "rollback" and self._rollback():
                    continue
                self._anomaly_checkpoint()  # the last good state: before this step applies
            if not nonfinite:
                self.spikes.add(loss_global)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            if not self.snapshot.buffers:
                # The optimizer has its state now: allocate (and touch) the snapshot buffers here, once per
                # process, rather than inside the first save, which a preemption notice may be waiting on.
                self._snapshot()
            t3 = time.monotonic()
            self.step += 1
            self.pos += 1
            trained += 1
            self.heartbeat(force=False)
            self.metrics.phases(data=t1 - t0, compute=t2 - t1, communication_optimizer=t3 - t2)
            self.metrics.set(step=self.step, loss=loss_global, grad_norm=gnorm, loss_scale=self.scaler.get_scale(),
                             learning_rate=self.opt.param_groups[0]["lr"],
                             samples_per_second=per_step * self.dist.world / max(t3 - t0, 1e-9))
            if self._resumed_at is not None:
                self.metrics.event("first_step_after_resume", self.step, seconds=time.monotonic() - self._resumed_at)
                self._resumed_at = None
            if self.step % 10 == 0:
                self.metrics.event("step", self.step, epoch=self.epoch, loss=loss_global, grad_norm=gnorm,
                                   data_s=round(t1 - t0, 6), compute_s=round(t2 - t1, 6), comm_opt_s=round(t3 - t2, 6))
            if preempted:
                self.saver.wait()
                self.save("preempted", asynchronous=False)
                raise Preempted(f"SIGTERM received; checkpoint committed at step {self.step}")
            if (cfg.checkpoint_every_steps and self.step % cfg.checkpoint_every_steps == 0) or due:
                self.save("interval")
            if (cfg.max_steps is not None and self.step >= cfg.max_steps) or limit:
                self.limit_reached = True
                break
        seconds = time.monotonic() - t_epoch
        self.train_seconds += seconds
        self.samples += trained * per_step * self.dist.world
        rate = trained * per_step * self.dist.world / max(seconds, 1e-9)
        left = (cfg.epochs - self.epoch - 1) * seconds
        self.log(f"epoch {self.epoch + 1}/{cfg.epochs}: {trained} steps in {seconds:.2f}s, {rate:.0f} samples/s,"
                 f" ETA {left:.0f}s at most (early stopping may end sooner)")
        return True

    def _anomaly_checkpoint(self) -> None:
        """Checkpoint the current (pre-step, last good) state after an anomaly, at most once per
        `anomaly_checkpoint_min_steps`: a storm of alerts must not become a storm of saves. Written in
        the background like any save: training waits only for the snapshot."""
        every = self.cfg.anomaly_checkpoint_min_steps
        if self._anomaly_save_step is not None and every and self.step - self._anomaly_save_step < every:
            return
        self._anomaly_save_step = self.step
        self.save("anomaly")

    def _diverged(self, gnorm: float) -> None:
        """Non-finite loss or gradients on some rank: keep the last good state and skip the batch next time."""
        self._anomaly("nonfinite", grad_norm=gnorm)
        self.opt.zero_grad(set_to_none=True)
        self.skip.add((self.epoch, self.pos))
        self.saver.wait()
        self.save("anomaly", asynchronous=False)
        raise DivergenceFailure(f"loss or gradients not finite at step {self.step + 1} (epoch {self.epoch}, batch"
                                f" {self.pos}); last good state checkpointed, the batch will be skipped on resume")

    def _rollback(self) -> bool:
        """Back to the last committed checkpoint, with the current batch on the skip list."""
        self.saver.wait()
        bad = (self.epoch, self.pos)
        path = ckpt.latest_valid(self.ckpt_root, log=self.log)
        if path is None:
            return False
        # Spikes that come back after every rollback are the data, not a fluke: after a few rollbacks to
        # the same checkpoint, keep going (the alert and the anomaly checkpoint still happen).
        tries = self._rollbacks.get(path.name, 0)
        if tries >= MAX_ROLLBACKS_PER_CHECKPOINT:
            self.log(f"loss spike at epoch {bad[0]} batch {bad[1]}: already rolled back {tries} times to"
                     f" {path.name}; continuing without rollback")
            return False
        self._rollbacks[path.name] = tries + 1
        self.opt.zero_grad(set_to_none=True)
        self.resume(path)
        self.skip.add(bad)
        self.log(f"loss spike at epoch {bad[0]} batch {bad[1]}: rolled back to {path.name}, batch skipped")
        return True

    def evaluate(self, data: Split) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        model = self.raw_model  # under FSDP the sharded module itself; its forward gathers the weights
        model.eval()
        idx = list(range(self.rank, len(data), self.dist.world))
        x = torch.from_numpy(data.features[idx]).to(self.dist.device)
        y = torch.from_numpy(data.labels[idx]).to(self.dist.device)
        with torch.no_grad():
            logits = model(x).float()
            loss_sum = float(F.cross_entropy(logits, y, reduction="sum")) if len(y) else 0.0
            correct = float((logits.argmax(1) == y).sum())
        n, loss_sum, correct = self.dist.all_sum([float(len(y)), loss_sum, correct])
        return {"accuracy": correct / max(n, 1), "loss": loss_sum / max(n, 1), "samples": n}

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.cfg.mode == "max":
            return value > self.best["value"] + self.cfg.min_delta
        return value < self.best["value"] - self.cfg.min_delta

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.resume()
        self.heartbeat()
        self.log(f"world {self.dist.world} ({self.dist.backend}, {cfg.parallelism}), {self.train_data.samples_per_rank * self.dist.world} train"
                 f" rows, micro-batch {cfg.micro_batch_size} x accum {cfg.grad_accum_steps}, lr {self.lr:g},"
                 f" epochs {cfg.epochs}")
        stopped_early = bool(self.history) and self.bad_epochs >= cfg.patience
        while not stopped_early and self.epoch < cfg.epochs:
            if not self.train_epoch():
                continue
            if self.limit_reached:
                self.log(f"step or time budget reached at step {self.step} (max_steps / max_seconds)")
                self.metrics.event("budget_reached", self.step)
                self.save("limit")
                break
            scores = self.evaluate(self.val_data)
            value = scores[cfg.metric]
            is_best = self.improved(value)
            self.history.append({"epoch": self.epoch, "step": self.step, "lr": self.opt.param_groups[0]["lr"],
                                 **scores})
            self.sched.step(value)
            self.epoch += 1
            self.pos = 0
            if is_best:
                self.best = {"step": self.step, "epoch": self.epoch - 1, "value": value}
                self.bad_epochs = 0
            else:
                self.bad_epochs += 1
            self.log(f"epoch {self.epoch}/{cfg.epochs}: val {cfg.metric} {value:.4f}"
                     f"{' (best)' if is_best else f' (no improvement {self.bad_epochs}/{cfg.patience})'}")
            self.metrics.event("epoch", self.step, epoch=self.epoch - 1, best=is_best, **scores)
            self.save("epoch")
            if self.bad_epochs >= cfg.patience:
                stopped_early = True
                self.log(f"early stop: no improvement in {cfg.patience} epochs")
        self.saver.wait()
        self.watchdog.stop()
        summary = {
            "steps": self.step, "epochs": self.epoch, "stopped_early": stopped_early,
            "best": self.best, "history": self.history,
            "best_checkpoint": str(self.ckpt_root / ckpt.step_dir_name(self.best["step"])) if self.best else None,
            "last_checkpoint": str(self.ckpt_root / ckpt.step_dir_name(self.step)),
            "world_size": self.dist.world, "skipped_batches": sorted(self.skip),
            "train_seconds": self.train_seconds, "samples": self.samples,
            "samples_per_second": self.samples / self.train_seconds if self.train_seconds else None,
        }
        if self.rank == 0:
            tmp = self.out / ".summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2))
            os.replace(tmp, self.out / "summary.json")
        return summary
