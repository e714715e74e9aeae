"""The raw data for validation, one bounded batch at a time, never the whole input.

Batches are read with `ParquetFile.iter_batches`, in file order, at most `max_rows` rows and about
`max_bytes` of decoded data each (the row size is estimated from the Parquet footer's uncompressed
column sizes). Each batch becomes a frame of scalar and derived columns (`raw.check_frame`: array
values reduced per row in their own dtype, never widened to float64; a text column's length and
128-bit digest, from which validation counts the documents repeated across batches in bounded memory).
Quarantined rows are read back the same way, by their global row number, a batch at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ballast.data.raw import check_frame, check_schema
from ballast.errors import DataError
from ballast.spec import DatasetSpec

BATCH_ROWS = 65536
BATCH_BYTES = 32 << 20
_WIDTH = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}
"""Bytes a value of each fixed-width Parquet type is decoded into (BYTE_ARRAY: its encoded size)."""


def check_files(paths: list[Path], dataset: DatasetSpec) -> list[int]:
    """Every file's footer read and its schema checked against the spec; returns their row counts."""
    import pyarrow.parquet as pq

    rows = []
    for p in paths:
        try:
            meta = pq.read_metadata(p)
        except Exception as exc:  # ArrowInvalid for truncated / non-Parquet files
            raise DataError(f"{p}: not a readable Parquet file ({exc})") from exc
        problems = check_schema(meta.schema.to_arrow_schema(), dataset.fields)
        if problems:
            raise DataError(f"{p}: " + "; ".join(problems))
        rows.append(meta.num_rows)
    return rows


def array_columns(dataset: DatasetSpec) -> dict[str, int]:
    """Each array field's element count, as the `shape` rule expects it."""
    return {f.name: math.prod(f.shape) for f in dataset.fields if f.shape and f.name != dataset.text}


def batch_rows_of(pf: Any, columns: list[str], max_rows: int, max_bytes: int) -> int:
    """Rows per batch for this file: max_rows, fewer where its rows are large (by the footer's sizes).

    A row's size is what its columns take while they are decoded: the larger of their uncompressed
    (encoded) size and their values at the width of their Parquet type, plus two bytes a value for
    each kind of level a column has (definition: nullable or nested; repetition: in a list). A list of
    4096 uint8 values is stored as INT32 and decoded with both levels: 32 KiB, where the footer says
    ~4 KiB (dictionary-encoded bytes), or a few bytes for a constant image."""
    meta = pf.metadata
    if meta.num_rows == 0:
        return max_rows
    wanted, size = set(columns), 0
    decoded = []
    for c in range(meta.num_columns):
        col = meta.schema.column(c)
        width = _WIDTH.get(col.physical_type, col.length if col.physical_type == "FIXED_LEN_BYTE_ARRAY" else 0)
        decoded.append(width + 2 * ((col.max_definition_level > 0) + (col.max_repetition_level > 0)))
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            if col.path_in_schema.split(".", 1)[0] in wanted:
                size += max(col.total_uncompressed_size, decoded[c] * col.num_values)
    per_row = max(1, size // meta.num_rows)
    return max(1, min(max_rows, max_bytes // per_row))


def batches(paths: list[Path], dataset: DatasetSpec, *, columns: list[str] | None = None,
            max_rows: int = BATCH_ROWS, max_bytes: int = BATCH_BYTES) -> Iterator[tuple[int, Any]]:
    """(global row number of its first row, Arrow table) per batch, in file order; at least one batch
    (empty, with the spec's columns) when the files hold no rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ballast.training.hostmem import return_freed_memory

    return_freed_memory()  # each batch's decode buffers go back when freed, not into a growing heap
    columns = columns if columns is not None else [f.name for f in dataset.fields]
    offset, schema = 0, None
    for p in paths:
        try:
            pf = pq.ParquetFile(p)
            schema = schema or pf.schema_arrow
            size = batch_rows_of(pf, columns, max_rows, max_bytes)
            for batch in pf.iter_batches(batch_size=size, columns=columns):
                yield offset, pa.Table.from_batches([batch])
                offset += batch.num_rows
        except DataError:
            raise
        except Exception as exc:  # truncated files surface here, mid-read
            raise DataError(f"{p}: cannot read ({exc})") from exc
    if offset == 0:
        empty = pa.schema([schema.field(c) for c in columns]) if schema is not None else pa.schema([])
        yield 0, empty.empty_table()


def frames(paths: list[Path], dataset: DatasetSpec, *, max_rows: int = BATCH_ROWS,
           max_bytes: int = BATCH_BYTES) -> Iterator[tuple[int, Any]]:
    """(offset, pandas frame of validation columns) of up to `max_rows` rows: raw.check_frame of each batch,
    consecutive batches' frames joined. A frame holds a few scalars a row where its batch held the arrays
    (a 64x64 image: 4 KiB of pixels, 8 decoded, ~40 bytes of frame), so the rows that `max_bytes` lets one
    batch decode are far fewer than a frame holds at little cost; and validating a frame costs Great
    Expectations ~0.3 s whatever its size (building the metric graph), so one call per 1024-row batch of
    images made that overhead most of the time."""
    import pandas as pd

    pending: list[Any] = []
    start = held = 0
    for offset, table in batches(paths, dataset, max_rows=max_rows, max_bytes=max_bytes):
        frame, _ = check_frame(table, dataset)
        if pending and held + len(frame) > max_rows:
            yield start, pd.concat(pending, ignore_index=True)
            pending, held = [], 0
        if not pending:
            start = offset
        pending.append(frame)
        held += len(frame)
    if pending:
        yield start, pd.concat(pending, ignore_index=True)


def rows_at(paths: list[Path], dataset: DatasetSpec, rows: Any, *, max_rows: int = BATCH_ROWS,
            max_bytes: int = BATCH_BYTES) -> Iterator[tuple[Any, Any]]:
    """The given global rows (sorted int64) of every field, read back a batch at a time: (their numbers,
    an Arrow table of them) per input batch that holds any, each in one schema (the files' schemas
    unified, as a dataset of several files reads), so that they can go to one Parquet file in turn."""
    import numpy as np
    import pyarrow as pa

    schema = row_schema(paths, dataset)
    for offset, table in batches(paths, dataset, max_rows=max_rows, max_bytes=max_bytes):
        lo, hi = np.searchsorted(rows, [offset, offset + table.num_rows])
        if hi > lo:
            yield rows[lo:hi], table.take(pa.array(rows[lo:hi] - offset)).select(schema.names).cast(schema)


def row_schema(paths: list[Path], dataset: DatasetSpec) -> Any:
    """The schema rows_at's tables have (for a file of none of them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    unified = pa.unify_schemas([pq.read_schema(p) for p in paths], promote_options="permissive")
    return pa.schema([unified.field(f.name) for f in dataset.fields])
