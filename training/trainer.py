"""The training loop run by every process that torchrun starts.

One process per rank. Rank 0 writes the summary and the event log. What keeps a run alive, step by
step (the pieces live in their own modules; this one is the loop):

* resume from the newest committed checkpoint, exactly (`training.checkpoint.manager`: weights,
  optimizer, loss scaler, LR schedule, data position, RNG of every rank, monitor state);
* one small all-reduce per step, started before backward and overlapping with it, carries the
  global loss and the flags every rank must agree on (preemption, a time-based checkpoint being due,
  the time budget), so ranks never diverge in their decisions; the gradient norm, the same on every
  rank after the gradient all-reduce, tells whether the gradients are finite;
* the anomaly policy (`training.anomaly`) judges each step: non-finite loss or gradients checkpoint
  the last good state with the batch on a skip list and exit with the divergence code (the next try
  skips it); a loss spike raises an alert and checkpoints the last good state or rolls back (batch skipped);
* SIGTERM (preemption): a synchronous checkpoint within the grace period, then the preempted code;
* a watchdog ends a process that makes no progress for the hang timeout, after dumping stacks.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from ballast.training import checkpoint as ckpt
from ballast.training.anomaly import AnomalyPolicy, Verdict
from ballast.training.checkpoint.manager import CheckpointManager
from ballast.training.config import RunConfig
from ballast.training.dataset.format import read_manifest
from ballast.training.dataset.loader import EpochLoader
from ballast.training.dataset.reader import Split, load_split
from ballast.training.distributed import Distributed
from ballast.training.failure import ConfigFailure, DivergenceFailure, Preempted, TrainingFailure
from ballast.training.faults import Injector, load_faults
from ballast.training.preflight import run_checks, state_bytes
from ballast.training.models import build_optimizer
from ballast.training.monitor import Metrics, grad_stats
from ballast.training.outputs import Summary, write_summary
from ballast.training.state import TrainState
from ballast.training.supervision import Supervision
from ballast.training.tasks import check_columns, ops as task_ops


class Trainer:
    def __init__(self, cfg: RunConfig):
        import torch

        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.dist = Distributed(cfg.distributed)
        self.rank = self.dist.rank
        self.state = TrainState()
        self.train_seconds = 0.0      # time inside the step loop (no evaluation, no end-of-epoch save)
        self.samples = 0
        self._resumed_at: float | None = None
        self._first_step = True  # this process's first step: the orchestrator times a restart to it
        self._started = time.monotonic()
        self.limit_reached = False
        self.metrics = Metrics(out_dir=self.out, rank=self.rank, port=cfg.execution.metrics_port, identity=cfg.identity)
        self.faults = Injector(load_faults(cfg.rehearsal), rank=self.rank, out_dir=self.out,
                               checkpoint_dir=Path(cfg.checkpoint.directory))

        # Resource guards: leave ~20% of the cores to data loading; cap GPU memory per process.
        cores = os.cpu_count() or 1
        threads = int(cores * (1 - cfg.resources.cpu_reserve_fraction)) // max(1, self.dist.local_world)
        torch.set_num_threads(max(1, threads))
        if self.dist.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(cfg.resources.gpu_memory_fraction, self.dist.device)
        torch.manual_seed(cfg.seed)

        data = cfg.data
        self.train_data = EpochLoader(Path(data.directory), fmt=data.format, rank=self.rank, world=self.dist.world,
                                      seed=cfg.seed, workers=data.loader_workers, prefetch=data.loader_prefetch,
                                      wait_seconds=data.wait_seconds)
        self._val_data: Split | None = None  # loaded at the first evaluation: a staged cache may bring it later
        manifest = read_manifest(Path(data.directory))
        check_columns(manifest, cfg.model.data, cfg.data.features, where=data.directory)
        # The task's loss and metrics (bits per byte from the tokenizer's byte lengths).
        self.task = task_ops.TaskOps(cfg.model.task, num_classes=cfg.model.data.get("num_classes"),
                                     token_bytes=(manifest.get("tokenizer") or {}).get("token_bytes"))
        if cfg.early_stop.metric not in self.task.metrics:
            raise ConfigFailure(f"early_stop.metric: {cfg.early_stop.metric!r} is not computed on this dataset ("
                                f"{cfg.model.task}: {', '.join(self.task.metrics)}; bits_per_byte needs a tokenizer)")

        self.raw_model, self.model = self.dist.build_model(cfg.model, precision=cfg.numerics.precision, seed=cfg.seed,
                                                          log=self.log)
        self.lr = cfg.optim.learning_rate
        self.opt = build_optimizer(cfg.optim.optimizer, self.model.parameters(), lr=self.lr,
                                   weight_decay=cfg.optim.weight_decay)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.opt, mode=cfg.early_stop.mode, factor=cfg.optim.lr_plateau.factor,
            patience=cfg.optim.lr_plateau.patience)
        self.autocast_dtype = None
        if cfg.numerics.precision == "bf16":
            self.autocast_dtype = torch.bfloat16
        elif cfg.numerics.precision == "fp16" and self.dist.device.type == "cuda":
            self.autocast_dtype = torch.float16
        # Dynamic loss scaling (fp16 only): the seed documents' 8192 / 100 (PyTorch's: 65536 / 2000).
        scale = cfg.numerics.loss_scale
        self.scaler = torch.amp.GradScaler(self.dist.device.type, enabled=self.autocast_dtype == torch.float16,
                                           init_scale=scale.initial, growth_interval=scale.growth_interval)
        self.anomalies = AnomalyPolicy(cfg.monitors, scaler=self.scaler, min_loss_scale=scale.minimum)
        self.checkpoints = CheckpointManager(
            cfg.checkpoint, dist=self.dist, model=self.raw_model, optimizer=self.opt, scaler=self.scaler,
            state=self.state, states={"lr_schedule": self.sched, "spike_window": self.anomalies},
            model_section=cfg.model, parallelism=cfg.distributed.parallelism, metrics=self.metrics, log=self.log)
        self.supervision = Supervision(out=self.out, rank=self.rank, device=self.dist.device, metrics=self.metrics,
                                       hang_timeout=cfg.execution.hang_timeout_seconds,
                                       preempt_grace=cfg.recovery.preempt_grace_seconds, step=lambda: self.state.step)

    @property
    def step(self) -> int:
        return self.state.step

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[train] {msg}", flush=True)

    # -- checkpoints -------------------------------------------------------------------------------

    def save(self, reason: str, *, asynchronous: bool | None = None, rng: dict | None = None) -> None:
        self.checkpoints.save(reason, asynchronous=asynchronous, rng=rng)

    def resume(self, path: Path | None = None) -> bool:
        loaded = self.checkpoints.load(path) if path is not None else self.checkpoints.start()
        if loaded:
            self._resumed_at = time.monotonic()
        return loaded

    # -- the loop ----------------------------------------------------------------------------------

    def _forward_loss(self, x, y, factor: float | None):
        """The task's loss of a micro-batch (computed in fp32 whatever the autocast precision)."""
        import torch

        ctx = torch.autocast(self.dist.device.type, dtype=self.autocast_dtype) \
            if self.autocast_dtype is not None else contextlib.nullcontext()
        with ctx:
            loss = self.task.loss(self.model(x), y)
        return loss * factor if factor is not None else loss

    def _anomaly(self, kind: str, **fields: Any) -> None:
        self.metrics.anomaly(kind)
        self.metrics.event("anomaly", self.step, kind=kind, epoch=self.state.epoch, pos=self.state.pos, **fields)

    @property
    def val_data(self) -> Split:
        if self._val_data is None:
            cfg = self.cfg
            self._val_data = load_split(Path(cfg.data.directory), "validation", fmt=cfg.data.format,
                                        num_classes=cfg.model.data.get("num_classes"),
                                        wait_seconds=cfg.data.wait_seconds)
        return self._val_data

    def train_epoch(self) -> bool:
        """Train the rest of the current epoch; False when a rollback moved to another epoch."""
        st, per_step = self.state, self.cfg.batch.per_process
        steps = self.train_data.samples_per_rank // per_step
        if steps == 0:
            raise TrainingFailure(f"no full optimizer step fits in an epoch: {self.train_data.samples_per_rank} rows"
                                  f" per rank for {per_step} samples per step", failure_class="data")
        self.model.train()
        t_epoch = time.monotonic()
        trained = 0
        epoch = st.epoch
        stream, stream_pos = None, -1
        while st.pos < steps:
            if st.epoch != epoch:
                return False  # rolled back into an earlier epoch: its data order must be rebuilt
            if stream_pos != st.pos:  # first step, or a rollback moved the position: restart the loader there
                stream = self.train_data.batches(epoch, batch=per_step, start=st.pos * per_step)
                stream_pos = st.pos
            if (st.epoch, st.pos) in st.skip:
                next(stream)
                stream_pos += 1
                st.pos += 1
                continue
            self.faults.fire(st.step + 1, settle=self.checkpoints.wait)
            t0 = time.monotonic()
            xb, yb = next(stream)
            stream_pos += 1
            if not self._step(xb, yb, t0):
                continue  # rolled back: the position moved
            trained += 1
            if self.limit_reached:
                break
        seconds = time.monotonic() - t_epoch
        self.train_seconds += seconds
        self.samples += trained * per_step * self.dist.world
        rate = trained * per_step * self.dist.world / max(seconds, 1e-9)
        left = (self.cfg.epochs - st.epoch - 1) * seconds
        self.log(f"epoch {st.epoch + 1}/{self.cfg.epochs}: {trained} steps in {seconds:.2f}s, {rate:.0f} samples/s,"
                 f" ETA {left:.0f}s at most (early stopping may end sooner)")
        return True

    def _step(self, xb, yb, t0: float) -> bool:
        """One optimizer step on a batch of this rank's samples; False when a rollback replaced it."""
        import torch

        cfg, st = self.cfg, self.state
        # An anomaly checkpoint records the generators as before this forward pass (its dropout masks).
        self._rng_before = self.checkpoints.rng_state()
        mb, accum = cfg.batch.micro_batch_size, cfg.batch.grad_accum_steps
        device, task = self.dist.device, self.task
        # Inputs a tensor or a dict of tensors; the target None where the task makes it (causal_lm).
        micro = [task.prepare(task_ops.to_device(x, device), task_ops.to_device(y, device))
                 for x, y in task_ops.micro_batches(xb, yb, mb, accum)]
        t1 = time.monotonic()
        agreed = self._forward_backward(micro, self.faults.loss_factor(st.step + 1))
        t2 = time.monotonic()
        self.scaler.unscale_(self.opt)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip_norm)
        # The gradient norm (reduced under FSDP), so its finiteness, is the same on every rank.
        gnorm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # DTensor under FSDP
        loss_sum, preempted, due, limit = agreed()
        loss = loss_sum / self.dist.world
        verdict = self.anomalies.judge(loss, gnorm, step=st.step)
        if verdict.action == "diverged":
            self._diverged(gnorm, verdict.detail)
        if st.step % cfg.monitors.stats_every_steps == 0 and self.rank == 0:
            self.metrics.event("grad_stats", st.step, grad_norm=gnorm, **grad_stats(self.raw_model.parameters()))
        if verdict.zscore is not None and self._spike(loss, verdict):
            return False
        self.anomalies.keep(loss, verdict)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.checkpoints.prepare()
        t3 = time.monotonic()
        st.step += 1
        st.pos += 1
        self._record_step(loss, gnorm, t0, t1, t2, t3)
        if preempted:
            self.checkpoints.wait()
            self.save("preempted", asynchronous=False)
            raise Preempted(f"SIGTERM received; checkpoint committed at step {st.step}")
        every = cfg.checkpoint.every_steps
        if (every and st.step % every == 0) or due:
            self.save("interval")
        if (cfg.rehearsal.max_steps is not None and st.step >= cfg.rehearsal.max_steps) or limit:
            self.limit_reached = True
        return True

    def _forward_backward(self, micro: list, factor: float | None):
        """Forward and backward over the micro-batches (gradients synchronised on the last one only);
        returns the function that waits for the agreed [loss sum, preempted, checkpoint due, over budget]."""
        import torch

        cfg = self.cfg
        accum = len(micro)
        ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        local_loss, agreed = None, None
        for i, (x, y) in enumerate(micro):
            last = i == accum - 1
            with contextlib.nullcontext() if last or not ddp else self.model.no_sync():
                loss = self._forward_loss(x, y, factor) / accum
                part = loss.detach().double().reshape(1)
                local_loss = part if local_loss is None else local_loss + part
                if last:
                    # What every rank must agree on, summed while backward and clipping run: the loss
                    # (a non-finite one on any rank makes the sum non-finite), preemption, a time-based
                    # checkpoint being due, the time budget being spent.
                    now = time.monotonic()
                    budget = cfg.rehearsal.max_seconds
                    host = torch.tensor([float(self.supervision.preempted),
                                         float(now - self.checkpoints.last_save >= cfg.checkpoint.every_seconds),
                                         float(budget is not None and now - self._started >= budget)],
                                        dtype=torch.float64)
                    agreed = self.dist.all_sum_async(torch.cat([local_loss, host.to(self.dist.device)]))
                self.scaler.scale(loss).backward()
        return agreed

    def _spike(self, loss: float, verdict: Verdict) -> bool:
        """Act on a loss spike; True when training rolled back (the step is not taken)."""
        self._anomaly("loss_spike", loss=loss, zscore=round(verdict.zscore, 2), action=self.cfg.monitors.spike_action)
        action = verdict.action
        if action == "rollback":
            if self._rollback():
                return True
            action = self.anomalies.after_failed_rollback(self.step)
        if action == "checkpoint":
            self.save("anomaly", rng=self._rng_before)  # the last good state: before this step applies
        return False

    def _record_step(self, loss: float, gnorm: float, t0: float, t1: float, t2: float, t3: float) -> None:
        step = self.step
        self.supervision.heartbeat(force=False)
        self.metrics.phases(data=t1 - t0, compute=t2 - t1, communication_optimizer=t3 - t2)
        lr, scale = self.opt.param_groups[0]["lr"], self.scaler.get_scale()  # once: the gauges and the event
        sps = self.cfg.batch.per_process * self.dist.world / max(t3 - t0, 1e-9)
        self.metrics.set(step=step, loss=loss, grad_norm=gnorm, loss_scale=scale, learning_rate=lr,
                         last_step_timestamp_seconds=time.time(), samples_per_second=sps)
        if self._first_step:
            self._first_step = False
            self.metrics.event("first_step", step)
        if self._resumed_at is not None:
            self.metrics.event("first_step_after_resume", step, seconds=time.monotonic() - self._resumed_at)
            self._resumed_at = None
        if step % 10 == 0:
            self.metrics.event("step", step, epoch=self.state.epoch, loss=loss, grad_norm=gnorm, lr=lr,
                               loss_scale=scale, data_s=round(t1 - t0, 6), compute_s=round(t2 - t1, 6),
                               comm_opt_s=round(t3 - t2, 6))

    def _diverged(self, gnorm: float, detail: str) -> None:
        """Non-finite loss or gradients on some rank: keep the last good state and skip the batch next time."""
        st = self.state
        self._anomaly("nonfinite", grad_norm=gnorm)
        self.opt.zero_grad(set_to_none=True)
        st.skip.add((st.epoch, st.pos))
        self.checkpoints.wait()
        self.save("anomaly", asynchronous=False, rng=self._rng_before)
        raise DivergenceFailure(f"loss or gradients not finite{detail} at step {st.step + 1} (epoch {st.epoch}, batch"
                                f" {st.pos}); last good state checkpointed, the batch will be skipped on resume")

    def _rollback(self) -> bool:
        """Back to the last committed checkpoint, with the current batch on the skip list."""
        self.checkpoints.wait()
        bad = (self.state.epoch, self.state.pos)
        path = self.checkpoints.latest()
        if path is None:
            return False
        if not self.anomalies.may_roll_back_to(path.name):
            self.log(f"loss spike at epoch {bad[0]} batch {bad[1]}: already rolled back"
                     f" {self.anomalies.rollbacks_to(path.name)} times to {path.name}; continuing without rollback")
            return False
        self.opt.zero_grad(set_to_none=True)
        self.scaler.update()  # close the abandoned step's unscale_ (fp16), or the next raises; the load restores the scale
        self.resume(path)
        self.state.skip.add(bad)
        self.log(f"loss spike at epoch {bad[0]} batch {bad[1]}: rolled back to {path.name}, batch skipped")
        return True

    def evaluate(self, data: Split) -> dict[str, float]:
        """Every metric of the task on `data`, each rank scoring its share (a micro-batch at a time) and
        the summable parts added over ranks (training.tasks.ops)."""
        model = self.raw_model  # under FSDP the sharded module itself; its forward gathers the weights
        model.eval()
        mine = task_ops.split_parts(model, self.task, data.features, data.labels, device=self.dist.device,
                                    batch=self.cfg.batch.micro_batch_size, rank=self.rank, world=self.dist.world)
        return self.task.scores(self.dist.all_sum(mine))

    def improved(self, value: float) -> bool:
        """Whether `value` is a new best validation score (the one rule: training.metrics.improved)."""
        from ballast.training.scores import improved

        best = self.state.best
        return improved(value, None if best is None else best["value"], mode=self.cfg.early_stop.mode,
                        min_delta=self.cfg.early_stop.min_delta)

    def run(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        patience, metric = cfg.early_stop.patience, cfg.early_stop.metric
        checks = run_checks(self.dist, checkpoint_dir=Path(cfg.checkpoint.directory),
                            need_bytes=state_bytes(self.raw_model, self.opt))
        self.metrics.event("preflight", st.step, **checks)
        self.resume()
        self.supervision.heartbeat()
        self.log(f"world {self.dist.world} ({self.dist.backend}, {cfg.distributed.parallelism}),"
                 f" {self.train_data.samples_per_rank * self.dist.world} train rows, micro-batch"
                 f" {cfg.batch.micro_batch_size} x accum {cfg.batch.grad_accum_steps}, lr {self.lr:g},"
                 f" epochs {cfg.epochs}")
        stopped_early = bool(st.history) and st.bad_epochs >= patience
        while not stopped_early and st.epoch < cfg.epochs:
            if not self.train_epoch():
                continue
            if self.limit_reached:
                self.log(f"step or time budget reached at step {st.step} (max_steps / max_seconds)")
                self.metrics.event("budget_reached", st.step)
                self.save("limit")
                break
            scores = self.evaluate(self.val_data)
            value = scores[metric]
            is_best = self.improved(value)
            record = {"epoch": st.epoch, "step": st.step, "lr": self.opt.param_groups[0]["lr"], **scores}
            self.sched.step(value)
            st.end_epoch(record, value=value, improved=is_best)
            self.log(f"epoch {st.epoch}/{cfg.epochs}: val {metric} {value:.4f}"
                     f"{' (best)' if is_best else f' (no improvement {st.bad_epochs}/{patience})'}")
            self.metrics.event("epoch", st.step, epoch=st.epoch - 1, best=is_best, **scores)
            self.save("epoch")
            if st.bad_epochs >= patience:
                stopped_early = True
                self.log(f"early stop: no improvement in {patience} epochs")
        self.checkpoints.wait()
        self.supervision.stop()
        root = self.checkpoints.root
        summary = Summary(
            steps=st.step, epochs=st.epoch, stopped_early=stopped_early, best=st.best, history=st.history,
            best_checkpoint=str(root / ckpt.step_dir_name(st.best["step"])) if st.best else None,
            last_checkpoint=str(root / ckpt.step_dir_name(st.step)),
            world_size=self.dist.world, skipped_batches=sorted(st.skip),
            train_seconds=self.train_seconds, samples=self.samples,
            samples_per_second=self.samples / self.train_seconds if self.train_seconds else None)
        if self.rank == 0:
            write_summary(self.out, summary)
        return summary.model_dump(mode="json")

