"""DCP shard files read straight into the tensors a load fills.

DCP's `FileSystemReader.read_data` reads every stored piece with `torch.load` into a tensor of its own
and then copies the part this rank needs into the target: the whole piece read (twice what a rank
resharded to twice the ranks needs) into a fresh allocation (its pages faulted in and zeroed), then
copied. A piece stored plainly (a `torch.save`d CPU tensor of a standard dtype, its bytes in order in
its zip record, as DCP writes every tensor) is read here by one `pread` of just the part needed,
straight into the target's own memory, the pieces of a file in file order. Whatever else a plan asks
(a pickled value, a transformed record, a non-contiguous region or target, another device's target,
another dtype) goes through DCP's own `read_data`, so the result is always DCP's.

The record's `data.pkl` is read by an unpickler that accepts only what a plain tensor's pickle names
(`torch._utils._rebuild_tensor_v2`, a storage type, `collections.OrderedDict`), sets no object's state
(restricted_pickle) and builds nothing: it returns the tensor's layout, each field of the type it must
have. Anything else is left to `torch.load(weights_only=True)` in DCP's path. A damaged or truncated
record is a ValueError naming the file and the tensor, raised where DCP's own path raises its error:
the callers (dcp.read_into, dcp.check...) name the checkpoint; so is a record that would inflate past
its piece's stored bytes (a compressed record: DCP's writer stores every record plain), read by
neither path.

Every file a read opens is a regular file of DCP's own name (`__<rank>_<n>.distcp`) directly inside the
checkpoint, opened without following a link and without blocking (a FIFO is refused, never waited
on), on both paths: the metadata's `relative_path` is data, not a path to follow. Importing this
module does not import torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ballast.training.checkpoint.restricted_pickle import RestrictedUnpickler

_DTYPES = {"FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
           "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
           "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
           "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128"}
"""The storage types a `torch.save`d tensor's pickle names, and their dtypes; any other goes DCP's way."""
STORED_DTYPES = frozenset(_DTYPES.values())
"""The dtypes (torch's names) of the tensors a checkpoint stores: a metadata entry of any other is refused."""
PIECE_FILE = re.compile(r"^__\d+_\d+\.distcp$")
"""DCP's shard file names (`__<rank>_<n>.distcp`): the only files a read opens, and the only names a
checkpoint's metadata may give a piece's file (dcp_metadata)."""
_PICKLE_MAX_BYTES = 64 << 10
"""The largest `data.pkl` of a piece read (a plain tensor's is ~200 bytes)."""


class _Layout(NamedTuple):
    dtype: str
    key: str
    numel: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _NotPlain(Exception):
    """A record this reader leaves to DCP's own path."""


class _LayoutUnpickler(RestrictedUnpickler):
    def __init__(self, file: Any) -> None:
        super().__init__(file, allowed=self._global, what="a plain tensor's record")

    @staticmethod
    def _global(key: tuple[str, str]) -> Any:
        module, name = key
        if key == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if key == ("collections", "OrderedDict"):
            return dict
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and pid[1] in _DTYPES.values()
                and type(pid[2]) is str and pid[3] == "cpu" and type(pid[4]) is int and pid[4] >= 0):
            raise _NotPlain(f"a persistent id of {len(pid) if type(pid) is tuple else type(pid).__name__}")
        return pid


def _ints(v: Any) -> bool:
    return type(v) is tuple and all(type(n) is int for n in v)


def _rebuild(storage: Any, offset: int, size: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool = False,
             hooks: Any = None, *rest: Any) -> _Layout:
    if rest or hooks:
        raise _NotPlain("tensor with metadata or hooks")
    if not (type(storage) is tuple and type(offset) is int and offset >= 0 and _ints(size) and _ints(stride)
            and len(size) == len(stride) and all(n >= 0 for n in size) and type(requires_grad) is bool):
        raise ValueError(f"a tensor's layout of the wrong types (offset {_kind(offset)}, size {_kind(size)},"
                         f" stride {_kind(stride)})")
    _, dtype, key, _, numel = storage
    return _Layout(dtype, key, numel, offset, size, stride)


