"""Reading the raw input a spec names, and checking it against the spec's schema.

Raw data is Parquet: one file or a directory of files, local or under an s3:// prefix. Array fields are
list columns holding the value flattened row-major. Heavy imports (pyarrow, numpy) happen on call.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ballast.pipeline.context import RunContext
from ballast.errors import DataError
from ballast.spec import DatasetSpec, FieldSpec
from ballast.storage import S3Storage, ballast_home, resolve_local, safe_join

_INT = ("int32", "int64", "uint8")
_FLOAT = ("float32", "float64")


def raw_files(ctx: RunContext) -> list[Path]:
    """Local paths of the raw Parquet files, downloading them first when the location is on S3."""
    location = ctx.spec.dataset.location
    if location.startswith("s3://"):
        store = S3Storage(location, conn_id=ctx.spec.storage.conn_id)
        keys = [k for k in store.list("") if k.endswith(".parquet")]
        if not keys:
            raise DataError(f"dataset.location: no .parquet objects under {location}")
        local_root = ballast_home() / "raw" / hashlib.sha256(location.encode()).hexdigest()[:16]
        paths = []
        for key in keys:
            dst = safe_join(local_root, key)
            if not dst.exists() or dst.stat().st_size != store.size(key):
                store.download(key, dst)
            paths.append(dst)
        return paths
    root = resolve_local(location)
    if root.is_file():
        return [root]
    if not root.exists():
        raise DataError(f"dataset.location: {root} does not exist (spec says {location!r}; relative paths are"
                        f" under BALLAST_HOME={ballast_home()}); for the example run `ballast data digits`")
    files = sorted(p for p in root.rglob("*.parquet") if not p.name.startswith("."))
    if not files:
        raise DataError(f"dataset.location: no .parquet files under {root}")
    return files


def fingerprint_files(paths: list[Path]) -> str:
    """sha256 over the raw files' names and contents: the identity of the input."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def read_table(paths: list[Path], dataset: DatasetSpec, skip: tuple[str, ...] = ()) -> Any:
    """Read the raw files into one Arrow table holding exactly the spec's fields (but `skip`: a text
    column, streamed by text_stats_of instead); DataError names the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    columns = [f.name for f in dataset.fields if f.name not in skip]
    for p in paths:
        try:
            schema = pq.read_schema(p)
        except Exception as exc:  # ArrowInvalid for truncated / non-Parquet files
            raise DataError(f"{p}: not a readable Parquet file ({exc})") from exc
        problems = check_schema(schema, dataset.fields)
        if problems:
            raise DataError(f"{p}: " + "; ".join(problems))
        try:
            tables.append(pq.read_table(p, columns=columns))
        except Exception as exc:
            raise DataError(f"{p}: cannot read ({exc})") from exc
    try:
        return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid as exc:
        raise DataError(f"{paths[0].parent}: raw files disagree on their schema ({exc})") from exc


def check_schema(schema: Any, fields: tuple[FieldSpec, ...]) -> list[str]:
    import pyarrow as pa

    problems = []
    for f in fields:
        if f.name not in schema.names:
            problems.append(f"missing column {f.name!r} (dataset.fields)")
            continue
        t = schema.field(f.name).type
        if f.shape:
            if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
                problems.append(f"column {f.name!r} has type {t}, spec says an array of {f.type} with shape {list(f.shape)}")
                continue
            t = t.value_type
        if not _type_ok(t, f.type):
            problems.append(f"column {f.name!r} has element type {t}, spec says {f.type}")
    return problems


def _type_ok(t: Any, want: str) -> bool:
    import pyarrow as pa

    if want in _INT:
        return pa.types.is_integer(t)
    if want in _FLOAT:
        return pa.types.is_floating(t) or pa.types.is_integer(t)
    if want == "bool":
        return pa.types.is_boolean(t)
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def array_values(table: Any, f: FieldSpec) -> tuple[Any, Any]:
    """(values, lengths) of an array column: flat numpy values and the per-row element count (-1 = null)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(f.name).combine_chunks()
    if pa.types.is_fixed_size_list(col.type):
        col = col.cast(pa.list_(col.type.value_type))
    lengths = pc.fill_null(pc.list_value_length(col), -1).to_numpy(zero_copy_only=False)
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    return values.astype(np.float64, copy=False) if values.dtype != np.float64 else values, lengths


