"""The spark conversion engine: the arrow engine's encoding, distributed as a Spark job.

The driver reads only Parquet footers: for each raw row group (a task) it counts the rows of each
split before it, so every row's position within its split, and with it its shard, is known without
a pass over the data. Executors read and encode their row groups (ballast.data.packing, the same code the
arrow engine runs), key each row by (shard, position), and Spark's shuffle gathers each shard into
one partition, sorted; each partition writes its shard files. The output is byte for byte what the
arrow engine writes. Memory per task is bounded by one raw row group and one shard.

Here the master is `local[*]` and the executors write into the driver's staging directory; on a
cluster, point `conversion.spark_master` at it and keep the staging directory on a filesystem the
executors share.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ballast.errors import DataError
from ballast.data.packing import SPLITS, FeatureEncoder, read_chunk, split_codes, write_shard


def _split_offsets(chunks, spec, bad_rows) -> tuple[list[list[int]], dict[str, int]]:
    """Per chunk, the rows of each split that come before it; and each split's total."""
    import numpy as np

    ds = spec.dataset
    totals = [0, 0, 0]
    offsets = []
    for c in chunks:
        ids = np.arange(c.first_row, c.first_row + c.rows, dtype=np.int64)
        codes = split_codes(ids, validation=ds.split.validation, test=ds.split.test, seed=ds.split.seed)
        if bad_rows.size:
            codes[np.isin(ids, bad_rows)] = -1
        offsets.append(list(totals))
        for k in range(3):
            totals[k] += int((codes == k).sum())
    return offsets, dict(zip(SPLITS, totals))


def convert_spark(chunks, spec, bad_rows, staging: Path, *, log) -> list[dict]:
    import math

    ds, conv = spec.dataset, spec.conversion
    offsets, totals = _split_offsets(chunks, spec, bad_rows)
    shards_per_split = {s: math.ceil(n / conv.shard_rows) for s, n in totals.items()}
    base, n_shards = {}, 0
    for s in SPLITS:
        base[s] = n_shards
        n_shards += shards_per_split[s]
    owner = [(s, i) for s in SPLITS for i in range(shards_per_split[s])]  # global shard -> (split, shard)
    log.info("spark: %d raw row groups -> %d shards (%s)", len(chunks), n_shards,
             ", ".join(f"{s}={shards_per_split[s]}" for s in SPLITS))

    label = ds.label_field
    fields = [(f, "feature") for f in ds.features] + ([(label, "label")] if label else [])
    layouts = [FeatureEncoder(f, role).layout for f, role in fields]

    def encode(task: tuple[Any, list[int]]):
        import numpy as np

        chunk, before = task
        encoders = [FeatureEncoder(f, role) for f, role in fields]
        seen = list(before)
        for ids, values in read_chunk(chunk, ds, conv.read_batch_rows, drop=bad_rows):
            codes = split_codes(ids, validation=ds.split.validation, test=ds.split.test, seed=ds.split.seed)
            cols = [e.encode(values[e.layout.name]).to_pylist() for e in encoders]
            for k, split in enumerate(SPLITS):
                sel = np.flatnonzero(codes == k)
                for j, i in enumerate(sel):
                    pos = seen[k] + j
                    yield (base[split] + pos // conv.shard_rows, pos), tuple(c[i] for c in cols)
                seen[k] += len(sel)

    def write(index: int, rows):
        import pyarrow as pa

        rows = list(rows)
        if not rows:
            return []
        split, shard = owner[index]
        columns = {c.name: pa.array([r[1][j] for r in rows], type=_arrow_type(c)) for j, c in enumerate(layouts)}
        return write_shard(staging, split, shard, columns, formats=conv.formats, layouts=layouts,
                           row_group_rows=conv.row_group_rows)

    spark = session(conv.spark_master)
    try:
        rdd = spark.sparkContext.parallelize(list(zip(chunks, offsets)), max(1, len(chunks)))
        entries = (rdd.flatMap(encode)
                   .repartitionAndSortWithinPartitions(n_shards, partitionFunc=lambda key: key[0])
                   .mapPartitionsWithIndex(write)
                   .collect())
    except Exception as exc:
        raise DataError(f"conversion.engine spark: the Spark job failed: {_root_cause(exc)}") from exc
    finally:
        spark.stop()
    return entries


def _arrow_type(layout) -> Any:
    """The Arrow type FeatureEncoder gives a column: binary for arrays, the stored type of a scalar."""
    import pyarrow as pa

    return pa.binary() if not layout.is_scalar else pa.from_numpy_dtype(layout.stored_dtype)


def session(master: str):
    """A Spark session whose Python workers run this interpreter (they need Ballast)."""
    import logging

    logging.getLogger("py4j").setLevel(logging.WARNING)  # its shutdown chatter lands in closed log streams
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    return (SparkSession.builder.master(master).appName("ballast-convert")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.memory", "1g")
            .config("spark.sql.shuffle.partitions", "4")
            .getOrCreate())


def _root_cause(exc: BaseException) -> str:
    text = str(exc)
    for line in text.splitlines():  # Py4J wraps the Python worker's error; its last "...Error: ..." line is it
        if "DataError: " in line:
            return line.split("DataError: ", 1)[1]
    return text.splitlines()[0][:500] if text else type(exc).__name__
