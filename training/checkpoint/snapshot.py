"""CPU copies of the training state into buffers reused from one save to the next (imports torch lazily);
of a sharded (DTensor) state, each rank's own shards only."""

from __future__ import annotations

import math
from typing import Any


class Snapshot:
    """CPU copies of a nested state, into buffers kept from one save to the next.

    Reusing the buffers turns the snapshot into a plain memory copy (no allocation, no first-touch page
    faults), which is all an asynchronous save blocks training for. The caller must not snapshot while
    the previous save is still being written (CheckpointManager.save waits for it first).
    """

    def __init__(self, pin: bool = False, shared: bool = False):
        self.pin = pin
        self.shared = shared
        """Large buffers in the shared-memory arena (checkpoint.arena), whose pages the writer
        process writes to the checkpoint files without a copy."""
        self.buffers: dict[tuple, Any] = {}
        self.unpinned = False  # a shared buffer that could not be page-locked for the GPU's copies

    def _empty(self, shape, dtype):
        """A buffer for a tensor; large CPU ones page-aligned (an anonymous mapping, or the shared
        arena), so that the checkpoint writer can hand their pages to the disk directly (O_DIRECT)
        without a staging copy."""
        import mmap

        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes >= (1 << 20) and self.shared:
            from ballast.training.checkpoint.arena import shared_buffer

            buf = shared_buffer(nbytes)
            if buf is not None:
                if self.pin:
                    self._page_lock(buf)
                return torch.frombuffer(buf, dtype=dtype).view(shape)
        if self.pin or nbytes < (1 << 20):
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin)
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)

    def _page_lock(self, buf: memoryview) -> None:
        """Register a shared buffer with CUDA (cudaHostRegister), as pinned memory is, so that the GPU
        copies into it at DMA speed; where CUDA refuses, it stays pageable (slower copies, same bytes)."""
        import torch

        from ballast.training.checkpoint.fileio import _address

        try:
            err = torch.cuda.cudart().cudaHostRegister(_address(buf), buf.nbytes, 0)
        except (AttributeError, RuntimeError, TypeError):
            err = -1
        if int(getattr(err, "value", err)) != 0:
            self.unpinned = True

    def copy(self, obj: Any, path: tuple = ()) -> Any:
        import torch

        if hasattr(obj, "to_local") and hasattr(obj, "device_mesh"):  # a DTensor: this rank's shard only
            from torch.distributed.tensor import DTensor

            # The host copy of the shard under the same spec (mesh, placements, global shape), as torch's
            # own CPU offload of a state dict builds it: DTensor.from_local would move the local tensor
            # to the mesh's device, a second device copy of every shard at each save on GPUs.
            return DTensor(self.copy(obj.to_local(), path), obj._spec, requires_grad=False)
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
