"""Stage 2: convert the raw input into packed training formats, with a manifest written last.

Outputs, under `datasets/<name>/<dataset_id>/` in the pipeline's storage:
    petastorm/<split>/part-NNNNN.parquet   Parquet readable by petastorm.make_batch_reader
    tfrecord/<split>/part-NNNNN.tfrecord   readable by the tfrecord package's PyTorch dataset
    manifest.json                          every shard's split, format, rows, bytes and sha256

`dataset_id` is a hash of the input fingerprint and every setting that changes the output, so a re-run
with the same input and settings finds the manifest and reuses the output. Rows are assigned to
train/validation/test by a hash of (row number, split seed): deterministic and independent of
sharding.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from ballast.context import RunContext
from ballast.rawdata import array_values, raw_files, read_table
from ballast.storage import ballast_home, sha256_file

SPLITS = ("train", "validation", "test")
FORMAT_VERSION = 1


def dataset_id(ctx: RunContext, input_fingerprint: str) -> str:
    s = ctx.spec
    key = {"v": FORMAT_VERSION, "input": input_fingerprint, "fields": [f.model_dump() for f in s.dataset.fields],
           "label": s.dataset.label, "split": s.dataset.split.model_dump(), "conversion": s.conversion.model_dump()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def assign_splits(n: int, *, validation: float, test: float, seed: int):
    """0 = train, 1 = validation, 2 = test for each row, from a splitmix64 hash of (row, seed)."""
    import numpy as np

    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    out = np.zeros(n, dtype=np.int8)
    out[u < test + validation] = 1
    out[u < test] = 2
    return out


def run(ctx: RunContext) -> dict:
    import numpy as np

    spec = ctx.spec
    fingerprint = ctx.result("validate")["input_fingerprint"]
    did = dataset_id(ctx, fingerprint)
    prefix = f"datasets/{spec.name}/{did}"
    if ctx.storage.exists(f"{prefix}/manifest.json"):
        manifest = json.loads(ctx.storage.read_bytes(f"{prefix}/manifest.json"))
        ctx.log.info("reusing converted dataset %s (same input and settings)", ctx.storage.describe(prefix))
        return {"dataset_id": did, "prefix": prefix, "reused": True, "rows": manifest["rows"]}

    t0 = time.monotonic()
    table = read_table(raw_files(ctx), spec.dataset)
    feature = spec.dataset.features[0]
    label = spec.dataset.label
    values, lengths = array_values(table, feature) if feature.shape else (
        table.column(feature.name).to_numpy().astype(np.float64), np.ones(table.num_rows, np.int64))
    width = int(np.prod(feature.shape)) if feature.shape else 1
    x = values.astype(np.float32).reshape(table.num_rows, width)
    y = table.column(label).to_numpy().astype(np.int64)
    split_of = assign_splits(table.num_rows, validation=spec.dataset.split.validation,
                             test=spec.dataset.split.test, seed=spec.dataset.split.seed)

    staging = Path(tempfile.mkdtemp(prefix="convert-", dir=_staging_root()))
    files = []
    try:
        for code, split in enumerate(SPLITS):
            rows = np.flatnonzero(split_of == code)
            for shard, start in enumerate(range(0, len(rows), spec.conversion.shard_rows)):
                idx = rows[start:start + spec.conversion.shard_rows]
                for fmt in spec.conversion.formats:
                    rel = f"{fmt}/{split}/part-{shard:05d}.{'parquet' if fmt == 'petastorm' else 'tfrecord'}"
                    path = staging / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    (_write_parquet if fmt == "petastorm" else _write_tfrecord)(
                        path, x[idx], y[idx], feature.name, label)
                    files.append({"path": rel, "split": split, "format": fmt, "rows": int(len(idx)),
                                  "bytes": path.stat().st_size, "sha256": sha256_file(path)})
        manifest = {
            "dataset_id": did, "name": spec.name, "input_fingerprint": fingerprint, "format_version": FORMAT_VERSION,
            "feature": {"name": feature.name, "type": "float32", "shape": list(feature.shape) or [1]},
            "label": {"name": label, "num_classes": spec.dataset.num_classes},
            "rows": {s: int((split_of == c).sum()) for c, s in enumerate(SPLITS)},
            "files": files, "created": time.time(),
        }
        total = len(files)
        for i, f in enumerate(files, 1):
            ctx.storage.upload(staging / f["path"], f"{prefix}/{f['path']}")
            if i % 50 == 0 or i == total:
                ctx.log.info("uploaded %d/%d shards", i, total)
        # The manifest goes last: a dataset without one is incomplete and never read.
        ctx.storage.write_bytes(f"{prefix}/manifest.json", json.dumps(manifest, indent=2).encode())
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    seconds = time.monotonic() - t0
    ctx.log.info("converted %d rows into %d shards in %.2fs (%s)", table.num_rows, len(files), seconds,
                 ", ".join(f"{s}={n}" for s, n in manifest["rows"].items()))
    return {"dataset_id": did, "prefix": prefix, "reused": False, "rows": manifest["rows"],
            "shards": len(files), "seconds": round(seconds, 3)}


def _staging_root() -> Path:
    root = ballast_home() / "staging"
    root.mkdir(parents=True, exist_ok=True)
    return root



def _write_parquet(path: Path, x, y, feature: str, label: str) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = np.arange(0, x.size + 1, max(x.shape[1], 1), dtype=np.int32)
    col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ascontiguousarray(x).reshape(-1)))
    pq.write_table(pa.table({feature: col, label: pa.array(y)}), path)


def _write_tfrecord(path: Path, x, y, feature: str, label: str) -> None:
    from tfrecord.writer import TFRecordWriter

    writer = TFRecordWriter(str(path))
    try:
        for row, lab in zip(x, y):
            writer.write({feature: (row.astype("<f4").tobytes(), "byte"), label: (int(lab), "int")})
    finally:
        writer.close()
