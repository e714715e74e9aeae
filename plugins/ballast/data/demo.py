"""Demo and benchmark data: scikit-learn's digits as raw input, and a synthetic generator of any size.

Both write the raw format the pipeline expects: Parquet with the image as a flattened float32 list
column and an int64 label.
"""

from __future__ import annotations

from pathlib import Path

from ballast.storage import atomic_write_bytes


def _write_parquet(path: Path, images, labels) -> None:
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = np.ascontiguousarray(images, dtype=np.float32).reshape(len(images), -1)
    offsets = np.arange(0, flat.size + 1, flat.shape[1], dtype=np.int32)
    col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))
    table = pa.table({"image": col, "label": pa.array(np.asarray(labels, dtype=np.int64))})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write_bytes(path, buf.getvalue())


def write_digits(dest: Path) -> Path:
    """The 1,797 8x8 digits images (values 0-16) as dest/part-00000.parquet."""
    from sklearn.datasets import load_digits

    d = load_digits()
    path = Path(dest) / "part-00000.parquet"
    _write_parquet(path, d.images, d.target)
    return path


def write_synthetic(dest: Path, *, rows: int, shape: tuple[int, ...] = (8, 8), classes: int = 10,
                    seed: int = 0, rows_per_file: int = 100_000) -> list[Path]:
    """A learnable synthetic classification set: each class is a noisy copy of its own random prototype."""
    import numpy as np

    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    prototypes = rng.uniform(0, 16, size=(classes, size)).astype(np.float32)
    paths = []
    for i, start in enumerate(range(0, rows, rows_per_file)):
        n = min(rows_per_file, rows - start)
        labels = rng.integers(0, classes, size=n)
        images = np.clip(prototypes[labels] + rng.normal(0, 4, size=(n, size)), 0, 16).astype(np.float32)
        path = Path(dest) / f"part-{i:05d}.parquet"
        _write_parquet(path, images.reshape(n, *shape), labels)
        paths.append(path)
    return paths