def _kind(v: Any) -> str:
    """A layout field for a message: a small int or a short tuple of them shown, anything else by its
    type only (a pickle can build a value that costs 2^n to print)."""
    if type(v) is int and abs(v) < 1 << 64:
        return str(v)
    if _ints(v) and len(v) <= 8 and all(abs(n) < 1 << 64 for n in v):
        return str(v)
    return f"a {type(v).__name__}"


def open_piece_file(directory: Path, name: str, *, pattern: re.Pattern[str] = PIECE_FILE) -> Any:
    """The shard file `name` of the checkpoint `directory`, opened for reading: a regular file of DCP's
    own name directly inside it, never followed through a link, never waited on (a FIFO)."""
    if type(name) is not str or not pattern.match(name):
        raise ValueError(f"{str(name)[:80]!r} is not a shard file of the checkpoint (__<rank>_<n>.distcp)")
    path = Path(directory) / name
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{name} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _layout(zf: Any) -> tuple[_Layout, str]:
    """The tensor's layout from its record's pickle, and the name of the record holding its bytes."""
    pkl = [n for n in zf.get_all_records() if n == "data.pkl" or n.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise _NotPlain("no single data.pkl")
    prefix = pkl[0][: -len("data.pkl")]
    if zf.get_record_size(pkl[0]) > _PICKLE_MAX_BYTES:
        raise ValueError(f"its data.pkl inflates to {zf.get_record_size(pkl[0])} bytes (a plain tensor's is"
                         f" under {_PICKLE_MAX_BYTES})")
    order = prefix + "byteorder"
    if zf.has_record(order) and zf.get_record_size(order) > 16:
        raise ValueError(f"its byteorder record holds {zf.get_record_size(order)} bytes, not a byte order's name")
    if zf.has_record(order) and bytes(zf.get_record(order)).decode(errors="replace") != sys.byteorder:
        raise _NotPlain("another byte order")
    layout = _parsed_layout(bytes(zf.get_record(pkl[0])))
    return layout, f"{prefix}data/{layout.key}"


@functools.lru_cache(maxsize=4096)
def _parsed_layout(pkl: bytes) -> _Layout:
    """A piece's layout from its `data.pkl` (at most _PICKLE_MAX_BYTES): parsed once per distinct pickle,
    as the pieces of a model's repeated blocks share a few shapes (the restricted unpickler is the
    pure-Python one: ~50 us a parse). A pickle that is refused is never kept."""
    layout = _LayoutUnpickler(io.BytesIO(pkl)).load()
    if not isinstance(layout, _Layout):
        raise _NotPlain("not a tensor")
    return layout


def _region(layout: _Layout, offsets: Any, lengths: Any) -> tuple[int, int]:
    """(first element, element count) of the part of the stored tensor a read asks for, where that part
    lies in one run of its storage: a contiguous tensor, whole in the dimensions after the last one
    narrowed and one long in those before it."""
    size, stride = layout.size, layout.stride
    expected = 1
    for dim in reversed(range(len(size))):
        if size[dim] != 1 and stride[dim] != expected:
            raise _NotPlain("non-contiguous stored tensor")
        expected *= size[dim]
    narrowed = [d for d in range(len(size)) if lengths[d] != size[d]]
    if narrowed and any(lengths[d] != 1 for d in range(narrowed[-1])):  # after the last narrowed one: whole
        raise _NotPlain("a region in several runs")
    first = layout.offset + sum(o * s for o, s in zip(offsets, stride))
    count = 1
    for n in lengths:
        count *= n
    return first, count


def _pread_into(fd: int, view: memoryview, offset: int, path: Path, what: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"{path.name} ends before the bytes of {what} (at byte {offset + done} of"
                             f" {offset + len(view)}): the shard file is truncated")
        done += n


@functools.cache
def reader_class(base: type) -> type:
    """`base` (a FileSystemReader) whose `read_data` reads plain pieces directly into their targets."""
    import torch
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class DirectReader(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.fs = _confined_file_system()  # DCP's own read path opens its files the same way

        def read_data(self, plan: Any, planner: Any) -> Any:
            per_file: dict[str, list[Any]] = {}
            rest = []
            for req in plan.items:
                info = self.storage_data[req.storage_index]
                if req.type == LoadItemType.TENSOR and not getattr(info, "transform_descriptors", None):
                    per_file.setdefault(info.relative_path, []).append(req)
                else:
                    rest.append(req)
            for name, reqs in per_file.items():
                path = Path(self.path) / name
                with open_piece_file(Path(self.path), name) as f:  # buffered for the records' headers; bytes by pread
                    for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                        if not self._read_one(f, path, req, planner):
                            rest.append(req)
            if rest:  # DCP's own way, for what is not a plain piece
                super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
            done: Any = Future()
            done.set_result(None)
            return done

        def _read_one(self, f: Any, path: Path, req: Any, planner: Any) -> bool:
            info = self.storage_data[req.storage_index]
            try:
                zf = torch._C.PyTorchFileReader(self._slice_file(f, info))
                _bounded(zf, info.length)
                layout, record = _layout(zf)
                first, count = _region(layout, req.storage_offsets, req.lengths)
                data, size = zf.get_record_offset(record), zf.get_record_size(record)
            except _NotPlain:
                return False
            except Exception as exc:  # a damaged piece: its zip directory, its records or its pickle
                raise ValueError(f"{path.name}: the record of {req.storage_index.fqn} at byte {info.offset} is"
                                 f" damaged ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from exc
            target = planner.resolve_tensor(req).detach()
            dtype = getattr(torch, layout.dtype)
            if (target.device.type != "cpu" or target.dtype != dtype or not target.is_contiguous()
                    or tuple(target.shape) != tuple(req.lengths)):
                return False
            nbytes, start = count * dtype.itemsize, data + first * dtype.itemsize
            if (first < 0 or first + count > layout.numel or layout.numel * dtype.itemsize > size
                    or start + nbytes > info.length):
                raise ValueError(f"{path.name}: the record of {req.storage_index.fqn} at byte {info.offset} is"
                                 f" damaged (its tensor lies outside its {size} bytes)")
            if nbytes:
                view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
                _pread_into(f.fileno(), view, info.offset + start, path, req.storage_index.fqn)
            planner.commit_tensor(req, target)
            return True

    return DirectReader


def _bounded(zf: Any, length: int) -> None:
    """Refuse a piece's zip whose records would inflate past the piece's own stored bytes (DCP writes
    them stored, not compressed): neither this reader nor DCP's torch.load may inflate a bomb."""
    for name in zf.get_all_records():
        if zf.get_record_size(name) > length:
            raise ValueError(f"its record {name[-40:]} inflates to {zf.get_record_size(name)} bytes, more than the"
                             f" piece's {length} stored bytes")


@functools.cache
def _confined_file_system() -> Any:
    """DCP's local file system whose streams opened for reading are `open_piece_file`'s."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ConfinedFileSystem(FileSystem):
        def concat_path(self, path: Any, suffix: Any) -> Any:
            if suffix != ".metadata" and not (type(suffix) is str and PIECE_FILE.match(suffix)):
                raise ValueError(f"{str(suffix)[:80]!r} is not a file of the checkpoint (__<rank>_<n>.distcp)")
            return Path(path) / suffix

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if "r" not in mode or "+" in mode:
                raise ValueError(f"{path}: a checkpoint is only read here")
            path = Path(path)
            if path.name == ".metadata":  # a plain DCP reader's (the checkpoint's own reads it: dcp.reader)
                with open_piece_file(path.parent, path.name, pattern=re.compile(r"^\.metadata$")) as stream:
                    yield stream
                return
            with open_piece_file(path.parent, path.name) as stream:
                yield stream

    return ConfinedFileSystem()
