"""A saved model for forward passes in one process that need not hold it whole: the orchestrator's
verification probe and evaluation (with its `if_better` baseline) use it.

`load(src, section, budget=...)` builds the model a recorded model section describes and gives it the
weights at `src` (a checkpoint directory: its model.pt or a sharded checkpoint's pieces; a tensor file;
published safetensors, one file or the index of its shards; read through `export.source`, nothing
unpickled). The model is built on the meta device, its buffers computed by its `ballast_init_weights()`
(its parameters still on the meta device: nothing allocated, no random draw), and the weights then
become its parameters (`load_state_dict(assign=True)`: one copy of the model, never two):

- all of them, when they fit `budget` bytes (tied parameters counted once);
- else what lies outside its blocks (`ballast_blocks()`: embeddings, final norm, head) and as many
  blocks as the rest of the budget holds, in order; every other block's weights are read just before
  its forward and dropped after it (forward hooks). A forward pass then holds the kept part and one
  block, whatever the model's size, and reads the streamed blocks again on every pass: slower, by as
  much as reading them costs (the page cache keeps what fits), but it runs. Read from a sharded
  checkpoint, a dropped block's memory is freed (glibc's mmap threshold is fixed for that:
  training.hostmem); from a model.pt or safetensors file, the weights are views of the file mapped in
  (clean pages, which the kernel takes back under pressure).

A model that cannot be built on the meta device (its factory says so, `meta_build = False`, or its
constructor or `ballast_init_weights()` fails there) is built on the CPU and its weights copied in, as
before; one that names no block, or ties a parameter inside its blocks, is read whole. Importing this
module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ballast.training.checkpoint import export
from ballast.training.failure import CheckpointFailure

BUDGET_FRACTION = 0.5
"""Of the memory this process can still take: the rest is for activations, the data and the allocator."""


def memory_budget() -> int:
    """Bytes of weights this process may hold: BUDGET_FRACTION of what it can still take: MemAvailable,
    or less where a memory cgroup it is in (v2 or v1, its own or one above it) has less room left than
    that (its limit less its usage, the page cache it could drop not counted as used)."""
    room = _meminfo("MemAvailable")
    if room is None:
        import os

        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for left in _cgroup_rooms():
        room = min(room, left)
    return int(BUDGET_FRACTION * max(0, room))


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_rooms(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> list[int]:
    """Room left in each limited memory cgroup this process is in, from its own up to the root."""
    rooms = []
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return rooms
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        base = root if v2 else root / "memory"
        here = base / path.lstrip("/")
        while True:
            left = _room(here, v2)
            if left is not None:
                rooms.append(left)
            if here == base or base not in here.parents:
                break
            here = here.parent
    return rooms


def _room(cgroup: Path, v2: bool) -> int | None:
    limit_file, usage_file, stat_field = (("memory.max", "memory.current", "inactive_file") if v2 else
                                          ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    try:
        limit = (cgroup / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # no limit (v1 writes a huge number)
            return None
        used = int((cgroup / usage_file).read_text())
        for line in (cgroup / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == stat_field:
                used -= int(value)
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


@dataclass
class Streaming:
    """How a streamed model holds its weights: bytes kept, blocks streamed, and (counted as it runs) the
    weight bytes held now, the most held at once and the bytes read again."""

    total: int
    kept: int
    streamed_blocks: int
    blocks: int
    held: int = 0
    peak: int = 0
    reread: int = 0

    def describe(self) -> str:
        return (f"{self.total / 1e9:.2f} GB of weights: {self.kept / 1e9:.2f} GB kept, {self.streamed_blocks} of"
                f" {self.blocks} blocks read at every forward pass and dropped after it")


def load(src: Path, section: Any, *, budget: int, log: Callable[[str], Any] | None = None) -> Any:
    """The model of `section` (a recorded model section) with the weights at `src`, in eval mode: whole
    within `budget` bytes, else streamed block by block (above). A streamed model carries its
    `Streaming` as `ballast_streaming`. Weights that do not fit the model are a CheckpointFailure naming
    `src`."""
    from ballast.training.fsdp import model_blocks
    from ballast.training.models import build_configured_model

    say = log or (lambda _: None)
    source = export.source(Path(src))
    model, why = _on_meta(section)
    if model is None:
        if sum(source.sizes.values()) > budget:
            say(f"{src}: {sum(source.sizes.values()) / 1e9:.2f} GB of weights, over the budget of"
                f" {budget / 1e9:.2f} GB, but model {section.name} {why}: read whole on the CPU")
        return _copied(src, build_configured_model(section), source)
    _fits(src, model, source)
    ties = [names for names in _names(model).values() if len(names) > 1]
    seconds = {n for names in ties for n in names[1:]}
    sizes = {n: b for n, b in source.sizes.items() if n not in seconds}  # a tied tensor read once
    total = sum(sizes.values())
    blocks = model_blocks(model) or []
    prefixes = [_prefix(model, b) for b in blocks]
    tied_in_blocks = any(n.startswith(p) for names in ties for n in names for p in prefixes)
    if total <= budget or not blocks or tied_in_blocks:
        if total > budget:
            say(f"{src}: {total / 1e9:.2f} GB of weights, over the budget of {budget / 1e9:.2f} GB, but model"
                f" {type(model).__name__} names no block or ties parameters inside its blocks: read whole")
        _assign(src, model, source.read(list(sizes)), ties)
        return model
    from ballast.training.hostmem import return_freed_memory

    return_freed_memory()  # a dropped block's pages go back (training.hostmem)
    outside = [n for n in sizes if not any(n.startswith(p) for p in prefixes)]
    stream = Streaming(total=total, kept=sum(sizes[n] for n in outside), streamed_blocks=0, blocks=len(blocks))
    _assign(src, model, source.read(outside), ties)
    for block, prefix in zip(blocks, prefixes, strict=True):
        own = [n for n in sizes if n.startswith(prefix)]
        size = sum(sizes[n] for n in own)
        if stream.streamed_blocks == 0 and stream.kept + size <= budget:
            _assign(src, model, source.read(own), ties)
            stream.kept += size
        else:
            stream.streamed_blocks += 1
            _stream(src, model, block, own, size, source, stream, ties)
    stream.held = stream.peak = stream.kept
    model.ballast_streaming = stream
    say(f"{src}: over the budget of {budget / 1e9:.2f} GB for weights in this process: {stream.describe()}")
    return model


def _on_meta(section: Any) -> tuple[Any | None, str]:
    """The model built on the meta device, every buffer on the CPU computed by its ballast_init_weights()
    (its parameters left on the meta device), in eval mode; or None and why it cannot be built so."""
    import torch

    from ballast.training.models import build_on_meta

    model, why = build_on_meta(section)
    if model is None:
        return None, why
    try:
        init = getattr(model, "ballast_init_weights", None)
        if not callable(init):
            return None, "has no ballast_init_weights() method"
        for m in model.modules():
            for name, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[name] = torch.empty_like(b, device="cpu")
        with torch.no_grad():
            init()
    except Exception as exc:  # an init that needs real values: built on the CPU instead
        return None, f"cannot be initialized on the meta device ({str(exc).splitlines()[0][:200]})"
    return model.eval(), ""


def _copied(src: Path, model: Any, source: Any) -> Any:
    """A model built on the CPU, the weights at `src` copied into it (the whole model twice, for a while)."""
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


def _assign(src: Path, model: Any, state: dict[str, Any], ties: list[list[str]]) -> None:
    """The named tensors become the model's own (no copy); the other names of a tied parameter follow."""
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise CheckpointFailure(f"{src}: weights do not fit the model: {str(exc).splitlines()[0]}") from exc
    for names in ties:
        first = model.get_parameter(names[0])
        if not first.is_meta:
            for name in names[1:]:
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner) if owner else model, leaf, first)


def _drop(model: Any, names: list[str]) -> None:
    """The named parameters and persistent buffers back on the meta device (their memory released)."""
    import torch

    for name in names:
        owner, _, leaf = name.rpartition(".")
        m = model.get_submodule(owner) if owner else model
        if leaf in m._parameters:
            p = m._parameters[leaf]
            m._parameters[leaf] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        else:
            m._buffers[leaf] = torch.empty_like(m._buffers[leaf], device="meta")


def _stream(src: Path, model: Any, block: Any, own: list[str], size: int, source: Any, stream: Streaming,
            ties: list[list[str]]) -> None:
    """Read the block's weights before its forward, drop them after (after a failed forward too)."""

    loaded = [False]

    def before(module: Any, args: Any) -> None:
        _assign(src, model, source.read(own), ties)
        loaded[0] = True
        stream.held += size
        stream.reread += size
        stream.peak = max(stream.peak, stream.held)

    def after(module: Any, args: Any, output: Any) -> None:
        if loaded[0]:
            _drop(model, own)
            loaded[0] = False
            stream.held -= size

    block.register_forward_pre_hook(before)
    block.register_forward_hook(after, always_call=True)
