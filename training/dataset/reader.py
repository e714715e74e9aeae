"""Reading blocks of the converted dataset from the node-local cache, and whole splits.

A block (training.dataset.format) is a Parquet row group of the Petastorm dataset or a whole TFRecord
shard. The feature is decoded by its codec: .npy files (Petastorm, NdarrayCodec) or raw tensor bytes
(TFRecord), PNG/JPEG for images in both. No torch here: evaluation reads whole splits without a
DataLoader.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ballast.training.dataset.format import (Block, FeatureLayout, blocks_of, decode_images, decode_tensors, npy_header,
                                     read_manifest, tfrecord_description)
from ballast.training.failure import DataFailure


@dataclass
class Split:
    """A whole split in memory (validation and test sets)."""

    features: np.ndarray  # (N, *input_shape) float32
    labels: np.ndarray    # (N,) int64

    def __len__(self) -> int:
        return len(self.labels)


class Decoder:
    """Turns a block's encoded feature values into float32 arrays of the field's shape."""

    def __init__(self, feature: dict, fmt: str = "petastorm"):
        self.layout = FeatureLayout.from_manifest(feature)
        self.name, self.shape, self.codec = self.layout.name, self.layout.shape, self.layout.codec
        # Petastorm holds NdarrayCodec's .npy files, TFRecord the bare tensor bytes.
        self.header = npy_header(self.layout.numpy_dtype, self.shape) if fmt == "petastorm" else b""

    def decode(self, values: list[bytes] | Any, where: str) -> np.ndarray:
        if self.codec == "ndarray":
            return decode_tensors(self.layout, values, where, self.header)
        return decode_images(self.layout, values, where)


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
            raise DataFailure(f"{path}: cannot read Parquet row group {block.row_group} ({exc})") from exc
    else:
        from tfrecord.reader import tfrecord_loader

        values, labels = [], []
        try:
            for rec in tfrecord_loader(str(path), None, tfrecord_description(decoder.layout, label)):
                v = rec[decoder.name]
                values.append(v if isinstance(v, bytes) else v.tobytes())
                labels.append(int(rec[label][0]))
        except Exception as exc:
            raise DataFailure(f"{path}: cannot read TFRecord shard ({exc})") from exc
        y = np.asarray(labels, np.int64)
    if len(y) != block.rows:
        raise DataFailure(f"{path}: {len(y)} rows where the manifest says {block.rows}")
    return decoder.decode(values, str(path)), y.astype(np.int64, copy=False)


def _wait_for(path: Path, size: int, wait_seconds: float) -> None:
    """A staged cache may still be bringing the file: wait up to wait_seconds for it to appear."""
    deadline = time.monotonic() + wait_seconds
    while not path.is_file():
        if time.monotonic() >= deadline:
            hint = f" after waiting {wait_seconds:.0f}s" if wait_seconds else ""
            raise DataFailure(f"{path}: shard listed in the manifest is not in the cache{hint}; is the cache"
                              f" warm-up still running or did it fail?")
        time.sleep(0.1)
    if path.stat().st_size != size:
        raise DataFailure(f"{path}: size {path.stat().st_size} differs from the manifest ({size})")


def load_split(data_dir: Path, split: str, *, fmt: str, num_classes: int | None = None,
               wait_seconds: float = 0.0) -> Split:
    """A whole split in memory, in file order (validation and test sets)."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    blocks = blocks_of(manifest, split, fmt)
    if not blocks:
        raise DataFailure(f"{data_dir}: the manifest lists no {fmt} shards for split {split!r}")
    decoder = Decoder(manifest["feature"], fmt)
    parts = [read_block(data_dir, b, fmt, decoder, manifest["label"]["name"], wait_seconds) for b in blocks]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    classes = num_classes or manifest["label"]["num_classes"]
    if len(y) and (y.min() < 0 or y.max() >= classes):
        raise DataFailure(f"{data_dir}: labels outside [0, {classes}) in split {split!r}")
    return Split(x, y)
