"""Reading blocks of the converted dataset from the node-local cache, and whole splits.

A block (training.dataset.format) is a Parquet row group of the Petastorm dataset or a whole TFRecord
shard. Each column is decoded by its codec, a whole block at once: .npy files (Petastorm,
NdarrayCodec) or raw tensor bytes (TFRecord), PNG/JPEG for images in both, scalars as they are stored.
Features come out float32 (float, uint8 and bool columns) or int64 (other integer columns, e.g. token
ids), labels int64 (integer) or float32 (float). No torch here: evaluation streams a split in bounded
batches (`iter_split`, a block read at a time) without a DataLoader; the trainer's validation set is read
whole (`load_split`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ballast.training.dataset.format import (Block, ColumnLayout, blocks_of, columns_of, decode_images, decode_tensors,
                                             npy_header, read_manifest, tfrecord_description)
from ballast.training.failure import DataFailure

Features = np.ndarray | dict[str, np.ndarray]
"""One feature column's array, or a dict of them by column name when there are several."""


@dataclass
class Split:
    """A whole split in memory (validation and test sets)."""

    features: Features           # (N, *shape) per feature column
    labels: np.ndarray | None    # (N, *label shape), or None when the dataset has no label (causal_lm)

    def __len__(self) -> int:
        first = next(iter(self.features.values())) if isinstance(self.features, dict) else self.features
        return len(first)


class Decoder:
    """Turns one column's encoded values (a whole block's) into an array of its decoded dtype."""

    def __init__(self, column: dict | ColumnLayout, fmt: str = "petastorm"):
        self.layout = column if isinstance(column, ColumnLayout) else ColumnLayout.from_manifest(column)
        self.name, self.shape, self.codec = self.layout.name, self.layout.shape, self.layout.codec
        # Petastorm holds NdarrayCodec's .npy files, TFRecord the bare tensor bytes.
        self.header = npy_header(self.layout.numpy_dtype, self.shape) if fmt == "petastorm" else b""
        self.size = len(self.header) + self.layout.tensor_bytes

    def decode(self, values: list[bytes] | np.ndarray | Any, where: str) -> np.ndarray:
        if self.codec == "scalar":
            return np.array(values, dtype=self.layout.decoded_dtype)  # a writable copy, not a view of Arrow's buffer
        if self.codec == "ndarray":
            return decode_tensors(self.layout, values, where, self.header)
        return decode_images(self.layout, values, where)


class BlockDecoder:
    """Every column of a dataset: what read_block decodes and how it hands the block out."""

    def __init__(self, manifest: dict, fmt: str = "petastorm"):
        self.features, self.label = columns_of(manifest)
        if not self.features:
            raise DataFailure("the dataset manifest lists no feature column; convert the dataset again")
        self.columns = [*self.features, *([self.label] if self.label else [])]
        self.decoders = {c.name: Decoder(c, fmt) for c in self.columns}
        self.fmt = fmt

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def shape(self) -> tuple[int, ...]:
        """The first feature's shape (the model's input shape when there is one feature)."""
        return self.features[0].shape

    @property
    def codecs(self) -> set[str]:
        return {c.codec for c in self.columns}

    def inputs(self, decoded: dict[str, np.ndarray]) -> Features:
        """One feature: its array; several: a dict by name."""
        if len(self.features) == 1:
            return decoded[self.features[0].name]
        return {c.name: decoded[c.name] for c in self.features}


def import_readers(fmt: str, codecs: set[str] | str) -> None:
    """Import what read_block will need for this format and codecs, in the process that forks the loader
    workers: each epoch's workers then start with it loaded instead of importing it (pyarrow.parquet
    alone is ~0.4 s on a busy core) while training waits for its first batch."""
    if fmt == "petastorm":
        import pyarrow.parquet  # noqa: F401
    else:
        import tfrecord.reader  # noqa: F401
    if set([codecs] if isinstance(codecs, str) else codecs) & {"png", "jpeg"}:
        import cv2  # noqa: F401


def _binary_matrix(col: Any, size: int) -> np.ndarray | list[bytes]:
    """A Parquet binary column as an (n, size) uint8 matrix straight from Arrow's buffers when every
    value has `size` bytes (no Python object per row); else its values as bytes."""
    import pyarrow as pa

    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    if arr.null_count == 0 and pa.types.is_binary(arr.type) and len(arr):
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset:arr.offset + len(arr) + 1]
        if (np.diff(offsets) == size).all():
            data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)
            return data[offsets[0]:offsets[-1]].reshape(len(arr), size)
    return arr.to_pylist()


