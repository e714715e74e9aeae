"""The process group a training process joins, from torchrun's environment (or none for one process).

Every rank also joins a separate gloo group used only by the checkpoint writer, so that a background
save's collectives never interleave with training's (the hang seen with async_save on the training
group, ../shared/STACK.md).
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any, Callable

from ballast.training.config.run import DistributedConfig


class Distributed:
    """The process group (plus a separate gloo group for checkpoint writes), or a single process."""

    def __init__(self, cfg: DistributedConfig):
        import torch
        import torch.distributed as dist

        self.cfg = cfg
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
            timeout = dt.timedelta(seconds=cfg.timeout_seconds)
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

    def build_model(self, section: Any, *, precision: str, seed: int,
                    log: Callable[[str], Any] = print) -> tuple[Any, Any]:
        """The model of a run config's model section on this process's device, and that model
        parallelized (`parallelize`): under FSDP both are the one sharded model, built on the meta device
        where the model allows it (training.fsdp.build_sharded), so that no rank holds it whole."""
        from ballast.training import fsdp
        from ballast.training.models import build_configured_model

        d = self.cfg
        if self.enabled and d.parallelism == "fsdp":
            model = fsdp.build_sharded(section, device=self.device, seed=seed, rank=self.rank, precision=precision,
                                       activation_checkpointing=d.activation_checkpointing, log=log)
            if model is not None:
                return model, model
        raw = build_configured_model(section).to(self.device)
        return raw, self.parallelize(raw, precision=precision, log=log)

    def parallelize(self, model: Any, *, precision: str = "fp32", log: Callable[[str], Any] = print) -> Any:
        """DDP (optionally with gradient compression) or FSDP2 per block (training.fsdp) over the process
        group; as is alone. Activation checkpointing, where asked, applies per block in every case."""
        from ballast.training import fsdp

        d = self.cfg
        if self.enabled and d.parallelism == "fsdp":
            # ZeRO-3: parameters, gradients and optimizer state sharded over ranks, gathered block by block
            return fsdp.shard(model, precision=precision, activation_checkpointing=d.activation_checkpointing,
                              log=log)
        fsdp.prepare_blocks(model, sharded=False, activation_checkpointing=d.activation_checkpointing, log=log)
        if not self.enabled:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if d.gradient_compression != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
            ddp.register_comm_hook(None, hook[d.gradient_compression])
        return ddp
