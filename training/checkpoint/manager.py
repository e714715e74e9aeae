"""What a training checkpoint holds, and saving and loading it: the trainer calls `save(reason)` and `load()`.

A checkpoint is the model and optimizer (under DDP the full state, each rank writing a byte-balanced
share of the replicated optimizer state; under FSDP the sharded state through torch.distributed.checkpoint,
each rank writing and reading only its own shards, `checkpoint.dcp`), the loss scaler, every
rank's RNG, and trainer.json: the `TrainState`, the JSON states given as `states` (LR schedule, the
anomaly policy's spike window) and the model section the weights fit (what `recorded_model` reads).
Saves are snapshotted into reused buffers and written by the `AsyncSaver`; loads never unpickle.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from ballast.training.checkpoint import dcp
from ballast.training.checkpoint.average import average
from ballast.training.checkpoint.commit import MODEL_KEY, TRAINER_STATE, committed, read_trainer_state, recorded_model
from ballast.training.checkpoint.fetch import NodeFetch
from ballast.training.checkpoint.fileio import load_tensors
from ballast.training.checkpoint.saver import AsyncSaver
from ballast.training.checkpoint.sharding import load_optimizer, optimizer_part, optimizer_shares
from ballast.training.checkpoint.snapshot import Snapshot
from ballast.training.config.run import CheckpointConfig, ModelConfig
from ballast.training.failure import CheckpointFailure
from ballast.training.outputs import trainer_state
from ballast.training.state import TrainState


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, *, dist: Any, model: Any, optimizer: Any, scaler: Any,
                 state: TrainState, states: dict[str, Any], model_section: ModelConfig, parallelism: str,
                 metrics: Any, log: Callable[[str], None]):
        self.cfg = cfg
        self.root = Path(cfg.directory)
        self.dist, self.model, self.optimizer, self.scaler = dist, model, optimizer, scaler
        self.state, self.states, self.model_section, self.parallelism = state, states, model_section, parallelism
        self.sharded = parallelism == "fsdp" and dist.enabled  # FSDP state: sharded checkpoints (DCP)
        self.metrics, self.log = metrics, log
        self.verified: dict[Path, str] = {}  # sharded checkpoint -> sha256 of the metadata the gate checked
        metrics.set(checkpoint_interval_seconds=cfg.every_seconds)  # the stale-checkpoint alert's bound
        self.saver = AsyncSaver(self.root, rank=dist.rank, barrier=dist.ckpt_barrier,
                                idle=cfg.writer_priority == "idle", on_written=self._written,
                                process=cfg.writer_process and cfg.asynchronous,
                                keep_last=cfg.keep_last, log=log, local_rank=dist.local_rank,
                                node_local=cfg.node_local and dist.enabled,
                                gather=lambda obj: gather_json(obj, dist.ckpt_group))
        # The snapshot's buffers in shared memory where a writer process writes them (checkpoint.writer_process).
        self.snapshot = Snapshot(pin=dist.device.type == "cuda", shared=self.saver.use_process)
        self.last_save = time.monotonic()

    # -- saving ------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Allocate (and touch) the snapshot buffers once the optimizer has its state, once per process:
        not inside the first save, which a preemption notice may be waiting on."""
        if not self.snapshot.buffers:
            self._snapshot()
        if self.cfg.asynchronous:
            self.saver.start_process()

    def save(self, reason: str, *, asynchronous: bool | None = None, rng: dict | None = None) -> None:
        """Checkpoint the state as it is now; `rng`: the random generators' states to record instead of
        the current ones (`rng_state()` taken before a step whose forward pass has already drawn from
        them, for a checkpoint of the state before that step)."""
        t0 = time.monotonic()
        self.saver.wait()  # the snapshot buffers are reused: the previous write must be done
        use_async = self.cfg.asynchronous if asynchronous is None else asynchronous
        # A synchronous save writes the live shards (training waits for it): no copy into the snapshot.
        tensors, parts, sharded = self._snapshot(rng, copy_shards=use_async)
        jsons: dict[str, Any] = {}
        if self.dist.rank == 0:
            if sharded is not None:
                jsons[dcp.GROUPS_FILE] = dcp.groups_json(sharded[1])
            jsons[TRAINER_STATE] = trainer_state(**{
                **self.state.state_dict(), "world_size": self.dist.world,
                **{key: obj.state_dict() for key, obj in self.states.items()},
                # The model section (name, options, data): what the weights can be rebuilt from.
                MODEL_KEY: self.model_section.model_dump(mode="json"),
                "parallelism": self.parallelism, "reason": reason, "optim_parts": parts,
                "state_format": "dcp" if sharded is not None else "pt"})
        keep = {self.state.best["step"]} if self.state.best else set()
        shards = None
        if sharded is not None:
            def shards(directory: Path, state: dict = sharded[0]) -> dict[str, Any]:
                return dcp.write(state, directory, rank=self.dist.rank, group=self.dist.ckpt_group,
                                 staging=self.saver.staging)
        self.saver.save(self.state.step, tensors, jsons, keep=keep, asynchronous=use_async, shards=shards)
        blocked = time.monotonic() - t0
        self.last_save = time.monotonic()
        self.metrics.set(checkpoint_save_seconds=blocked)
        self.metrics.event("checkpoint", self.state.step, reason=reason, blocked_seconds=round(blocked, 4),
                           asynchronous=use_async)

    def wait(self) -> None:
        """Until the save in flight is committed (raises if it failed)."""
        self.saver.wait()

    def _written(self, step: int, seconds: float, cpu_seconds: float) -> None:
        """From the writer: checkpoint `step` is committed, `seconds` after its write began, having used
        `cpu_seconds` of CPU time on the writing thread."""
        self.metrics.set(checkpoint_write_seconds=seconds, checkpoint_write_cpu_seconds=cpu_seconds,
                         last_checkpoint_timestamp_seconds=time.time())
        self.metrics.event("checkpoint_written", step, write_seconds=round(seconds, 3),
                           write_cpu_seconds=round(cpu_seconds, 3))

    def rng_state(self) -> dict[str, Any]:
        """This rank's random generators (dropout draws from them): what a checkpoint records."""
        import torch

        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state(self.dist.device)
        return rng

    def _snapshot(self, rng: dict | None = None, *,
                  copy_shards: bool = True) -> tuple[dict[str, Any], int, tuple | None]:
        """This rank's checkpoint tensors, copied into the reused snapshot buffers; the number of
        optimizer parts; under FSDP (sharded, nothing gathered) the snapshot of this rank's shards of the
        model and optimizer state (`copy_shards` false: the live shards), with the parameter groups."""
        import torch

        rank = self.dist.rank
        rng = rng if rng is not None else self.rng_state()
        tensors: dict[str, Any] = {f"rng-rank{rank}.pt": self.snapshot.copy(rng, ("rng",))}
        if rank == 0:
            tensors["scaler.pt"] = {k: torch.tensor(v) for k, v in self.scaler.state_dict().items()
                                    if isinstance(v, (int, float))}
        if self.sharded:
            state, groups = dcp.sharded_state(self.model, self.optimizer)
            return tensors, 0, (self.snapshot.copy(state, ("dcp",)) if copy_shards else state, groups)
        model_sd, optim_sd = self.model.state_dict(), self.optimizer.state_dict()
        # Every rank holds the same optimizer state: each snapshots and writes its share.
        parts = self.dist.world
        model_bytes = sum(t.numel() * t.element_size() for t in model_sd.values())
        mine = optimizer_shares(optim_sd, parts, rank0_bytes=model_bytes)[rank]
        tensors[f"optim-part{rank}.pt"] = self.snapshot.copy(
            optimizer_part(optim_sd, mine, first=rank == 0), ("optim",))
        if rank == 0:
            tensors["model.pt"] = self.snapshot.copy(model_sd, ("model",))
        return tensors, parts, None

    # -- loading -----------------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest checkpoint that passes the verification gate (`training.checkpoint.gate.check`);
        newer ones that fail are skipped here and quarantined by the orchestrator."""
        from ballast.training.checkpoint.gate import latest_passing

        return latest_passing(self.root, quarantine_failures=False, log=self.log, **self._split_gate(),
                              **self._node_local_gate(), verified=self.verified)

    def _split_gate(self) -> dict[str, Any]:
        """With several ranks, they split the gate (each its share of the files' hashes and of the
        tensors) and agree on its outcome; collective over the checkpoint group."""
        if not self.dist.enabled:
            return {}
        return {"share": (self.dist.rank, self.dist.world),
                "agree": lambda value: gather_json(value, self.dist.ckpt_group)}

    def _node_local_gate(self) -> dict[str, Any]:
        """A node-local directory may be resumed from once what this node's ranks read is here (`fetch`),
        each node checking the files it holds, split between its ranks."""
        if not (self.cfg.node_local and self.cfg.fetch and self.dist.enabled):
            return {}
        fetch = NodeFetch(self.cfg.fetch, model=self.model, optimizer=self.optimizer, dist=self.dist, root=self.root,
                          gather=lambda obj: gather_json(obj, self.dist.ckpt_group))
        return {"prepare": fetch, "node_share": (self.dist.local_rank, self.dist.local_world)}

    def _passes(self, path: Path) -> bool:
        """Whether `path` passes the gate (split between the ranks, which all get the same answer)."""
        from ballast.training.checkpoint.gate import agreed_failure

        failure = agreed_failure(path, **self._split_gate(), **self._node_local_gate(), verified=self.verified)
        if failure:
            self.log(f"not averaged: {failure}")
        return failure is None

    def start(self) -> bool:
        """What a process starts from: the newest checkpoint that passes the gate (True), unless
        checkpoint.resume is false; without one, the warm-start weights (init_weights) if given."""
        if not self.cfg.resume:
            self.log("checkpoint.resume is false: starting from step 0")
            return False
        if self.load():
            return True
        if self.cfg.init_weights:
            self.init_weights(Path(self.cfg.init_weights))
        return False

    def init_weights(self, path: Path) -> None:
        """Start from the model weights in `path` (a warm start: weights only, a fresh optimizer)."""
        weights = load_tensors(path)
        try:
            self.model.load_state_dict(weights)
        except (RuntimeError, KeyError) as exc:
            raise CheckpointFailure(f"{path}: does not fit this model ({str(exc).splitlines()[0]})") from exc
        self.log(f"no checkpoint; starting from the weights in {path} (warm start)")

    def load(self, path: Path | None = None) -> bool:
        """Restore everything from `path` (default: the latest valid checkpoint); False if there is none."""
        import torch

        t0 = time.monotonic()
        path = path or self.latest()
        if path is None:
            self.log("no committed checkpoint; starting from scratch")
            return False
        saved = read_trainer_state(path)
        self._check_model(path)
        self._load_weights(path, saved)
        scaler = load_tensors(path / "scaler.pt")
        if scaler:
            self.scaler.load_state_dict({k: v.item() for k, v in scaler.items()})
        rng_file = path / f"rng-rank{self.dist.rank}.pt"
        if rng_file.exists() and saved["world_size"] == self.dist.world:
            rng = load_tensors(rng_file)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"], self.dist.device)
        elif saved["world_size"] != self.dist.world:
            self.log(f"world size changed {saved['world_size']} -> {self.dist.world}: weights and optimizer kept,"
                     f" RNG streams and the data order restart for the new world")
        self.state.load_state_dict(saved)
        for key, obj in self.states.items():
            if saved.get(key) is not None:  # an empty spike window is restored too: a rollback clears it
                obj.load_state_dict(saved[key])
        seconds = time.monotonic() - t0
        self.metrics.set(checkpoint_load_seconds=seconds)
        self.log(f"resumed from {path} (epoch {self.state.epoch}, step {self.state.step}) in {seconds:.2f}s")
        self.metrics.event("resume", self.state.step, path=str(path), seconds=round(seconds, 4))
        return True

    def _load_weights(self, path: Path, saved: dict[str, Any]) -> None:
        """The model and optimizer state of `path` (the model's as the mean of the last checkpoints where
        resume_average_last asks): sharded through DCP, or the full files."""
        from torch.distributed.checkpoint.api import CheckpointException

        average_last = self.cfg.resume_average_last
        recent: list[Path] = []
        if average_last > 1:  # the last ones up to the one resumed from (newer ones failed the gate), that pass it
            upto = [p for p in committed(self.root) if p.name <= path.name]
            recent = [p for p in upto[-average_last:] if p == path or self._passes(p)]
        if len(recent) > 1:
            self.log(f"resuming from the average of {len(recent)} checkpoints: {', '.join(p.name for p in recent)}")
        else:
            recent = []
        try:
            if saved.get("state_format") == "dcp":
                self._load_sharded(path, recent)
                return
            model_sd = average(recent) if recent else load_tensors(path / "model.pt")
            parts = saved.get("optim_parts")
            if not isinstance(parts, int) or parts < 1:
                raise CheckpointFailure(f"{path / TRAINER_STATE}: optim_parts is {parts!r}, expected the number"
                                        f" of optimizer state files (optim-part<R>.pt); refusing to resume")
            self._load_full_state(model_sd, load_optimizer(path, parts))
        except CheckpointException as exc:  # DCP's (a BaseException): a shard it could not read
            raise CheckpointFailure(f"{path}: cannot read the shards through DCP ({dcp.first_line(exc)})") from exc
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointFailure(f"{path}: does not fit this model ({str(exc).splitlines()[0]})") from exc

    def _load_sharded(self, path: Path, recent: list[Path]) -> None:
        """Each rank reads its own shards of a DCP checkpoint, resharded to this run's world size."""
        from ballast.training.models import keeping_optimizer_kernel

        if not self.sharded:
            raise CheckpointFailure(f"{path}: a sharded (fsdp) checkpoint, and this run is not sharded (parallelism"
                                    f" {self.parallelism}, {self.dist.world} process(es)); resume it with"
                                    f" parallelism fsdp on 2 or more processes")
        groups_file = path / dcp.GROUPS_FILE
        try:
            groups = json.loads(groups_file.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointFailure(f"{groups_file}: unreadable optimizer groups ({exc})") from exc
        with keeping_optimizer_kernel(self.optimizer):
            dcp.read_into(self.model, self.optimizer, path, groups=groups, group=self.dist.ckpt_group,
                          digest=self.verified.get(path))
        if recent:
            dcp.average_into(self.model, recent, group=self.dist.ckpt_group, digests=self.verified)

    def _check_model(self, path: Path) -> None:
        """Refuse a checkpoint of another model: its name, its data and every option but dropout (which
        changes no weight) must be what the checkpoint recorded."""
        theirs = recorded_model(path)
        mine = self.model_section.model_dump(mode="json")

        def weights_of(m: dict[str, Any]) -> dict[str, Any]:
            return {**m, "options": {k: v for k, v in m["options"].items() if k != "dropout"}}

        if weights_of(theirs) != weights_of(mine):
            def describe(m: dict[str, Any]) -> str:
                options = ", ".join(f"{k}={v}" for k, v in sorted(m["options"].items()))
                return f"{m['name']}({options}) for {m['data'].get('task')} {m['data'].get('input_shape')}"

            raise CheckpointFailure(f"{path}: checkpoint is for model {describe(theirs)}, not this run's"
                                    f" {describe(mine)}; refusing to resume")

    def _load_full_state(self, model_sd: dict, optim_sd: dict | None) -> None:
        from ballast.training.models import keeping_optimizer_kernel

        with keeping_optimizer_kernel(self.optimizer):
            if self.sharded:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

                # Every rank read the full state from the (shared) checkpoint directory; each keeps its
                # shard. (broadcast_from_rank0 with empty dicts on the other ranks hung on gloo here.)
                set_state_dict(self.model, self.optimizer, model_state_dict=model_sd,
                               optim_state_dict=optim_sd or {}, options=StateDictOptions(full_state_dict=True))
                return
            self.model.load_state_dict(model_sd)
            if optim_sd is not None:
                self.optimizer.load_state_dict(optim_sd)


def gather_json(obj: Any, group: Any) -> list[Any]:
    """Every rank's JSON value `obj`, in rank order, on every rank (collective over `group`): as UTF-8
    bytes in tensors, so that nothing a peer sends is unpickled."""
    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(n) for n in sizes)
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, torch.cat([data, torch.zeros(longest - data.numel(), dtype=torch.uint8)]), group=group)
    return [json.loads(t[:int(n)].numpy().tobytes().decode()) for t, n in zip(out, sizes)]
