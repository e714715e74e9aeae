"""Writing the packed dataset both conversion engines produce: raw rows in, encoded shards out.

The format itself (layout, manifest, the bytes of every value, FORMAT_VERSION) is the contract in
training.dataset.format, shared with the reader; this module reads the raw input, encodes it with
those codecs and writes the files. Besides the shards, each Petastorm split gets
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
from ballast.training.dataset.format import (FORMAT_VERSION, FeatureLayout, encode_images, encode_npy, npy_header, numpy_dtype,
                                     tfrecord_examples, tfrecord_value)
from ballast.training.failure import DataFailure

__all__ = ["FORMAT_VERSION", "SPLITS", "FeatureEncoder", "feature_layout", "layout", "plan_chunks", "read_chunk",
           "split_codes", "unischema", "write_petastorm_metadata", "write_shard"]

SPLITS = ("train", "validation", "test")


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


def feature_layout(field: FieldSpec) -> FeatureLayout:
    """The format's description of a spec field: name, type, shape and the codec actually used."""
    return FeatureLayout(field.name, field.type, tuple(field.shape), field.storage_codec)


def layout(dataset: DatasetSpec) -> dict:
    """What the manifest records of the feature and label: enough for a reader to decode them."""
    return {"feature": feature_layout(dataset.features[0]).to_manifest(),
            "label": {"name": dataset.label, "num_classes": dataset.num_classes}}


def unischema(dataset: DatasetSpec) -> bytes:
    """The pickled Petastorm Unischema of the packed dataset (feature with its codec, label as a
    scalar), written without Petastorm (ballast.data.petastorm_format)."""
    f = dataset.features[0]
    codec = f.storage_codec
    if codec in ("png", "jpeg"):
        field = Field(f.name, "uint8", tuple(f.shape), codec)
    elif codec == "ndarray":
        field = Field(f.name, numpy_dtype(f.type).name, tuple(f.shape), "ndarray")
    else:
        raise DataError(f"dataset.fields: feature {f.name!r} is a scalar; the packed format needs an array feature")
    label = Field(dataset.label, "int64", (), "scalar")
    return unischema_bytes(f"{dataset.label}_dataset".replace("-", "_"), [field, label])


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


def read_chunk(chunk: Chunk, dataset: DatasetSpec, batch_rows: int, drop: Any = None) -> Iterator[tuple[Any, Any, Any]]:
    """(global row ids, features (n, *shape), labels (n,)) for each batch of a chunk, without the rows
    whose ids are in `drop` (sorted; the rows validation quarantined)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    f = dataset.features[0]
    size = int(np.prod(f.shape))
    dtype = numpy_dtype(f.type)
    try:
        pf = pq.ParquetFile(chunk.path)
        batches = pf.iter_batches(batch_size=batch_rows, row_groups=[chunk.row_group],
                                  columns=[f.name, dataset.label])
        first = chunk.first_row
        for batch in batches:
            ids = np.arange(first, first + batch.num_rows, dtype=np.int64)
            first += batch.num_rows
            if drop is not None and drop.size:
                keep = ~np.isin(ids, drop)
                if not keep.all():
                    batch = batch.filter(pa.array(keep))
                    ids = ids[keep]
            col = batch.column(f.name)
            if pa.types.is_fixed_size_list(col.type):
                col = col.cast(pa.list_(col.type.value_type))
            lengths = pc.fill_null(pc.list_value_length(col), -1).to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(lengths != size)
            if bad.size:
                raise DataError(f"{chunk.path}: row {int(ids[bad[0]])}: {f.name!r} holds {int(lengths[bad[0]])}"
                                f" values, the spec's shape {list(f.shape)} needs {size}; validate the data first")
            values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
            if np.issubdtype(dtype, np.integer) and values.size:
                info = np.iinfo(dtype)
                lo, hi = values.min(), values.max()
                if lo < info.min or hi > info.max:
                    raise DataError(f"{chunk.path}: {f.name!r} has values in [{lo}, {hi}], outside {f.type}")
            x = values.astype(dtype, copy=False).reshape(len(ids), *f.shape)
            labels = batch.column(dataset.label)
            if labels.null_count:
                raise DataError(f"{chunk.path}: label {dataset.label!r} has nulls; validate the data first")
            y = labels.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            yield ids, x, y
    except DataError:
        raise
    except Exception as exc:  # truncated files surface here, mid-read
        raise DataError(f"{chunk.path}: cannot read row group {chunk.row_group} ({exc})") from exc


# --- encoding ------------------------------------------------------------------------------------------


class FeatureEncoder:
    """Encodes feature arrays exactly as the field's Petastorm codec would (training.dataset.format),
    vectorised where possible; one pyarrow binary value per row, what every format is written from."""

    def __init__(self, field: FieldSpec):
        self.field = field
        self.layout = feature_layout(field)
        self.codec = self.layout.codec

    def encode(self, x: Any) -> Any:
        """A pyarrow binary array, one encoded value per row of x (n, *shape)."""
        import numpy as np
        import pyarrow as pa

        n = len(x)
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


def write_shard(staging: Path, split: str, shard: int, feature: Any, labels: Any, *, formats: tuple[str, ...],
                layout: FeatureLayout, label_name: str, row_group_rows: int) -> list[dict]:
    """Write one shard in every format from FeatureEncoder's values (`feature`, a pyarrow binary array);
    returns manifest entries (sha256 filled in later)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    entries = []
    n = len(labels)
    for fmt in formats:
        rel = f"{fmt}/{split}/part-{shard:05d}.{'parquet' if fmt == 'petastorm' else 'tfrecord'}"
        path = staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"path": rel, "split": split, "format": fmt, "rows": n}
        if fmt == "petastorm":
            table = pa.table({layout.name: feature, label_name: pa.array(labels, type=pa.int64())})
            pq.write_table(table, path, row_group_size=row_group_rows)
            meta = pq.ParquetFile(path).metadata
            entry["row_groups"] = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        else:
            _write_tfrecord(path, feature, labels, layout, label_name)
        entry["bytes"] = path.stat().st_size
        entries.append(entry)
    return entries


def _write_tfrecord(path: Path, feature: Any, labels: Any, layout: FeatureLayout, label_name: str) -> None:
    """The shard's tf.train.Example records (training.dataset.format: raw tensor bytes, not the .npy
    file Petastorm keeps) in TFRecord framing, the tfrecord package's: length, masked CRC32C of the
    length, record, masked CRC32C of the record."""
    import struct

    from tfrecord.writer import TFRecordWriter

    header = npy_header(layout.numpy_dtype, layout.shape) if layout.codec == "ndarray" else b""
    try:
        values = [tfrecord_value(layout, v, header) for v in feature.to_pylist()]
    except DataFailure as exc:
        raise DataError(str(exc)) from exc
    crc = TFRecordWriter.masked_crc
    with open(path, "wb") as out:
        for record in tfrecord_examples(layout, label_name, values, labels.tolist()):
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
