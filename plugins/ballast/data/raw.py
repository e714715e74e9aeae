"""Reading the raw input a spec names, and checking it against the spec's schema.

Raw data is Parquet: one file or a directory of files, local or under an s3:// prefix. Array fields are
list columns holding the value flattened row-major. Heavy imports (pyarrow, numpy) happen on call.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ballast.errors import DataError
from ballast.pipeline.context import RunContext
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
    """(values, lengths) of an array column: flat numpy values in the column's own dtype (a uint8 image
    stays uint8: no float64 copy) and the per-row element count (-1 = null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(f.name).combine_chunks()
    if pa.types.is_fixed_size_list(col.type):
        col = col.cast(pa.list_(col.type.value_type))
    lengths = pc.fill_null(pc.list_value_length(col), -1).to_numpy(zero_copy_only=False)
    return pc.list_flatten(col).to_numpy(zero_copy_only=False), lengths


def check_frame(table: Any, dataset: DatasetSpec) -> tuple[Any, dict[str, int]]:
    """A pandas frame for validation (of one batch): scalar columns as they are, array columns as derived
    columns (per-row min/max as float64, reduced from the values in their own dtype), the text column as its
    derived columns (text_batch_stats's length and digest)."""
    import numpy as np
    import pandas as pd

    data: dict[str, Any] = {}
    arrays: dict[str, int] = {}
    for f in dataset.fields:
        if f.name == dataset.text:
            data[f"{f.name}__len"], data[f"{f.name}__digest_hi"], data[f"{f.name}__digest_lo"] = \
                text_batch_stats(table.column(f.name))
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
            # Reduce per row in the values' dtype (only the per-row results become float64); NaN propagates
            # into min/max, so finiteness is taken from the values themselves (integers are always finite).
            mins[nonempty] = np.minimum.reduceat(values, starts[nonempty])
            maxs[nonempty] = np.maximum.reduceat(values, starts[nonempty])
            bad = ~np.isfinite(values) if values.dtype.kind == "f" else None
            if bad is not None and bad.any():
                finite[nonempty] = np.add.reduceat(bad.astype(np.int64), starts[nonempty]) == 0
        data[f"{f.name}__len"] = pd.Series(np.where(lengths < 0, np.nan, lengths))
        data[f"{f.name}__min"] = mins
        data[f"{f.name}__max"] = maxs
        data[f"{f.name}__finite"] = finite
    return pd.DataFrame(data), arrays


def text_batch_stats(column: Any) -> tuple[Any, Any, Any]:
    """Per row of a batch of a text column: its length in characters (NaN for null) and the two halves of
    its 128-bit BLAKE2b digest (nullable UInt64: NA for null), from which validation counts the rows that
    repeat an earlier row's text (`data_checks.combine.Duplicates`); the documents themselves are not kept."""
    import hashlib

    import numpy as np
    import pandas as pd
    import pyarrow.compute as pc

    col = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    lengths = pc.utf8_length(col).to_numpy(zero_copy_only=False).astype(np.float64)
    texts = col.to_pylist()
    digests = b"".join(hashlib.blake2b(b"" if t is None else t.encode("utf-8"), digest_size=16).digest()
                       for t in texts)
    halves = np.frombuffer(digests, dtype="<u8").reshape(-1, 2) if texts else np.zeros((0, 2), np.uint64)
    null = np.array([t is None for t in texts], dtype=bool)
    return (lengths, pd.arrays.IntegerArray(halves[:, 0].copy(), null.copy()).astype("UInt64"),
            pd.arrays.IntegerArray(halves[:, 1].copy(), null).astype("UInt64"))