def read_block(data_dir: Path, block: Block, fmt: str, decoder: BlockDecoder,
               wait_seconds: float = 0.0) -> tuple[Features, np.ndarray | None]:
    """Decode one block: (features: an array (n, *shape) or a dict of them, labels (n, ...) or None)."""
    path = Path(data_dir) / block.path
    _wait_for(path, block.bytes, wait_seconds)
    raw: dict[str, Any] = {}
    if fmt == "petastorm":
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path).read_row_group(block.row_group, columns=decoder.names)
            for c in decoder.columns:
                col = table.column(c.name)
                raw[c.name] = col.to_numpy() if c.is_scalar else _binary_matrix(col, decoder.decoders[c.name].size)
            n = table.num_rows
        except Exception as exc:  # ArrowInvalid / OSError for truncated or foreign files
            raise DataFailure(f"{path}: cannot read Parquet row group {block.row_group} ({exc})") from exc
    else:
        from tfrecord.reader import tfrecord_loader

        raw = {c.name: [] for c in decoder.columns}
        kinds = tfrecord_description(decoder.columns)
        n = 0
        try:
            for rec in tfrecord_loader(str(path), None, kinds):
                for name, kind in kinds.items():
                    v = rec[name]
                    raw[name].append((v if isinstance(v, bytes) else v.tobytes()) if kind == "byte" else v[0])
                n += 1
        except Exception as exc:
            raise DataFailure(f"{path}: cannot read TFRecord shard ({exc})") from exc
        for c in decoder.columns:  # float64 scalars: their 8 raw bytes
            if c.is_scalar and kinds[c.name] == "byte":
                raw[c.name] = decode_tensors(ColumnLayout(c.name, c.dtype, (), "ndarray", c.role), raw[c.name],
                                             str(path)).reshape(-1)
    if n != block.rows:
        raise DataFailure(f"{path}: {n} rows where the manifest says {block.rows}")
    decoded = {c.name: decoder.decoders[c.name].decode(raw[c.name], str(path)) for c in decoder.columns}
    return decoder.inputs(decoded), (decoded[decoder.label.name] if decoder.label else None)


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


def concat_features(parts: list[Features]) -> Features:
    if isinstance(parts[0], dict):
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return np.concatenate(parts)


def _split_blocks(data_dir: Path, split: str, fmt: str, num_classes: int | None,
                  wait_seconds: float) -> tuple[Any, BlockDecoder]:
    """The split's blocks decoded one at a time, in file order (a generator), and the decoder. Integer
    labels are checked against [0, num_classes) block by block when the dataset (or the caller) has a
    number of classes. Refused at once (not when first read) when the split has no shards."""
    manifest = read_manifest(data_dir)
    blocks = blocks_of(manifest, split, fmt)
    if not blocks:
        raise DataFailure(f"{data_dir}: the manifest lists no {fmt} shards for split {split!r}")
    decoder = BlockDecoder(manifest, fmt)
    classes = num_classes or manifest.get("num_classes")
    check = bool(decoder.label and classes and decoder.label.is_integer)

    def gen() -> Iterator[tuple[Features, np.ndarray | None]]:
        for b in blocks:
            x, y = read_block(data_dir, b, fmt, decoder, wait_seconds)
            if check and y.size and (y.min() < 0 or y.max() >= classes):
                raise DataFailure(f"{data_dir}: labels outside [0, {classes}) in split {split!r}")
            yield x, y

    return gen(), decoder


def load_split(data_dir: Path, split: str, *, fmt: str, num_classes: int | None = None,
               wait_seconds: float = 0.0) -> Split:
    """A whole split in memory, in file order (the trainer's validation set). Integer labels are checked
    against [0, num_classes) when the dataset (or the caller) has a number of classes."""
    blocks, decoder = _split_blocks(Path(data_dir), split, fmt, num_classes, wait_seconds)
    parts = list(blocks)
    x = concat_features([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts]) if decoder.label else None
    return Split(x, y)


def iter_split(data_dir: Path, split: str, *, fmt: str, batch_rows: int, num_classes: int | None = None,
               wait_seconds: float = 0.0) -> Iterator[Split]:
    """A split in file order as consecutive batches of `batch_rows` rows (the last may be shorter), read
    one block at a time: what is held at once is one block and one batch, whatever the split's size (a
    block is a Parquet row group, `conversion.row_group_rows`, or a TFRecord shard, `shard_rows`). The
    rows, their order and the label check are load_split's; an empty split is refused here, at the call."""
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1 (got {batch_rows})")
    blocks, decoder = _split_blocks(Path(data_dir), split, fmt, num_classes, wait_seconds)

    def gen() -> Iterator[Split]:
        held: list[tuple[Features, np.ndarray | None]] = []
        count = 0
        for x, y in blocks:
            held.append((x, y))
            count += _rows(x)
            while count >= batch_rows:
                batch = _cut(held, batch_rows, decoder)
                held, count = _rest(held, batch_rows, count)
                yield batch
        if count:
            yield _cut(held, count, decoder)

    return gen()


def _rows(x: Features) -> int:
    return len(next(iter(x.values())) if isinstance(x, dict) else x)


def _take(x: Features, start: int, stop: int | None = None) -> Features:
    if isinstance(x, dict):
        return {k: v[start:stop] for k, v in x.items()}
    return x[start:stop]


def _cut(held: list[tuple[Features, np.ndarray | None]], n: int, decoder: BlockDecoder) -> Split:
    """The first `n` rows of the held blocks as one Split (a view when they lie in the first block)."""
    parts, need = [], n
    for x, y in held:
        k = min(need, _rows(x))
        parts.append((_take(x, 0, k), None if y is None else y[:k]))
        need -= k
        if not need:
            break
    if len(parts) == 1:
        return Split(*parts[0])
    return Split(concat_features([p[0] for p in parts]),
                 np.concatenate([p[1] for p in parts]) if decoder.label else None)


def _rest(held: list[tuple[Features, np.ndarray | None]], n: int,
          count: int) -> tuple[list[tuple[Features, np.ndarray | None]], int]:
    """The held blocks less their first `n` rows, and how many rows remain."""
    out, skip = [], n
    for x, y in held:
        rows = _rows(x)
        if skip >= rows:
            skip -= rows
            continue
        out.append((_take(x, skip), None if y is None else y[skip:]))
        skip = 0
    return out, count - n
