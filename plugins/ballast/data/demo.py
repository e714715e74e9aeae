"""Demo and benchmark data, offline and deterministic (by seed), in the raw format the pipeline reads
(Parquet; arrays as flattened list columns):

- `digits`: scikit-learn's 1,797 8x8 digits (float32 `image`, int64 `label`);
- `synthetic`: a learnable classification set of any size;
- `corpus`: a text corpus no one here wrote: the Python standard library's own source files, one
  document per file (`text`, and its `path`), for the language-model pipeline;
- `segmentation`: random shapes on noisy backgrounds and their masks, 2-D (discs, rectangles, triangles:
  classes 1-3, background 0) or 3-D volumes (spheres, boxes: classes 1-2);
- `regression`: one disc per image, the label its area as a fraction of the image (float32).
"""

from __future__ import annotations

from pathlib import Path

from ballast.storage import atomic_write_bytes


def _list_column(values) -> object:
    """(n, *shape) values as a list column of each row flattened."""
    import numpy as np
    import pyarrow as pa

    flat = np.ascontiguousarray(values).reshape(len(values), -1)
    offsets = np.arange(0, flat.size + 1, flat.shape[1], dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))


def _write_columns(path: Path, columns: dict) -> None:
    """One Parquet file of these columns (arrays with more than one dimension become list columns)."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({k: _list_column(v) if np.ndim(v) > 1 else pa.array(v) for k, v in columns.items()})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write_bytes(path, buf.getvalue())


def _write_parquet(path: Path, images, labels) -> None:
    import numpy as np

    _write_columns(path, {"image": np.asarray(images, dtype=np.float32), "label": np.asarray(labels, dtype=np.int64)})


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


# --- a text corpus: the Python standard library's own sources --------------------------------------------


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted by path (third-party site-packages left out)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted((p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)),
                  key=lambda p: p.relative_to(root).as_posix())


def write_corpus(dest: Path, *, max_mb: float | None = None, repeat: int = 1, docs_per_group: int = 64) -> Path:
    """The stdlib corpus as dest/part-00000.parquet: one document per UTF-8 source file (`text`, with its
    `path`), up to `max_mb` MB of text, `repeat` times over (a larger corpus of the same documents, for
    benchmarks); written a row group at a time, never the whole corpus in memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources()
    root = Path(dest)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "part-00000.parquet"
    tmp = root / ".part-00000.parquet.tmp"
    schema = pa.schema([("path", pa.string()), ("text", pa.string())])
    limit = None if max_mb is None else int(max_mb * 1e6)
    with pq.ParquetWriter(tmp, schema) as out:
        for _ in range(max(1, repeat)):
            names, texts, size = [], [], 0
            for p in files:
                try:
                    text = p.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue  # a few test files are deliberately not UTF-8
                n = len(text.encode("utf-8"))
                if limit is not None and size + n > limit:
                    break
                size += n
                names.append(p.relative_to(stdlib).as_posix())
                texts.append(text)
                if len(texts) == docs_per_group:
                    out.write_table(pa.table({"path": names, "text": texts}, schema=schema))
                    names, texts = [], []
            if texts:
                out.write_table(pa.table({"path": names, "text": texts}, schema=schema))
    tmp.replace(path)
    return path


# --- shapes and their masks (segmentation), discs and their areas (regression) --------------------------


def _shape_masks(rng, size: int, three_d: bool, depth: int):
    """One sample's (classes (D,)H,W int64, count of shapes): 1-3 shapes of random kind, place and size,
    later ones on top."""
    import numpy as np

    grid = np.indices((depth, size, size) if three_d else (size, size)).astype(np.float32)
    dims = grid.shape[1:]
    mask = np.zeros(dims, dtype=np.int64)
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(1, 3 if three_d else 4))
        center = [rng.uniform(0.2, 0.8) * d for d in dims]
        r = [rng.uniform(0.1, 0.25) * d for d in dims]
        if kind == 1:  # disc / sphere
            inside = sum(((g - c) / rr) ** 2 for g, c, rr in zip(grid, center, r)) <= 1.0
        elif kind == 2:  # rectangle / box
            inside = np.logical_and.reduce([np.abs(g - c) <= rr for g, c, rr in zip(grid, center, r)])
        else:  # triangle: below the apex, inside two sloped edges
            y, x = grid
            cy, cx = center
            h = 2 * r[0]
            top = cy - r[0]
            inside = (y >= top) & (y <= top + h) & (np.abs(x - cx) <= (y - top) * r[1] / h * 2)
        mask[inside] = kind
    return mask


def write_segmentation(dest: Path, *, rows: int = 512, size: int = 32, three_d: bool = False, depth: int = 16,
                       dtype: str = "float32", seed: int = 0) -> Path:
    """`rows` noisy images (or volumes) of shapes with their masks, as dest/part-00000.parquet:
    `image` float32 in [0, 1] (or uint8 0-255) of shape [size, size] ([depth, size, size] with
    three_d) and `mask` int64 of the same shape (0 background, then one class per shape kind)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    masks = np.stack([_shape_masks(rng, size, three_d, depth) for _ in range(rows)])
    levels = np.array([0.2, 0.8, 0.55, 0.35], dtype=np.float32)  # background, then per class
    images = np.clip(levels[masks] + rng.normal(0, 0.08, masks.shape), 0, 1).astype(np.float32)
    if dtype == "uint8":
        images = np.round(images * 255).astype(np.uint8)
    path = Path(dest) / "part-00000.parquet"
    _write_columns(path, {"image": images, "mask": masks})
    return path


def write_regression(dest: Path, *, rows: int = 512, size: int = 16, seed: int = 0) -> Path:
    """`rows` noisy images of one disc each, as dest/part-00000.parquet: `image` float32 [size, size] and
    `area` float32, the disc's share of the image's pixels (a scalar to predict)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.indices((size, size)).astype(np.float32)
    cy, cx = (rng.uniform(0.3, 0.7, (2, rows, 1, 1)) * size).astype(np.float32)
    r = (rng.uniform(0.1, 0.35, (rows, 1, 1)) * size).astype(np.float32)
    disc = ((y - cy) ** 2 + (x - cx) ** 2) <= r ** 2
    images = np.clip(0.2 + 0.6 * disc + rng.normal(0, 0.05, disc.shape), 0, 1).astype(np.float32)
    area = disc.reshape(rows, -1).mean(axis=1).astype(np.float32)
    path = Path(dest) / "part-00000.parquet"
    _write_columns(path, {"image": images, "area": area})
    return path
