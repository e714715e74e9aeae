"""Reading the converted dataset from the node-local cache: decoding, per-rank sharding, loaders.

The cache holds the dataset's manifest.json and the files it lists (see ballast.packing for the
layout). A *block* is the unit read at once: a Parquet row group of the Petastorm dataset, or a whole
TFRecord shard. The feature bytes are what the field's Petastorm codec wrote (`NdarrayCodec` .npy
bytes, or PNG/JPEG from `CompressedImageCodec`) and are decoded the same way for both formats.

An epoch's order is fixed by (seed, epoch): the files are permuted, each file's blocks, and each
block's rows; the concatenated sequence is cut into `world` equal contiguous parts, one per rank. So each rank reads
about 1/world of the blocks, every rank gets the same number of samples, and a rank's position in
the epoch (a sample count) says exactly which samples remain: a run resumes mid-epoch by skipping
that many, whatever the number of loader workers.

Loader workers decode whole spans (the rows a rank needs from one block) in parallel; spans are dealt
to workers round-robin and the DataLoader returns them in order, so the sample order never depends on
the worker count. The main process cuts the stream of spans into batches.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from training.failure import DataError


@dataclass
class Split:
    features: np.ndarray  # (N, *input_shape) float32
    labels: np.ndarray    # (N,) int64

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Block:
    path: str                # relative to the cache directory
    bytes: int               # the file's size per the manifest
    row_group: int | None    # Parquet row group, or None for a whole TFRecord file
    rows: int


def read_manifest(data_dir: Path) -> dict:
    path = Path(data_dir) / "manifest.json"
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise DataError(f"{path}: dataset manifest missing; was the cache warmed?") from exc
    except ValueError as exc:
        raise DataError(f"{path}: dataset manifest is not valid JSON ({exc})") from exc


def blocks_of(manifest: dict, split: str, fmt: str) -> list[Block]:
    out = []
    for e in manifest["files"]:
        if e["split"] != split or e["format"] != fmt or e.get("kind") == "metadata":
            continue
        if fmt == "petastorm":
            out.extend(Block(e["path"], e["bytes"], g, n) for g, n in enumerate(e["row_groups"]))
        else:
            out.append(Block(e["path"], e["bytes"], None, e["rows"]))
    return out


# --- decoding -------------------------------------------------------------------------------------------


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a spec field type (float32, uint8, bool, string, ...)."""
    return np.dtype({"bool": "bool_", "string": "str_"}.get(name, name))


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The bytes numpy's .npy format (so NdarrayCodec) puts before an array of this dtype and shape."""
    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, dtype))
    raw = buf.getvalue()
    return raw[:len(raw) - dtype.itemsize * int(np.prod(shape))]


