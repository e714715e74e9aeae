"""A saved model for forward passes in one process that need not hold it whole: the orchestrator's
verification probe and evaluation (with its `if_better` baseline) use it.

`load(src, section, budget=...)` builds the model a recorded model section describes and gives it the
weights at `src` (a checkpoint directory: its model.pt or a sharded checkpoint's pieces; a tensor file;
published safetensors, one file or the index of its shards; read through `export.source`, nothing
unpickled):

- whole, read once, when the weights fit `budget` bytes;
- else on the meta device, the model's `ballast_init_weights()` computing its buffers: what lies
  outside its blocks (`ballast_blocks()`: embeddings, final norm, head) is read and kept, then as many
  blocks as the rest of the budget holds, in order; every other block's weights are read just before
  its forward and dropped after it (forward hooks). A forward pass then holds the kept part and one
  block, whatever the model's size, and reads the streamed blocks again on every pass: slower, by
  as much as reading them costs (the page cache keeps what fits), but it runs.

A model that names no block or cannot compute its own buffers (no `ballast_init_weights()`) is only
loaded whole. Importing this module does not import torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ballast.training.checkpoint import export
from ballast.training.failure import CheckpointFailure

BUDGET_FRACTION = 0.5
"""Of the memory this process can still take: the rest is for activations, the data and the allocator."""


def memory_budget() -> int:
    """Bytes of weights this process may hold: BUDGET_FRACTION of what it can still take (MemAvailable,
    or its cgroup's limit less its usage where that is lower)."""
    room = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room = min(room if room is not None else 1 << 62, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return int(BUDGET_FRACTION * (room if room is not None else (os.sysconf("SC_PAGE_SIZE")
                                                              * os.sysconf("SC_PHYS_PAGES"))))


@dataclass
class Streaming:
    """How a streamed model holds its weights: bytes kept, blocks streamed, and (counted as it runs) the
    most weight bytes held at once and the bytes read again."""

    total: int
    kept: int
    streamed_blocks: int
    blocks: int
    held: int = 0
    peak: int = 0
    reread: int = 0
    sizes: dict[int, int] = field(default_factory=dict)

    def describe(self) -> str:
        return (f"{self.total / 1e9:.2f} GB of weights: {self.kept / 1e9:.2f} GB kept, {self.streamed_blocks} of"
                f" {self.blocks} blocks read at every forward pass and dropped after it")


def load(src: Path, section: Any, *, budget: int, log: Callable[[str], Any] | None = None) -> Any:
    """The model of `section` (a recorded model section) with the weights at `src`: whole within
    `budget` bytes, else streamed block by block (above). A streamed model carries its `Streaming` as
    `ballast_streaming`. Weights that do not fit the model are a CheckpointFailure naming `src`."""
    import torch

    from ballast.training.fsdp import model_blocks
    from ballast.training.models import build_configured_model

    from ballast.training.models import registry

    source = export.source(Path(src))
    total = sum(source.sizes.values())
    if total <= budget or getattr(registry.load_factory(section.name), "meta_build", True) is False:
        return _whole(src, build_configured_model(section), source)
    with torch.device("meta"):
        model = build_configured_model(section)
    blocks = model_blocks(model)
    init = getattr(model, "ballast_init_weights", None)
    if not blocks or not callable(init):
        if log:
            log(f"{src}: {total / 1e9:.2f} GB of weights, over the budget of {budget / 1e9:.2f} GB, but model"
                f" {type(model).__name__} names no block or has no ballast_init_weights(): read whole")
        return _whole(src, build_configured_model(section), source)
    model.eval()
    names = _names(model)
    _fits(src, model, source)
    from ballast.training.hostmem import return_freed_memory

    return_freed_memory()  # each block's pages go back when it is dropped (training.hostmem)
    in_block = {id(m) for b in blocks for m in b.modules()}
    for m in model.modules():  # what lies outside the blocks: on the CPU, its buffers computed by the model
        if id(m) not in in_block:
            m.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        init()
    prefixes = [_prefix(model, b) for b in blocks]
    outside = [n for n in source.sizes if not any(n.startswith(p) for p in prefixes)]
    kept = sum(source.sizes[n] for n in outside)
    _assign(src, model, source.read(outside))
    plan: list[tuple[Any, str, list[str], int]] = []
    for block, prefix in zip(blocks, prefixes, strict=True):
        own = [n for n in source.sizes if n.startswith(prefix)]
        plan.append((block, prefix, own, sum(source.sizes[n] for n in own)))
    stream = Streaming(total=total, kept=kept, streamed_blocks=0, blocks=len(blocks))
    for block, prefix, own, size in plan:
        if stream.streamed_blocks == 0 and stream.kept + size <= budget:
            _assign(src, block, _strip(source.read(own), prefix))
            stream.kept += size
        else:
            stream.streamed_blocks += 1
            _stream(src, block, prefix, own, size, source, stream)
    stream.held = stream.peak = stream.kept
    _retie(model, names)
    model.ballast_streaming = stream
    if log:
        log(f"{src}: over the budget of {budget / 1e9:.2f} GB for weights in this process: {stream.describe()}")
    return model


def _whole(src: Path, model: Any, source: Any) -> Any:
    weights = source.read(list(source.sizes))
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise CheckpointFailure(f"{src}: weights do not fit the model {type(model).__name__}:"
                                f" {str(exc).splitlines()[0]}") from exc
    return model.eval()


def _names(model: Any) -> dict[int, list[str]]:
    """Each parameter's names (tied parameters have several), by the parameter."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def _fits(src: Path, model: Any, source: Any) -> None:
    """The weights at `src` are the model's state: the same names, each of the same size."""
    state = model.state_dict()
    missing = sorted(set(state) - set(source.sizes))
    extra = sorted(set(source.sizes) - set(state))
    wrong = [n for n, t in state.items() if n in source.sizes and t.numel() * t.element_size() != source.sizes[n]]
    if missing or extra or wrong:
        what = (f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}" if extra
                else f"a different size of {', '.join(wrong[:3])}")
        raise CheckpointFailure(f"{src}: weights do not fit the model {type(model).__name__} ({what})")


def _prefix(model: Any, block: Any) -> str:
    return next(name for name, m in model.named_modules() if m is block) + "."


def _strip(tensors: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {n[len(prefix):]: t for n, t in tensors.items()}


def _assign(src: Path, module: Any, state: dict[str, Any]) -> None:
    try:
        module.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise CheckpointFailure(f"{src}: weights do not fit the model: {str(exc).splitlines()[0]}") from exc


def _stream(src: Path, block: Any, prefix: str, own: list[str], size: int, source: Any, stream: Streaming) -> None:
    """Read the block's weights before its forward, drop them after."""

    def before(module: Any, args: Any) -> None:
        _assign(src, module, _strip(source.read(own), prefix))
        stream.held += size
        stream.reread += size
        stream.peak = max(stream.peak, stream.held)

    def after(module: Any, args: Any, output: Any) -> None:
        module.to_empty(device="meta")
        stream.held -= size

    block.register_forward_pre_hook(before)
    block.register_forward_hook(after)


def _retie(model: Any, names: dict[int, list[str]]) -> None:
    """Parameters the model ties (a language model's embedding and output layer) one tensor again where
    the loaded state gave each name its own: the first name's."""
    for group in names.values():
        if len(group) < 2:
            continue
        first = model.get_parameter(group[0])
        if first.is_meta:
            continue
        for name in group[1:]:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if module.get_parameter(leaf) is not first and not module.get_parameter(leaf).is_meta:
                setattr(module, leaf, first)
