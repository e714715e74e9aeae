"""Writing the packed dataset both conversion engines produce: raw rows in, encoded shards out.

The format itself (layout, manifest, the bytes of every value, FORMAT_VERSION) is the contract in
training.dataset.format, shared with the reader; this module reads the raw input, encodes every
column (features and label, or a text dataset's token sequences: ballast.data.text) with those codecs
and writes the files. Besides the shards, each Petastorm split gets
`petastorm/<split>/_common_metadata`: the pickled Unischema and row groups per file, what petastorm's
materialize_dataset writes. Rows go to splits by a hash of their global row number (over the raw files
in sorted order) and to shards by their position within the split, so the output depends only on the
input and the settings, never on the engine or its parallelism.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ballast.data.petastorm_format import ROW_GROUPS_PER_FILE_KEY, UNISCHEMA_KEY, Field, unischema_bytes
from ballast.errors import DataError
from ballast.spec import DatasetSpec, FieldSpec
from ballast.training.dataset.format import (FORMAT_VERSION, ColumnLayout, encode_images, encode_npy, npy_header,
                                             numpy_dtype, tfrecord_examples, tfrecord_kind, tfrecord_value)
from ballast.training.failure import DataFailure

__all__ = ["FORMAT_VERSION", "SPLITS", "FeatureEncoder", "column_layouts", "layout", "plan_chunks", "read_chunk",
           "split_codes", "tokens_field", "unischema", "write_petastorm_metadata", "write_shard"]

SPLITS = ("train", "validation", "test")
TOKENS = "tokens"
"""A text dataset's one packed column: int32 token sequences of seq_len + 1 (CONTRACT 4)."""