def check_frame(table: Any, dataset: DatasetSpec, text: tuple[Any, Any] | None = None) -> tuple[Any, dict[str, int]]:
    """A pandas frame for validation: scalar columns as they are, array columns as derived columns, the
    text column as its derived columns (`text`: text_stats_of's, when the table does not hold it)."""
    import numpy as np
    import pandas as pd

    data: dict[str, Any] = {}
    arrays: dict[str, int] = {}
    for f in dataset.fields:
        if f.name == dataset.text:
            lengths, dup = text if text is not None else text_stats(table.column(f.name))
            data[f"{f.name}__len"], data[f"{f.name}__dup"] = lengths, dup
            continue
        if not f.shape:
            data[f.name] = table.column(f.name).to_pandas()
            if f.type in _FLOAT:
                data[f"{f.name}__finite"] = np.isfinite(data[f.name].to_numpy(dtype=np.float64, na_value=np.nan))
            continue
        arrays[f.name] = int(np.prod(f.shape))
        values, lengths = array_values(table, f)
        n = len(lengths)
        counts = np.maximum(lengths, 0)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        nonempty = counts > 0
        mins = np.full(n, np.nan)
        maxs = np.full(n, np.nan)
        finite = np.ones(n, dtype=bool)
        if values.size:
            # Reduce per row; NaN propagates into min/max, so finiteness is taken from the values themselves.
            mins[nonempty] = np.minimum.reduceat(values, starts[nonempty])
            maxs[nonempty] = np.maximum.reduceat(values, starts[nonempty])
            bad = ~np.isfinite(values)
            if bad.any():
                finite[nonempty] = np.add.reduceat(bad.astype(np.int64), starts[nonempty]) == 0
        data[f"{f.name}__len"] = pd.Series(np.where(lengths < 0, np.nan, lengths))
        data[f"{f.name}__min"] = mins
        data[f"{f.name}__max"] = maxs
        data[f"{f.name}__finite"] = finite
    return pd.DataFrame(data), arrays


def text_stats_of(paths: list[Path], column: str, batch_rows: int = 1024) -> tuple[Any, Any]:
    """text_stats of a text column read a batch at a time, never the whole corpus: lengths in characters
    (NaN for null) and whether a document repeats an earlier one (by a 16-byte BLAKE2b of its text)."""
    import hashlib

    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    lengths, dup, seen = [], [], set()
    for p in paths:
        try:
            for batch in pq.ParquetFile(p).iter_batches(batch_size=batch_rows, columns=[column]):
                col = batch.column(0)
                lengths.append(pc.utf8_length(col).to_numpy(zero_copy_only=False).astype(np.float64))
                flags = np.zeros(len(col), dtype=bool)
                for i, text in enumerate(col.to_pylist()):
                    if text is None:
                        continue
                    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
                    flags[i] = digest in seen
                    seen.add(digest)
                dup.append(flags)
        except Exception as exc:  # truncated files surface here, mid-read
            raise DataError(f"{p}: cannot read {column!r} ({exc})") from exc
    if not lengths:
        return np.zeros(0), np.zeros(0, dtype=bool)
    return np.concatenate(lengths), np.concatenate(dup)


def text_rows(paths: list[Path], column: str, rows: Any, batch_rows: int = 1024) -> Any:
    """The text of the given global rows (sorted int64), read a batch at a time: an Arrow string array."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    out, start = [], 0
    for p in paths:
        for batch in pq.ParquetFile(p).iter_batches(batch_size=batch_rows, columns=[column]):
            ids = np.arange(start, start + batch.num_rows)
            start += batch.num_rows
            keep = np.isin(ids, rows)
            if keep.any():
                out.append(batch.column(0).filter(pa.array(keep)))
    return pa.concat_arrays(out) if out else pa.array([], pa.string())


def text_stats(column: Any) -> tuple[Any, Any]:
    """Per row of a text column: its length in characters (NaN for null) and whether it repeats an
    earlier row's text (dictionary codes: the first row of each distinct text is the original)."""
    import numpy as np
    import pyarrow.compute as pc

    col = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    lengths = pc.utf8_length(col).to_numpy(zero_copy_only=False).astype(np.float64)
    codes = pc.fill_null(pc.dictionary_encode(col).indices, -1).to_numpy(zero_copy_only=False)
    dup = np.zeros(len(codes), dtype=bool)
    if len(codes):
        _, first = np.unique(codes, return_index=True)
        dup[:] = True
        dup[first] = False
        dup[codes < 0] = False
    return lengths, dup
