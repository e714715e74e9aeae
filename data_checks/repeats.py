"""Repeated values across every batch of a column, in bounded memory, for the two questions validation
asks that no single batch can answer: which rows hold a value that occurs more than once (`unique`:
every occurrence fails, the first one too, as GX marks them) and how many rows repeat an earlier row's
value (`duplicate_share`, fed the text column's 128-bit digests, never the documents).

Values and their global row numbers are held in memory up to `budget` bytes. Past it, everything held
goes to disk in `PARTITIONS` hash partitions (Arrow IPC streams in a private temporary directory, on the
node's disk where the caller says: validation spills under the Ballast home, not a RAM-backed /tmp), and
so does every later batch once the buffer fills again. At the end each partition is read on its own:
equal values share a partition, so its repeats are the whole data's. A partition over a quarter of the budget
is split again, streamed batch by batch, by other bits of its values' hash. So memory is bounded by a
few times the budget (judging what is held copies it) and one batch, whatever the number of distinct
values; what grows with the data is the disk (the values and 8 bytes per row) and, for `unique`, the
failing rows' numbers (8 bytes each). A spilled column keeps a file open per partition until the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUDGET = 64 << 20
"""Bytes of values and row numbers held in memory before they go to disk (per column)."""
PARTITIONS = 64
ROW = "_row"
LEVELS = 4
"""Levels of partitioning: level L takes its partition from bits 16L to 16L+15 of one 64-bit hash of
the values (pandas's: siphash for strings, a splitmix64 finalizer for numbers, so every slice of bits
is as good as another), so a split partition is split by bits independent of the ones that made it."""
_HASH_KEY = "ballast-repeats0"  # 16 characters, as pandas's hash needs
SPILL_PREFIX = "ballast-repeats-"


@dataclass
class Found:
    """What `Repeats.finish` found: the rows whose value occurs more than once (sorted, only when asked
    for), how many rows repeat an earlier row's value, and the first `examples` repeated values in row
    order (the values of the first rows in `rows`)."""

    repeats: int = 0
    rows: Any = None
    examples: list[Any] = field(default_factory=list)


class Repeats:
    """Feed `add(frame)` the non-null values (columns `keys`) and global row numbers (column `_row`) of
    each batch, in row order; then `finish()` once. `rows`: keep the numbers of the rows whose value
    repeats (unique); without it only the count is kept (duplicate share)."""

    def __init__(self, keys: tuple[str, ...], *, rows: bool, examples: int = 0, budget: int | None = None,
                 partitions: int = PARTITIONS, directory: Path | None = None) -> None:
        self.keys, self.want_rows, self.examples = keys, rows, examples
        self.directory = directory  # where the partitions go (a temporary directory in it); None: $TMPDIR
        if not 2 <= partitions <= 1 << 16:
            raise ValueError(f"partitions must be 2 to 65536 (16 bits of the hash per level), not {partitions}")
        self.budget, self.partitions = budget or BUDGET, partitions
        self.held: list[Any] = []  # pandas frames, in row order
        self.held_bytes = 0
        self.dir: Path | None = None
        self.parts: _Partitions | None = None
        self._cleanup: Any = None
        self._found: Found | None = None

    def add(self, frame: Any) -> None:
        if not len(frame):
            return
        frame = frame[[*self.keys, ROW]].reset_index(drop=True)
        for k in self.keys:  # -0.0 and 0.0 are one value: one hash
            if frame[k].dtype.kind == "f":
                frame[k] = frame[k] + 0.0
        self.held.append(frame)
        self.held_bytes += int(frame.memory_usage(index=False, deep=True).sum())
        if self.held_bytes > self.budget:
            self._spill()

    @property
    def spilled(self) -> bool:
        return self.dir is not None

    def _spill(self) -> None:
        import pandas as pd

        if self.dir is None:
            if self.directory is not None:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            # 0700, this process's own, held with a shared flock on its `.in-use` file while it lives (the
            # cache directory's convention, `storage.cache_dir`): what a killed validation left is removed here.
            from ballast.storage.cache_dir import hold

            self.dir = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=self.directory))
            self._cleanup = weakref.finalize(self, _release, hold(self.dir), self.dir)
            _remove_orphans(self.dir.parent)
            self.parts = _Partitions(self.dir / "p", self.partitions, level=0)
        held, self.held, self.held_bytes = self.held, [], 0
        chunk, size = [], 0
        for i, frame in enumerate(held):  # written in chunks of an eighth of the budget: never a second copy of it all
            chunk.append(frame)
            size += int(frame.memory_usage(index=False, deep=True).sum())
            held[i] = None
            if size >= self.budget // 8 or i == len(held) - 1:
                self.parts.append(pd.concat(chunk, ignore_index=True), self.keys)
                chunk, size = [], 0

    def finish(self) -> Found:
        """The repeats over everything added (the same answer if asked again); removes what went to disk."""
        import numpy as np
        import pandas as pd

        if self._found is not None:
            return self._found
        found, picked, rows = Found(), [], []
        try:
            if self.dir is None:
                if self.held:
                    held, self.held = self.held, []
                    self._judge(pd.concat(held, ignore_index=True), found, picked, rows)
            else:
                if self.held:
                    self._spill()
                self.parts.close()
                for files in self.parts.files:
                    self._judge_file(files, 0, found, picked, rows)
        finally:
            self.close()
        if self.want_rows:
            found.rows = np.sort(np.concatenate(rows)) if rows else np.zeros(0, dtype=np.int64)
        if picked:
            first = pd.concat(picked, ignore_index=True).sort_values(ROW).head(self.examples)
            found.examples = (first[self.keys[0]].tolist() if len(self.keys) == 1
                              else list(first[list(self.keys)].itertuples(index=False, name=None)))
        self._found = found
        return found

    def _judge(self, part: Any, found: Found, picked: list, rows: list) -> None:
        """The repeats of values that are all in `part` (everything held, or one partition)."""
        import numpy as np

        part = part.sort_values(ROW, kind="stable")
        keys = list(self.keys)
        found.repeats += int(part.duplicated(subset=keys, keep="first").sum())
        if self.want_rows or self.examples:
            bad = part[part.duplicated(subset=keys, keep=False)]
            if self.want_rows:
                rows.append(bad[ROW].to_numpy(dtype=np.int64))
            if self.examples:
                picked.append(bad.head(self.examples))

    def _judge_file(self, paths: list[Path], level: int, found: Found, picked: list, rows: list) -> None:
        """One partition (its files: one per run of batches of one dtype): judged whole if it is under a
        quarter of the budget (judging it takes a few copies), else split by the next bits of the hash and
        each part judged in turn; one that no split divides holds a few common values (`_judge_hot`)."""
        import pandas as pd

        paths = [p for p in paths if p.exists()]
        size = sum(p.stat().st_size for p in paths)
        if not paths:
            return
        if size <= self.budget // 4:
            frames = [b.to_pandas() for p in paths for b in _batches(p)]
            for p in paths:
                p.unlink()
            self._judge(pd.concat(frames, ignore_index=True), found, picked, rows)  # one dtype: concat's
            return
        if level + 1 >= LEVELS:
            self._judge_hot(paths, found, picked, rows)
            return
        parts = _Partitions(paths[0].with_name(f"{paths[0].stem}-"), self.partitions, level=level + 1)
        try:
            for p in paths:
                for batch in _batches(p):
                    parts.append(batch.to_pandas(), self.keys)
        finally:
            parts.close()
        for p in paths:
            p.unlink()
        if sum(1 for files in parts.files if files) == 1:  # every row to one part: splitting again is no use
            self._judge_hot(next(files for files in parts.files if files), found, picked, rows)
            return
        for files in parts.files:
            self._judge_file(files, level + 1, found, picked, rows)

    def _judge_hot(self, paths: list[Path], found: Found, picked: list, rows: list) -> None:
        """A partition that hashing could not split: few distinct values, many rows. Streamed twice: the
        count of each value, then the rows of the values that occur more than once."""
        import numpy as np
        import pandas as pd

        keys = list(self.keys)
        counts: dict[Any, int] = {}
        for p in paths:
            for batch in _batches(p):
                for value, n in batch.to_pandas().value_counts(subset=keys, sort=False, dropna=False).items():
                    counts[value] = counts.get(value, 0) + int(n)  # value: a tuple of the keys' values
        found.repeats += sum(n - 1 for n in counts.values())
        repeated = [v for v, n in counts.items() if n > 1]
        if (self.want_rows or self.examples) and repeated:
            for p in paths:
                for batch in _batches(p):
                    frame = batch.to_pandas()
                    bad = frame[pd.MultiIndex.from_frame(frame[keys]).isin(repeated)]
                    if self.want_rows:
                        rows.append(bad[ROW].to_numpy(dtype=np.int64))
                    if self.examples:
                        picked.append(bad.sort_values(ROW).head(self.examples))
        for p in paths:
            p.unlink()

    def close(self) -> None:
        """Remove what went to disk (done by `finish`; for a validation that stops early)."""
        self.held = []
        if self.parts is not None:
            self.parts.close()
        if self._cleanup is not None:
            self._cleanup()


def _release(lock: int, directory: Path) -> None:
    os.close(lock)
    shutil.rmtree(directory, ignore_errors=True)


def _remove_orphans(directory: Path) -> None:
    """Remove the spill directories under `directory` that no live validation holds (killed before it
    could remove them): those whose `.in-use` lock can be taken at once."""
    import fcntl

    from ballast.storage.cache_dir import IN_USE

    for d in directory.glob(f"{SPILL_PREFIX}*"):
        try:
            fd = os.open(d / IN_USE, os.O_RDWR)
        except OSError:
            continue  # being made right now (the lock comes just after the directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(d, ignore_errors=True)
        except BlockingIOError:
            pass  # a live validation's
        finally:
            os.close(fd)


def _batches(path: Path) -> Any:
    """The record batches of one partition file, read one at a time."""
    import pyarrow as pa

    with pa.OSFile(str(path), "rb") as src:
        yield from pa.ipc.open_stream(src)


def _hash_view(frame: Any, keys: tuple[str, ...]) -> Any:
    """The keys as they are hashed: numbers (and booleans) as float64, so that one value hashes alike
    whatever a batch's dtype (an integer column is float64 in a batch with nulls, bool object-typed)."""
    import pandas as pd

    out = {}
    for k in keys:
        col = frame[k]
        if col.dtype == object and pd.api.types.infer_dtype(col, skipna=True) in ("boolean", "integer", "floating",
                                                                                     "mixed-integer-float"):
            col = col.astype("float64")
        out[k] = col.astype("float64") if col.dtype.kind in "biuf" else col  # -0.0: made 0.0 by `add`
    return pd.DataFrame(out)