def split_codes(row_ids: Any, *, validation: float, test: float, seed: int) -> Any:
    """0 = train, 1 = validation, 2 = test for each global row id, from a splitmix64 hash of (row, seed)."""
    import numpy as np

    with np.errstate(over="ignore"):
        z = np.asarray(row_ids, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    out = np.zeros(len(u), dtype=np.int8)
    out[u < test + validation] = 1
    out[u < test] = 2
    return out


def column_layout(field: FieldSpec, role: str = "feature") -> ColumnLayout:
    """The format's description of a spec field: name, type, shape, the codec actually used, role."""
    return ColumnLayout(field.name, field.type, tuple(field.shape), field.storage_codec, role)


def tokens_field(seq_len: int) -> FieldSpec:
    """The field of a text dataset's packed sequences: seq_len + 1 int32 token ids."""
    return FieldSpec(name=TOKENS, type="int32", shape=(seq_len + 1,), codec="ndarray")


def column_layouts(dataset: DatasetSpec, seq_len: int | None = None) -> list[ColumnLayout]:
    """Every packed column in order: the features, then the label; a text dataset's token sequences."""
    if dataset.text is not None:
        if not seq_len:
            raise DataError("training.seq_len: a text dataset is cut into seq_len + 1 token sequences; set it")
        return [column_layout(tokens_field(seq_len))]
    label = dataset.label_field
    return [*(column_layout(f) for f in dataset.features), *([column_layout(label, "label")] if label else [])]


def layout(dataset: DatasetSpec, *, task: str | None = None, seq_len: int | None = None,
           tokenizer: dict | None = None) -> dict:
    """What the manifest records of the columns (and the task, classes, tokenizer): enough to decode."""
    out = {"columns": [c.to_manifest() for c in column_layouts(dataset, seq_len)], "num_classes": dataset.num_classes,
           "task": task}
    if tokenizer is not None:
        out["tokenizer"] = tokenizer
    return out


def unischema(layouts: list[ColumnLayout]) -> bytes:
    """The pickled Petastorm Unischema of the packed dataset (every column with its codec, scalars as
    ScalarCodec), written without Petastorm (ballast.data.petastorm_format)."""
    fields = []
    for c in layouts:
        if c.codec in ("png", "jpeg"):
            fields.append(Field(c.name, "uint8", c.shape, c.codec))
        elif c.codec == "ndarray":
            fields.append(Field(c.name, _numpy_name(c.numpy_dtype), c.shape, "ndarray"))
        else:
            fields.append(Field(c.name, _numpy_name(c.stored_dtype), (), "scalar"))
    label = next((c for c in layouts if c.role == "label"), layouts[0])
    return unischema_bytes(f"{label.name}_dataset", fields)


def _numpy_name(dtype: Any) -> str:
    return "bool_" if dtype.kind == "b" else dtype.name


# --- reading the raw input in bounded batches ---------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One unit of raw input: a row group of a raw file, and the global id of its first row."""
    path: str
    row_group: int
    first_row: int
    rows: int


def plan_chunks(files: list[Path]) -> list[Chunk]:
    import pyarrow.parquet as pq

    chunks, start = [], 0
    for p in files:
        try:
            meta = pq.ParquetFile(p).metadata
        except Exception as exc:
            raise DataError(f"{p}: not a readable Parquet file ({exc})") from exc
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            chunks.append(Chunk(str(p), g, start, n))
            start += n
    return chunks


def read_chunk(chunk: Chunk, dataset: DatasetSpec, batch_rows: int, drop: Any = None) -> Iterator[tuple[Any, dict]]:
    """(global row ids, {column: values (n, *shape)}) of every feature and the label, for each batch of a
    chunk, without the rows whose ids are in `drop` (sorted; the rows validation quarantined)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ballast.training.hostmem import return_freed_memory

    return_freed_memory()  # each batch's decode buffers go back when freed (training.hostmem)
    fields = [*dataset.features, *([dataset.label_field] if dataset.label_field else [])]
    try:
        pf = pq.ParquetFile(chunk.path)
        batches = pf.iter_batches(batch_size=batch_rows, row_groups=[chunk.row_group], columns=[f.name for f in fields])
        first = chunk.first_row
        for batch in batches:
            ids = np.arange(first, first + batch.num_rows, dtype=np.int64)
            first += batch.num_rows
            if drop is not None and drop.size:
                keep = ~np.isin(ids, drop)
                if not keep.all():
                    batch = batch.filter(pa.array(keep))
                    ids = ids[keep]
            yield ids, {f.name: _column_values(chunk, batch.column(f.name), f, ids) for f in fields}
    except DataError:
        raise
    except Exception as exc:  # truncated files surface here, mid-read
        raise DataError(f"{chunk.path}: cannot read row group {chunk.row_group} ({exc})") from exc


def _column_values(chunk: Chunk, col: Any, f: FieldSpec, ids: Any) -> Any:
    """One raw column as numpy values of the field's type and shape (n, *shape); DataError naming the row."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    dtype = numpy_dtype(f.type)
    if col.null_count:
        bad = int(ids[np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0]])
        raise DataError(f"{chunk.path}: row {bad}: {f.name!r} is null; validate the data first")
    if f.shape:
        size = int(np.prod(f.shape))
        if pa.types.is_fixed_size_list(col.type):
            col = col.cast(pa.list_(col.type.value_type))
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != size)
        if bad.size:
            raise DataError(f"{chunk.path}: row {int(ids[bad[0]])}: {f.name!r} holds {int(lengths[bad[0]])}"
                            f" values, the spec's shape {list(f.shape)} needs {size}; validate the data first")
        values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    else:
        values = col.to_numpy(zero_copy_only=False)
    if np.issubdtype(dtype, np.integer) and values.size:
        info = np.iinfo(dtype)
        lo, hi = values.min(), values.max()
        if lo < info.min or hi > info.max:
            raise DataError(f"{chunk.path}: {f.name!r} has values in [{lo}, {hi}], outside {f.type}")
    return values.astype(dtype, copy=False).reshape(len(ids), *f.shape)


# --- encoding ------------------------------------------------------------------------------------------


