"""A plain, hand-written DDP training loop: the yardstick for `ballast bench overhead` and `bench lm`.

Same model, data, order, loss and optimizer as the trainer, with none of its monitors, checkpoints or
metrics: the task's inputs and loss as any PyTorch user writes them (a causal language model: the
sequence's tokens but the last in, cross-entropy against the tokens shifted by one). Run under torchrun
with the trainer's run config; writes baseline.json to the output dir.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ballast.training.config import RunConfig
    from ballast.training.dataset.loader import EpochLoader
    from ballast.training.models import build_configured_model, build_optimizer
    from ballast.training.tasks.ops import TaskOps

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = RunConfig.load(parser.parse_args().config)
    if cfg.resources.reuse_freed_memory:  # the same process set-up as the trainer's: this compares the loops
        from ballast.training.hostmem import keep_freed_memory

        keep_freed_memory()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, int(cores * (1 - cfg.resources.cpu_reserve_fraction)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    torch.manual_seed(cfg.seed)
    data = EpochLoader(Path(cfg.data.directory), fmt=cfg.data.format, rank=rank, world=world, seed=cfg.seed,
                       workers=cfg.data.loader_workers, prefetch=cfg.data.loader_prefetch)
    model = DDP(build_configured_model(cfg.model))
    task = TaskOps(cfg.model.task, num_classes=cfg.model.data.get("num_classes"))
    opt = build_optimizer(cfg.optim.optimizer, model.parameters(), lr=cfg.optim.learning_rate, weight_decay=cfg.optim.weight_decay)
    per_step = cfg.batch.micro_batch_size * cfg.batch.grad_accum_steps
    seconds, samples = 0.0, 0
    for epoch in range(cfg.epochs):
        steps = data.samples_per_rank // per_step
        t0 = time.monotonic()
        # The same window as the trainer's: `steps` full batches, the clock stopped before the loader's
        # leftover rows (its workers persist across epochs, as the trainer's do).
        batches = data.batches(epoch, batch=per_step)
        for _, (x, y) in zip(range(steps), batches):
            x, y = task.prepare(x, y)
            loss = task.loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        seconds += time.monotonic() - t0
        del batches
        samples += steps * per_step * world
    if rank == 0:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "baseline.json").write_text(json.dumps(
            {"train_seconds": seconds, "samples": samples, "samples_per_second": samples / seconds}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