class Decoder:
    """Turns encoded feature values into float32 arrays of the field's shape."""

    def __init__(self, feature: dict):
        self.name = feature["name"]
        self.shape = tuple(feature["shape"])
        self.codec = feature["codec"]
        self.dtype = numpy_dtype(feature["dtype"])
        if self.codec == "ndarray":
            self.body = self.dtype.itemsize * int(np.prod(self.shape))
            self.header = np.frombuffer(npy_header(self.dtype, self.shape), dtype=np.uint8)

    def decode(self, values: list[bytes] | Any, where: str) -> np.ndarray:
        n = len(values)
        out = np.empty((n, *self.shape), dtype=np.float32)
        if self.codec == "ndarray":
            size = len(self.header) + self.body
            if n and all(len(v) == size for v in values):
                # One copy for the whole block: every value is header + raw body of the declared dtype.
                flat = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(n, size)
                if (flat[:, :len(self.header)] == self.header).all():
                    body = np.ascontiguousarray(flat[:, len(self.header):]).view(self.dtype)
                    out[...] = body.reshape(n, *self.shape)
                    return out
            for i, v in enumerate(values):  # other .npy headers (e.g. another byte order): numpy decides
                try:
                    out[i] = np.load(io.BytesIO(v), allow_pickle=False).reshape(self.shape)
                except Exception as exc:
                    raise DataError(f"{where}: row {i}: {self.name!r} is not a {list(self.shape)} array ({exc})") from exc
            return out
        import cv2

        cv2.setNumThreads(1)  # one thread per loader worker; OpenCV's own pool would oversubscribe the cores
        for i, v in enumerate(values):
            img = cv2.imdecode(np.frombuffer(v, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
            if img is None:
                raise DataError(f"{where}: row {i}: {self.name!r} is not a decodable {self.codec} image")
            if img.ndim == 3:
                img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
            try:
                out[i] = img.reshape(self.shape)
            except ValueError as exc:
                raise DataError(f"{where}: row {i}: image of shape {list(img.shape)}, expected"
                                f" {list(self.shape)}") from exc
        return out


def import_readers(fmt: str, codec: str) -> None:
    """Import what read_block will need for this format and codec, in the process that forks the loader
    workers: each epoch's workers then start with it loaded instead of importing it (pyarrow.parquet
    alone is ~0.4 s on a busy core) while training waits for its first batch."""
    if fmt == "petastorm":
        import pyarrow.parquet  # noqa: F401
    else:
        import tfrecord.reader  # noqa: F401
    if codec != "ndarray":
        import cv2  # noqa: F401


def read_block(data_dir: Path, block: Block, fmt: str, decoder: Decoder, label: str,
               wait_seconds: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Decode one block: (features float32 (n, *shape), labels int64 (n,))."""
    path = Path(data_dir) / block.path
    _wait_for(path, block.bytes, wait_seconds)
    if fmt == "petastorm":
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path).read_row_group(block.row_group, columns=[decoder.name, label])
            values = table.column(decoder.name).to_pylist()
            y = table.column(label).to_numpy()
        except Exception as exc:  # ArrowInvalid / OSError for truncated or foreign files
            raise DataError(f"{path}: cannot read Parquet row group {block.row_group} ({exc})") from exc
    else:
        from tfrecord.reader import tfrecord_loader

        values, labels = [], []
        try:
            for rec in tfrecord_loader(str(path), None, {decoder.name: "byte", label: "int"}):
                v = rec[decoder.name]
                values.append(v if isinstance(v, bytes) else v.tobytes())
                labels.append(int(rec[label][0]))
        except Exception as exc:
            raise DataError(f"{path}: cannot read TFRecord shard ({exc})") from exc
        y = np.asarray(labels, np.int64)
    if len(y) != block.rows:
        raise DataError(f"{path}: {len(y)} rows where the manifest says {block.rows}")
    return decoder.decode(values, str(path)), y.astype(np.int64, copy=False)


def _wait_for(path: Path, size: int, wait_seconds: float) -> None:
    """A staged cache may still be bringing the file: wait up to wait_seconds for it to appear."""
    deadline = time.monotonic() + wait_seconds
    while not path.is_file():
        if time.monotonic() >= deadline:
            hint = f" after waiting {wait_seconds:.0f}s" if wait_seconds else ""
            raise DataError(f"{path}: shard listed in the manifest is not in the cache{hint}; is the cache warm-up"
                            f" still running or did it fail?")
        time.sleep(0.1)
    if path.stat().st_size != size:
        raise DataError(f"{path}: size {path.stat().st_size} differs from the manifest ({size})")


def load_split(data_dir: Path, split: str, *, fmt: str, num_classes: int | None = None,
               wait_seconds: float = 0.0) -> Split:
    """A whole split in memory, in file order (validation and test sets)."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    blocks = blocks_of(manifest, split, fmt)
    if not blocks:
        raise DataError(f"{data_dir}: the manifest lists no {fmt} shards for split {split!r}")
    decoder = Decoder(manifest["feature"])
    parts = [read_block(data_dir, b, fmt, decoder, manifest["label"]["name"], wait_seconds) for b in blocks]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    classes = num_classes or manifest["label"]["num_classes"]
    if len(y) and (y.min() < 0 or y.max() >= classes):
        raise DataError(f"{data_dir}: labels outside [0, {classes}) in split {split!r}")
    return Split(x, y)


# --- the epoch plan -------------------------------------------------------------------------------------


def rank_spans(blocks: list[Block], *, seed: int, epoch: int, rank: int, world: int) -> list[tuple[int, np.ndarray]]:
    """This rank's samples for an epoch, in order, as (block index, row indices within the block) spans."""
    # Files are permuted, then each file's blocks, then each block's rows: a rank reads whole files in
    # turn (so a cache stage holding its first files holds its first steps), and the mix changes
    # every epoch.
    files: dict[str, list[int]] = {}
    for i, b in enumerate(blocks):
        files.setdefault(b.path, []).append(i)
    groups = list(files.values())
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    order: list[int] = []
    for k in rng.permutation(len(groups)):
        inner = np.random.Generator(np.random.PCG64([seed, epoch, int(k), 0xF11E])).permutation(len(groups[k]))
        order.extend(groups[k][j] for j in inner)
    total = sum(b.rows for b in blocks)
    per_rank = total // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    spans, at = [], 0
    for b in order:
        n = blocks[b].rows
        if at + n > lo and at < hi:
            rows = np.random.Generator(np.random.PCG64([seed, epoch, int(b)])).permutation(n)
            spans.append((int(b), rows[max(lo - at, 0):min(hi - at, n)]))
        at += n
        if at >= hi:
            break
    return spans


def skip_samples(spans: list[tuple[int, np.ndarray]], start: int) -> list[tuple[int, np.ndarray]]:
    out = []
    for b, rows in spans:
        if start >= len(rows):
            start -= len(rows)
            continue
        out.append((b, rows[start:]))
        start = 0
    return out


def _drop_inherited_sockets(_worker_id: int) -> None:
    """In a forked loader worker: close its copies of the rank's TCP sockets (gloo, the rendezvous store,
    the metrics endpoint). The worker talks to the rank through pipes only, and it ends with os._exit,
    so nothing in it uses or later closes these descriptors."""
    import socket
    import stat

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
            family = sock.family
            sock.detach()
        except OSError:
            continue
        if family in (socket.AF_INET, socket.AF_INET6):
            os.close(fd)


class EpochLoader:
    """Per-rank batches of the train split for an epoch, from any sample position, via a DataLoader."""

    def __init__(self, data_dir: Path, *, fmt: str, rank: int, world: int, seed: int, workers: int = 2,
                 prefetch: int = 2, wait_seconds: float = 0.0, split: str = "train"):
        self.data_dir = Path(data_dir)
        manifest = read_manifest(self.data_dir)
        self.fmt, self.rank, self.world, self.seed = fmt, rank, world, seed
        self.blocks = blocks_of(manifest, split, fmt)
        if not self.blocks:
            raise DataError(f"{self.data_dir}: the manifest lists no {fmt} shards for split {split!r}")
        self.decoder = Decoder(manifest["feature"])
        self.label = manifest["label"]["name"]
        self.workers, self.prefetch, self.wait_seconds = workers, prefetch, wait_seconds
        if workers:
            import_readers(fmt, self.decoder.codec)
        self.samples_per_rank = sum(b.rows for b in self.blocks) // world

    def spans(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        return rank_spans(self.blocks, seed=self.seed, epoch=epoch, rank=self.rank, world=self.world)

    def batches(self, epoch: int, *, batch: int, start: int = 0) -> Iterator[tuple[Any, Any]]:
        """Full batches of `batch` samples from sample position `start` of this rank's epoch."""
        import torch
        from torch.utils.data import DataLoader

        from training.loader import Spans

        spans = skip_samples(self.spans(epoch), start)
        dataset = Spans(self.data_dir, self.fmt, self.blocks, spans, self.decoder, self.label, self.wait_seconds)
        workers = min(self.workers, len(spans))
        # Its own generator: creating the loader must not draw from torch's global RNG, or a run resumed
        # mid-epoch (loader created at the resume point) would see other dropout masks than the original.
        # Workers forked from this rank (Linux's default, stated because python -m training.launch starts
        # ranks from a forkserver, whose context they would otherwise inherit): forked, they start with
        # the readers imported, and as the rank's own children they notice when it dies and exit. Started
        # by the forkserver, they outlived a killed rank and held torchrun's output open. A forked worker
        # drops its copies of the rank's network sockets first: holding them, it kept a SIGKILLed rank's
        # gloo connections open until it noticed the death (5 s), and the other ranks waited that long.
        context = "fork" if sys.platform == "linux" and workers else None
        loader = DataLoader(dataset, batch_size=None, num_workers=workers,
                            prefetch_factor=self.prefetch if workers else None, multiprocessing_context=context,
                            worker_init_fn=_drop_inherited_sockets if context == "fork" else None,
                            generator=torch.Generator().manual_seed(self.seed + epoch))
        xs, ys, have = [], [], 0
        for x, y in loader:
            xs.append(x)
            ys.append(y)
            have += len(y)
            while have >= batch:
                xcat, ycat = (torch.cat(xs), torch.cat(ys)) if len(xs) > 1 else (xs[0], ys[0])
                yield xcat[:batch], ycat[:batch]
                xs, ys = [xcat[batch:]], [ycat[batch:]]
                have -= batch
