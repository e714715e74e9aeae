"""Reading the converted shards from the node-local cache, and sharding them per rank.

The cache directory holds the dataset's manifest.json and the shards it lists. Every shard is checked
against the manifest's size before it is read (the warm-cache stage already verified the sha256).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.failure import DataError


@dataclass
class Split:
    features: np.ndarray  # (N, *input_shape) float32
    labels: np.ndarray    # (N,) int64

    def __len__(self) -> int:
        return len(self.labels)


def read_manifest(data_dir: Path) -> dict:
    path = Path(data_dir) / "manifest.json"
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise DataError(f"{path}: dataset manifest missing; was the cache warmed?") from exc
    except ValueError as exc:
        raise DataError(f"{path}: dataset manifest is not valid JSON ({exc})") from exc


def load_split(data_dir: Path, split: str, *, fmt: str, feature: str, label: str,
               input_shape: list[int], num_classes: int) -> Split:
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    files = [f for f in manifest["files"] if f["split"] == split and f["format"] == fmt]
    if not files:
        raise DataError(f"{data_dir}: the manifest lists no {fmt} shards for split {split!r}")
    feats, labels = [], []
    for entry in files:
        path = data_dir / entry["path"]
        if not path.is_file():
            raise DataError(f"{path}: shard listed in the manifest is not in the cache")
        if path.stat().st_size != entry["bytes"]:
            raise DataError(f"{path}: size {path.stat().st_size} differs from the manifest ({entry['bytes']})")
        reader = _read_parquet if fmt == "petastorm" else _read_tfrecord
        x, y = reader(path, feature, label)
        feats.append(x)
        labels.append(y)
    x = np.concatenate(feats).astype(np.float32, copy=False)
    y = np.concatenate(labels).astype(np.int64, copy=False)
    size = int(np.prod(input_shape))
    if x.shape[1] != size:
        raise DataError(f"{data_dir}: feature {feature!r} has {x.shape[1]} values per row, expected {size} {input_shape}")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(f"{data_dir}: labels outside [0, {num_classes}) in split {split!r}")
    return Split(x.reshape(len(x), *input_shape), y)


def _read_parquet(path: Path, feature: str, label: str) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=[feature, label])
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for truncated or foreign files
        raise DataError(f"{path}: cannot read Parquet shard ({exc})") from exc
    col = table.column(feature).combine_chunks()
    values = col.flatten().to_numpy(zero_copy_only=False)
    rows = len(col)
    x = values.reshape(rows, -1) if rows else values.reshape(0, 0)
    y = table.column(label).to_numpy()
    return x, y


def _read_tfrecord(path: Path, feature: str, label: str) -> tuple[np.ndarray, np.ndarray]:
    from tfrecord.reader import tfrecord_loader

    xs, ys = [], []
    try:
        for rec in tfrecord_loader(str(path), None, {feature: "byte", label: "int"}):
            xs.append(np.frombuffer(rec[feature], dtype=np.float32))
            ys.append(int(rec[label][0]))
    except Exception as exc:
        raise DataError(f"{path}: cannot read TFRecord shard ({exc})") from exc
    return np.stack(xs) if xs else np.zeros((0, 0), np.float32), np.asarray(ys, np.int64)


def epoch_order(n: int, *, seed: int, epoch: int, rank: int, world: int) -> np.ndarray:
    """This rank's sample indices for an epoch: a permutation fixed by (seed, epoch), dealt round-robin.

    Every rank gets the same count (the tail is dropped), so collective ops stay in step.
    """
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    perm = rng.permutation(n)
    per_rank = n // world
    return perm[rank:per_rank * world:world]