class _Partitions:
    """Hash partition files written as rows come (in row order): per partition one Arrow IPC stream per
    run of batches of one schema (a new one where a batch's dtypes differ)."""

    def __init__(self, stem: Path, count: int, *, level: int) -> None:
        self.stem, self.level = stem, level
        self.files: list[list[Path]] = [[] for _ in range(count)]
        self.writers: dict[int, tuple[Any, Any]] = {}

    def append(self, frame: Any, keys: tuple[str, ...]) -> None:
        import numpy as np
        import pandas as pd
        import pyarrow as pa

        hashed = pd.util.hash_pandas_object(_hash_view(frame, keys), index=False, hash_key=_HASH_KEY).to_numpy()
        which = ((hashed >> np.uint64(16 * self.level)) % np.uint64(len(self.files))).astype(np.int64)
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(self.files) + 1))
        table = pa.Table.from_pandas(frame.take(order), preserve_index=False)
        for i in range(len(self.files)):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if hi == lo:
                continue
            part = table.slice(lo, hi - lo)
            writer, schema = self.writers.get(i, (None, None))
            if writer is None or not schema.equals(part.schema, check_metadata=False):
                if writer is not None:
                    writer.close()
                path = Path(f"{self.stem}{i:03d}.{len(self.files[i])}.arrows")
                self.files[i].append(path)
                writer, schema = self.writers[i] = (pa.ipc.new_stream(str(path), part.schema), part.schema)
            writer.write_table(part)

    def close(self) -> None:
        while self.writers:
            self.writers.popitem()[1][0].close()
