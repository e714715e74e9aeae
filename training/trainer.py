"""The training loop run by every process that torchrun starts.

One process per rank; rank 0 writes metrics, the summary and the checkpoint manifest. Resumes from the
newest committed checkpoint in the run's checkpoint directory; stops early when the validation metric
has not improved for `patience` epochs; saves on a step interval, a time interval, every epoch end, and
on SIGTERM (preemption) before exiting with the preempted code.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

from training import checkpoint as ckpt
from training.config import RunConfig
from training.data import Split, epoch_order, load_split
from training.failure import DivergenceError, Preempted
from training.models import build_model


class _Dist:
    """The process group, or a stand-in when running as one plain process."""

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
        if self.enabled:
            if cuda:
                torch.cuda.set_device(self.device)
            dist.init_process_group(self.backend, timeout=dt.timedelta(seconds=cfg.dist_timeout_seconds))

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()

    def all_sum(self, values: list[float]) -> list[float]:
        import torch

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.enabled:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t.tolist()

    def any_flag(self, flag: bool) -> bool:
        return self.all_sum([1.0 if flag else 0.0])[0] > 0

    def close(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.destroy_process_group()


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
        self.pos = 0  # optimizer steps already taken in the current epoch
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.bad_epochs = 0
        self.preempt = False
        self._last_save = time.monotonic()
        # Leave about 20% of the cores for data loading (seed documents).
        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, int(cores * 0.8) // max(1, self.dist.local_world)))
        torch.manual_seed(cfg.seed)

        load = dict(fmt=cfg.data_format, feature=cfg.feature, label=cfg.label,
                    input_shape=cfg.input_shape, num_classes=cfg.num_classes)
        self.train_data = load_split(Path(cfg.data_dir), "train", **load)
        self.val_data = load_split(Path(cfg.data_dir), "validation", **load)

        model = build_model(cfg.model, input_shape=cfg.input_shape, num_classes=cfg.num_classes,
                            hidden=cfg.hidden_size, dropout=cfg.dropout).to(self.dist.device)
        self.model = model
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model, device_ids=[self.dist.device.index] if self.dist.device.type == "cuda" else None)
        params = self.model.parameters()
        if cfg.optimizer == "adamw":
            self.opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        else:
            self.opt = torch.optim.SGD(params, lr=cfg.learning_rate, momentum=0.9, weight_decay=cfg.weight_decay)
        self.autocast_dtype = None
        if cfg.precision == "bf16":
            self.autocast_dtype = torch.bfloat16
        elif cfg.precision == "fp16" and self.dist.device.type == "cuda":
            self.autocast_dtype = torch.float16
        self.scaler = torch.amp.GradScaler(self.dist.device.type, enabled=self.autocast_dtype == torch.float16,
                                           init_scale=8192, growth_interval=100)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- lifecycle ---------------------------------------------------------------------------------

    def _on_sigterm(self, signum, frame) -> None:
        self.preempt = True

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[train] {msg}", flush=True)

    def event(self, kind: str, **fields: Any) -> None:
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps({"event": kind, "time": time.time(), "step": self.step, **fields}) + "\n")

    def heartbeat(self) -> None:
        if self.rank == 0:
            (self.out / "heartbeat").write_text(f"{self.step} {time.time()}\n")

    # -- checkpoints -------------------------------------------------------------------------------

    def _raw_model(self):
        return getattr(self.model, "module", self.model)

    def save(self, reason: str) -> Path:
        import torch

        t0 = time.monotonic()
        w = ckpt.Writer(self.ckpt_root, self.step, rank=self.rank, barrier=self.dist.barrier)
        w.begin()
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state(self.dist.device)
        w.write_tensors(f"rng-rank{self.rank}.pt", rng)
        if self.rank == 0:
            w.write_tensors("model.pt", self._raw_model().state_dict())
            w.write_tensors("optim.pt", self.opt.state_dict())
            w.write_tensors("scaler.pt", {k: torch.tensor(v) if isinstance(v, (int, float)) else v
                                          for k, v in self.scaler.state_dict().items()})
            w.write_json("trainer.json", {
                "step": self.step, "epoch": self.epoch, "pos": self.pos, "world_size": self.dist.world,
                "history": self.history, "best": self.best, "bad_epochs": self.bad_epochs,
                "model": self.cfg.model, "input_shape": self.cfg.input_shape, "num_classes": self.cfg.num_classes,
                "hidden_size": self.cfg.hidden_size, "reason": reason})
        path = w.commit()
        if self.rank == 0:
            keep = {self.best["step"]} if self.best else set()
            ckpt.prune(self.ckpt_root, keep_last=self.cfg.keep_last, keep=keep)
        self._last_save = time.monotonic()
        self.event("checkpoint", path=str(path), reason=reason, seconds=round(time.monotonic() - t0, 4))
        return path

    def resume(self) -> None:
        import torch

        path = ckpt.latest_valid(self.ckpt_root, log=self.log)
        if path is None:
            self.log("no committed checkpoint; starting from scratch")
            return
        state = ckpt.read_trainer_state(path)
        if state["input_shape"] != self.cfg.input_shape or state["num_classes"] != self.cfg.num_classes \
                or state["model"] != self.cfg.model or state.get("hidden_size") != self.cfg.hidden_size:
            raise ckpt.CheckpointError(f"{path}: checkpoint is for model {state['model']} {state['input_shape']}"
                                       f" -> {state['num_classes']}, not this run's model; refusing to resume")
        try:
            self._raw_model().load_state_dict(ckpt.load_tensors(path / "model.pt"))
            self.opt.load_state_dict(ckpt.load_tensors(path / "optim.pt"))
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ckpt.CheckpointError(f"{path}: does not fit this model ({exc})") from exc
        scaler = ckpt.load_tensors(path / "scaler.pt")
        self.scaler.load_state_dict({k: v.item() if hasattr(v, "item") else v for k, v in scaler.items()})
        rng_file = path / f"rng-rank{self.rank}.pt"
        if rng_file.exists() and state["world_size"] == self.dist.world:
            rng = ckpt.load_tensors(rng_file)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"], self.dist.device)
        self.step, self.epoch, self.pos = state["step"], state["epoch"], state["pos"]
        self.history, self.best, self.bad_epochs = state["history"], state["best"], state["bad_epochs"]
        self.log(f"resumed from {path} (epoch {self.epoch}, step {self.step})")
        self.event("resume", path=str(path))

    # -- the loop ----------------------------------------------------------------------------------

    def _forward_loss(self, x, y):
        import torch
        import torch.nn.functional as F

        if self.autocast_dtype is not None:
            with torch.autocast(self.dist.device.type, dtype=self.autocast_dtype):
                return F.cross_entropy(self.model(x).float(), y)
        return F.cross_entropy(self.model(x), y)

    def train_epoch(self) -> None:
        import contextlib

        import torch

        cfg = self.cfg
        order = epoch_order(len(self.train_data), seed=cfg.seed, epoch=self.epoch,
                            rank=self.rank, world=self.dist.world)
        per_step = cfg.micro_batch_size * cfg.grad_accum_steps
        steps = len(order) // per_step
        if steps == 0:
            raise DivergenceError("no full optimizer step fits in an epoch: too few training rows for the batch",
                                  failure_class="data")
        x_all = torch.from_numpy(self.train_data.features)
        y_all = torch.from_numpy(self.train_data.labels)
        self.model.train()
        t_epoch = time.monotonic()
        while self.pos < steps:
            base = self.pos * per_step
            losses = []
            for micro in range(cfg.grad_accum_steps):
                idx = torch.from_numpy(order[base + micro * cfg.micro_batch_size: base + (micro + 1) * cfg.micro_batch_size])
                x = x_all[idx].to(self.dist.device, non_blocking=True)
                y = y_all[idx].to(self.dist.device, non_blocking=True)
                last = micro == cfg.grad_accum_steps - 1
                sync = contextlib.nullcontext() if last or not self.dist.enabled else self.model.no_sync()
                with sync:
                    loss = self._forward_loss(x, y) / cfg.grad_accum_steps
                    self.scaler.scale(loss).backward()
                losses.append(loss.detach())
            self.scaler.unscale_(self.opt)
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip_norm)
            step_loss = float(torch.stack(losses).sum())
            if not math.isfinite(step_loss) or not math.isfinite(float(gnorm)):
                if self.autocast_dtype is None or self.autocast_dtype == torch.bfloat16:
                    raise DivergenceError(f"loss or gradient is not finite at step {self.step} (loss {step_loss}, "
                                          f"grad norm {float(gnorm)})")
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            self.pos += 1
            self.heartbeat()
            if self.step % 10 == 0:
                self.event("step", epoch=self.epoch, loss=step_loss, grad_norm=float(gnorm))
            due = (cfg.checkpoint_every_steps and self.step % cfg.checkpoint_every_steps == 0) or \
                (time.monotonic() - self._last_save >= cfg.checkpoint_every_seconds)
            preempt = self.dist.any_flag(self.preempt)
            if due or preempt:
                self.save("preempted" if preempt else "interval")
            if preempt:
                raise Preempted(f"SIGTERM received; checkpoint saved at step {self.step}")
        seconds = time.monotonic() - t_epoch
        rate = steps * per_step * self.dist.world / max(seconds, 1e-9)
        left = (cfg.epochs - self.epoch - 1) * seconds
        self.log(f"epoch {self.epoch + 1}/{cfg.epochs}: {steps} steps in {seconds:.2f}s, {rate:.0f} samples/s,"
                 f" ETA {left:.0f}s at most (early stopping may end sooner)")

    def evaluate(self, data: Split) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        model = self._raw_model()
        model.eval()
        # Each rank scores its own slice; sums are all-reduced.
        idx = range(self.rank, len(data), self.dist.world)
        x = torch.from_numpy(data.features[list(idx)]).to(self.dist.device)
        y = torch.from_numpy(data.labels[list(idx)]).to(self.dist.device)
        with torch.no_grad():
            logits = model(x) if len(y) else torch.zeros(0, self.cfg.num_classes)
            loss_sum = float(F.cross_entropy(logits.float(), y, reduction="sum")) if len(y) else 0.0
            correct = float((logits.argmax(1) == y).sum()) if len(y) else 0.0
        n, loss_sum, correct = self.dist.all_sum([float(len(y)), loss_sum, correct])
        return {"accuracy": correct / max(n, 1), "loss": loss_sum / max(n, 1), "samples": n}

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        best = self.best["value"]
        if self.cfg.mode == "max":
            return value > best + self.cfg.min_delta
        return value < best - self.cfg.min_delta

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.resume()
        self.log(f"world {self.dist.world} ({self.dist.backend}), {len(self.train_data)} train rows, "
                 f"micro-batch {cfg.micro_batch_size} x accum {cfg.grad_accum_steps}, epochs {cfg.epochs}")
        stopped_early = False
        if self.history and self.bad_epochs >= cfg.patience:
            stopped_early = True  # resumed after the stop decision was already taken
        while not stopped_early and self.epoch < cfg.epochs:
            self.train_epoch()
            scores = self.evaluate(self.val_data)
            value = scores[cfg.metric]
            is_best = self.improved(value)
            self.history.append({"epoch": self.epoch, "step": self.step, **scores})
            self.epoch += 1
            self.pos = 0
            if is_best:
                self.best = {"step": self.step, "epoch": self.epoch - 1, "value": value}
                self.bad_epochs = 0
            else:
                self.bad_epochs += 1
            self.log(f"epoch {self.epoch}/{cfg.epochs}: val {cfg.metric} {value:.4f}"
                     f"{' (best)' if is_best else f' (no improvement {self.bad_epochs}/{cfg.patience})'}")
            self.event("epoch", epoch=self.epoch - 1, best=is_best, **scores)
            self.save("epoch")
            if self.bad_epochs >= cfg.patience:
                stopped_early = True
                self.log(f"early stop: no improvement in {cfg.patience} epochs")
        summary = {
            "steps": self.step, "epochs": self.epoch, "stopped_early": stopped_early,
            "best": self.best, "history": self.history,
            "best_checkpoint": str(self.ckpt_root / ckpt.step_dir_name(self.best["step"])) if self.best else None,
            "last_checkpoint": str(self.ckpt_root / ckpt.step_dir_name(self.step)),
            "world_size": self.dist.world,
        }
        if self.rank == 0:
            tmp = self.out / ".summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2))
            os.replace(tmp, self.out / "summary.json")
        return summary