class FeatureEncoder:
    """Encodes a column's values exactly as the field's Petastorm codec would (training.dataset.format),
    vectorised where possible: arrays as one pyarrow binary value per row, scalars as a typed pyarrow
    array (int64 for the integer types), what every format is written from."""

    def __init__(self, field: FieldSpec, role: str = "feature"):
        self.field = field
        self.layout = column_layout(field, role)
        self.codec = self.layout.codec

    def encode(self, x: Any) -> Any:
        """A pyarrow array, one encoded value per row of x (n, *shape)."""
        import numpy as np
        import pyarrow as pa

        n = len(x)
        if self.codec == "scalar":
            return pa.array(np.asarray(x).astype(self.layout.stored_dtype, copy=False))
        if self.codec == "ndarray":
            out = encode_npy(self.layout, x)
            offsets = np.arange(0, (n + 1) * out.shape[1], out.shape[1], dtype=np.int64)
            return pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets),
                                                                            pa.py_buffer(out)]).cast(pa.binary())
        try:
            return pa.array(encode_images(self.layout, x), type=pa.binary())
        except DataFailure as exc:
            raise DataError(str(exc)) from exc


# --- writing shards -------------------------------------------------------------------------------------


def write_shard(staging: Path, split: str, shard: int, columns: dict[str, Any], *, formats: tuple[str, ...],
                layouts: list[ColumnLayout], row_group_rows: int) -> list[dict]:
    """Write one shard in every format from FeatureEncoder's arrays (`columns`, by name, one per layout);
    returns manifest entries (sha256 filled in later)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    entries = []
    n = len(columns[layouts[0].name])
    for fmt in formats:
        rel = f"{fmt}/{split}/part-{shard:05d}.{'parquet' if fmt == 'petastorm' else 'tfrecord'}"
        path = staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"path": rel, "split": split, "format": fmt, "rows": n}
        if fmt == "petastorm":
            pq.write_table(pa.table({c.name: columns[c.name] for c in layouts}), path, row_group_size=row_group_rows)
            meta = pq.ParquetFile(path).metadata
            entry["row_groups"] = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        else:
            _write_tfrecord(path, columns, layouts)
        entry["bytes"] = path.stat().st_size
        entries.append(entry)
    return entries


def _write_tfrecord(path: Path, columns: dict[str, Any], layouts: list[ColumnLayout]) -> None:
    """The shard's tf.train.Example records (training.dataset.format: raw tensor bytes, not the .npy
    file Petastorm keeps) in TFRecord framing, the tfrecord package's: length, masked CRC32C of the
    length, record, masked CRC32C of the record."""
    import struct

    import numpy as np
    from tfrecord.writer import TFRecordWriter

    values: dict[str, list] = {}
    for c in layouts:
        col = columns[c.name]
        if not c.is_scalar:
            header = npy_header(c.numpy_dtype, c.shape) if c.codec == "ndarray" else b""
            try:
                values[c.name] = [tfrecord_value(c, v, header) for v in col.to_pylist()]
            except DataFailure as exc:
                raise DataError(str(exc)) from exc
        elif tfrecord_kind(c) == "bytes":  # float64 scalars: their 8 raw little-endian bytes
            raw = np.ascontiguousarray(col.to_numpy(zero_copy_only=False), dtype="<f8")
            values[c.name] = [raw[i:i + 1].tobytes() for i in range(len(raw))]
        else:
            values[c.name] = col.to_pylist()
    crc = TFRecordWriter.masked_crc
    with open(path, "wb") as out:
        for record in tfrecord_examples(layouts, values):
            length = struct.pack("<Q", len(record))
            out.write(length + crc(length) + record + crc(record))


def write_petastorm_metadata(split_dir: Path, schema: bytes, entries: list[dict]) -> Path:
    """`_common_metadata` as petastorm's materialize_dataset writes it: the pickled Unischema
    (`unischema`) and row groups per file."""
    import pyarrow.parquet as pq

    parquet = [e for e in entries if e["path"].endswith(".parquet")]
    arrow_schema = pq.read_schema(split_dir / Path(parquet[0]["path"]).name)
    groups = {Path(e["path"]).name: len(e["row_groups"]) for e in parquet}
    meta = dict(arrow_schema.metadata or {})
    meta[UNISCHEMA_KEY] = schema
    meta[ROW_GROUPS_PER_FILE_KEY] = json.dumps(groups).encode()
    path = split_dir / "_common_metadata"
    pq.write_metadata(arrow_schema.with_metadata(meta), path)
    return path
