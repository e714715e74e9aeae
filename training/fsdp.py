"""Sharding a model over the ranks with FSDP2, block by block, and activation checkpointing per block.

A model names its blocks with a `ballast_blocks()` method (the built-ins do: gpt's Transformer blocks,
unet's convolution stages, the classic models' layers). Each block is its own FSDP unit, then the root
takes what is left (embeddings, final norm, head): a block's parameters are gathered just before its
forward (and backward) and freed after, so no rank holds every parameter at once during compute
(ZeRO-3). A model without `ballast_blocks()` is wrapped whole, with a warning: every parameter is then
gathered at once. The optimizer, built on the sharded (DTensor) parameters, keeps its state sharded
with them. Importing this module does not import torch.

A model that initializes itself in place (a `ballast_init_weights()` method: the built-ins do) is built
on the meta device and sharded there; each rank then allocates only its own shards on its device and the
model initializes them (`build_sharded`): no rank holds the whole model, not even while it is built. A
model without the method, one that cannot be built or initialized that way, or whose factory reads
weights as it builds and says so (`meta_build = False`: hf_causal_lm), is built whole on each rank
first, as before, with a line in the log.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any


def model_blocks(model: Any) -> list[Any] | None:
    """The modules `model.ballast_blocks()` names (each a submodule of `model`), or None without the method."""
    method = getattr(model, "ballast_blocks", None)
    if not callable(method):
        return None
    from ballast.training.failure import ConfigFailure

    blocks = list(method())
    inside = {id(m) for m in model.modules()}
    for i, block in enumerate(blocks):
        if id(block) not in inside or block is model:
            raise ConfigFailure(f"training.model: ballast_blocks()[{i}] ({type(block).__name__}) is not a submodule"
                                " of the model; return the model's own blocks (never the model itself)")
    return blocks


def checkpoint_activations(blocks: list[Any]) -> None:
    """Recompute each block's activations in backward instead of keeping them (torch.utils.checkpoint,
    non-reentrant, RNG state preserved so dropout draws the same masks). The recomputation leaves batch
    norms' running statistics alone: the forward already updated them once, as without recomputation (a
    second update would count every batch twice). The block keeps its name and its parameters' names:
    checkpoints are the same with or without it."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        inner = block.forward
        norms = [m for m in block.modules() if isinstance(m, _BatchNorm)]

        def contexts(_norms: list[Any] = norms) -> tuple[Any, Any]:
            return contextlib.nullcontext(), _not_tracking(_norms)

        def forward(*args: Any, _inner: Callable = inner, _contexts: Callable = contexts, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

        block.forward = forward


@contextlib.contextmanager
def _not_tracking(norms: list[Any]) -> Iterator[None]:
    """Batch norms that normalize by the batch's statistics, as in the forward, and leave their running
    ones as they are (momentum 0, the batch count put back): what a recomputed forward must do. The norms
    keep tracking, so the recomputation saves the very tensors the forward saved (checkpoint checks)."""
    kept = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, count) in zip(norms, kept):
            m.momentum = momentum
            if count is not None:
                m.num_batches_tracked.copy_(count)


def mixed_precision(precision: str) -> Any:
    """FSDP2's policy for `training.precision`: bf16 parameters and compute with fp32 gradient reduction
    for bf16; None (fp32 throughout) otherwise (fp16 stays autocast with the loss scaler)."""
    if precision != "bf16":
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def prepare_blocks(model: Any, *, sharded: bool, activation_checkpointing: bool,
                   log: Callable[[str], Any]) -> list[Any] | None:
    """The model's blocks, with activation checkpointing applied where asked; the warning for a model
    that names none where they were needed."""
    blocks = model_blocks(model)
    if not blocks and (sharded or activation_checkpointing):
        name = type(model).__name__
        lacks = "has no ballast_blocks() method" if blocks is None else "names no block (ballast_blocks() is empty)"
        log(f"warning: model {name} {lacks}: "
            + ("FSDP wraps it whole (every parameter gathered at once in forward and backward)" if sharded else "")
            + ("; " if sharded and activation_checkpointing else "")
            + ("no activation checkpointing (it is applied per block)" if activation_checkpointing else ""))
    if blocks and activation_checkpointing:
        checkpoint_activations(blocks)
    return blocks


def build_sharded(section: Any, *, device: Any, seed: int, rank: int, precision: str, activation_checkpointing: bool,
                  log: Callable[[str], Any]) -> Any | None:
    """The model of a run config's model section, sharded (`shard`) while still on the meta device, then
    this rank's shards allocated on `device` and initialized by the model's `ballast_init_weights()`;
    None where the model cannot be built that way (the caller builds it whole, then shards it): its
    factory says so, it has no such method, or building or initializing it there fails on any rank (a
    constructor that reads a tensor's value, say). The ranks agree on the outcome (collectively).

    Random initialization of sharded parameters: on CUDA, DTensor's RNG tracker draws each shard at its
    offset of rank 0's stream (independent draws); elsewhere DTensor draws each shard from the rank's own
    generator, so the ranks are seeded apart (`seed`, `rank`) for their shards to be independent draws.
    Buffers, which are not sharded, are then rank 0's on every rank. The process's random state is left
    as it was."""
    import torch

    from ballast.training.models import build_on_meta, registry

    if getattr(registry.load_factory(section.name), "meta_build", True) is False:
        log(f"model {section.name} is built whole on each rank, then sharded (its factory reads weights as it"
            " builds: no meta-device build)")
        return None
    model, why = build_on_meta(section)
    if model is not None and not callable(getattr(model, "ballast_init_weights", None)):
        why = "has no ballast_init_weights() method"
    why = why or None
    if _anyone(why is not None, device):
        log(f"warning: model {section.name} {why or 'cannot be built on the meta device on another rank'}: each"
            " rank builds it whole before sharding (the whole model in every process while it is built)")
        return None
    shard(model, precision=precision, activation_checkpointing=activation_checkpointing, log=log)
    model.to_empty(device=device)
    gpus = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=gpus), torch.no_grad(), warnings.catch_warnings():
            # DTensor's warning that its random ops on a CPU mesh use each rank's own generator: what the
            # per-rank seed is for.
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            torch.manual_seed(seed if gpus else (seed * 1_000_003 + rank) % (1 << 63))
            model.ballast_init_weights()
        why = None
    except Exception as exc:  # an init op sharded parameters do not support
        why = (f"ballast_init_weights() fails on sharded parameters ({type(exc).__name__}:"
               f" {str(exc).splitlines()[0][:200]})")
    if _anyone(why is not None, device):
        log(f"warning: model {section.name} {why or 'failed to initialize on another rank'}: each rank builds it"
            " whole before sharding (the whole model in every process while it is built)")
        return None
    import torch.distributed as dist

    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return model


def _anyone(flag: bool, device: Any) -> bool:
    """Whether `flag` holds on any rank of the default process group."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shard(model: Any, *, precision: str, activation_checkpointing: bool, log: Callable[[str], Any]) -> Any:
    """FSDP2 (`fully_shard`) on each block, then on the root; the model, sharded in place."""
    from torch.distributed.fsdp import fully_shard

    blocks = prepare_blocks(model, sharded=True, activation_checkpointing=activation_checkpointing, log=log)
    policy = mixed_precision(precision)
    kwargs = {"mp_policy": policy} if policy is not None else {}
    for block in blocks or []:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model
