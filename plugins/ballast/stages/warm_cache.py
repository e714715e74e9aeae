"""Stage 3: copy the converted dataset into the node-local cache, in warm-up phases, every file verified.

The spec's `cache.phases` are these warm-up phases ("stage" means a pipeline stage only). Phase k brings in the training files that hold the first
`fraction` of every rank's samples of epoch 0, in the order the trainer reads them (the same plan,
training.dataset.order), so phase 1 is exactly what the first steps need. This task warms phase 1
with the dataset's metadata and writes the cache's manifest; training starts then, and the train
task warms the later phases (`warm_rest`), then the validation and test sets (the last phase), in
the background on the same node; the trainer waits for a shard that is not in yet and loads the
validation set at its first evaluation.

A file counts as cached only once its size and sha256 match the manifest: it is streamed into
`.<name>.part`, hashed while written, and renamed only when it matches. A re-run skips verified
files and resumes a partial download from where it stopped. The cache is the node's, shared by its
runs (`ballast.storage.cache_dir`): one writer per file at a time, the dataset held against eviction while it
is warmed, and `cache.max_bytes` counts the whole cache directory, evicting the least recently used
datasets no try holds. Object keys that would leave the cache directory are refused, and a phase
that would exceed the byte budget or the free disk is refused before it starts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ballast.storage import cache_dir as cachedir
from ballast.pipeline.context import RunContext
from ballast.errors import DataError, StorageError
from ballast.data.progress import Progress
from ballast.records import WarmCacheResult, WarmUpPhase
from ballast.storage import Storage, atomic_write_bytes, safe_join, sha256_file

_BLOCK = 1 << 20


def plan_phases(manifest: dict, fmt: str, fractions: list[float], *, world: int, seed: int) -> list[list[dict]]:
    """The manifest's files of one format, cut into cumulative warm-up phases in training's read order."""
    from ballast.training.dataset.format import blocks_of
    from ballast.training.dataset.order import rank_spans

    files = [f for f in manifest["files"] if f["format"] == fmt]
    by_path = {f["path"]: f for f in files}
    blocks = blocks_of(manifest, "train", fmt)
    spans = [rank_spans(blocks, seed=seed, epoch=0, rank=r, world=world) for r in range(world)]
    per_rank = sum(b.rows for b in blocks) // world
    first = [f for f in files if f.get("kind") == "metadata"]
    out, taken = [], {f["path"] for f in first}
    for i, frac in enumerate(fractions):
        phase = list(first) if i == 0 else []
        need = math.ceil(frac * per_rank)
        for rank_spans_ in spans:
            got = 0
            for b, rows in rank_spans_:
                if got >= need:
                    break
                path = blocks[b].path
                if path not in taken:
                    taken.add(path)
                    phase.append(by_path[path])
                got += len(rows)
        if i == len(fractions) - 1:
            phase += [f for f in files if f["path"] not in taken]
            taken.update(f["path"] for f in files)
        out.append(phase)
    return out


def verified(path: Path, entry: dict) -> bool:
    if not path.is_file() or path.stat().st_size != entry["bytes"]:
        return False
    return sha256_file(path) == entry["sha256"]


def fetch(storage: Storage, key: str, dst: Path, entry: dict) -> int:
    """Stream one object into dst via a resumable .part file; renamed only once size and sha256 match.

    Returns the bytes transferred (less than the size when a partial download was resumed).
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    with cachedir.writing(dst):  # another run may be fetching the same file: it waits, then finds it here
        if dst.is_file() and verified(dst, entry):
            return 0
        return _fetch(storage, key, dst, entry)


def _fetch(storage: Storage, key: str, dst: Path, entry: dict) -> int:
    part = dst.with_name(f".{dst.name}.part")
    digest = hashlib.sha256()
    start = part.stat().st_size if part.exists() else 0
    if start > entry["bytes"]:
        part.unlink()
        start = 0
    if start:
        with open(part, "rb") as fh:  # resume: the hash covers what is already there
            while block := fh.read(_BLOCK):
                digest.update(block)
    got = 0
    if start < entry["bytes"]:
        stream = storage.open_read(key, start)
        try:
            with open(part, "ab") as out:
                while block := stream.read(_BLOCK):
                    out.write(block)
                    digest.update(block)
                    got += len(block)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:  # a full disk; a dropped connection comes from the storage as StorageError
            raise StorageError(f"{storage.describe(key)}: download stopped after {start + got} of {entry['bytes']}"
                               f" bytes ({exc}); a re-run resumes it") from exc
        finally:
            stream.close()
    if part.stat().st_size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
        part.unlink(missing_ok=True)
        raise DataError(f"{storage.describe(key)}: size or sha256 differs from the dataset manifest; the converted"
                        f" dataset is damaged, re-run convert (delete the dataset's manifest.json first)")
    os.replace(part, dst)
    return got


def dataset_dir(ctx: RunContext) -> Path:
    """Where the run's converted dataset is cached on this node: `<cache root>/<pipeline>/<dataset id>`."""
    return ctx.cache_root / ctx.spec.name / ctx.result("convert").dataset_id


def warm(ctx: RunContext, phase_indices: list[int], *, record_progress: bool = True) -> WarmCacheResult:
    """Warm the phases `phase_indices` (0-based indices into `cache.phases`) into the node-local cache.
    `record_progress`: write the stability view's progress record (the train task's own warm-up; not a
    cluster node's, whose peers warm at the same time)."""
    conv = ctx.result("convert")
    manifest = json.loads(ctx.storage.read_bytes(f"{conv.prefix}/manifest.json"))
    cache_dir = dataset_dir(ctx)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with cachedir.in_use(cache_dir):
        return _warm(ctx, phase_indices, manifest, cache_dir, record_progress=record_progress)


def _warm(ctx: RunContext, phase_indices: list[int], manifest: dict, cache_dir: Path, *,
          record_progress: bool) -> WarmCacheResult:
    spec, prefix, fmt = ctx.spec, ctx.result("convert").prefix, ctx.spec.train_format
    for f in manifest["files"]:
        safe_join(cache_dir, f["path"])  # a manifest with one key escaping the cache is refused whole
    phases = plan_phases(manifest, fmt, [s.fraction for s in spec.cache.phases],
                         world=spec.training.world_size, seed=spec.training.seed)
    budget = spec.cache.max_bytes
    summary: list[WarmUpPhase] = []
    t_all = time.monotonic()
    for i in phase_indices:
        phase_spec, entries = spec.cache.phases[i], phases[i]
        t0 = time.monotonic()
        todo = []
        for e in entries:
            dst = safe_join(cache_dir, e["path"])  # refuses '..' and absolute keys from the manifest
            if not verified(dst, e):
                todo.append((e, dst))
        need = sum(e["bytes"] for e, _ in todo)
        if budget is not None and need:
            used, busy = cachedir.make_room(ctx.cache_root, keep=cache_dir, need=need, budget=budget, log=ctx.log)
            if used + need > budget:
                raise StorageError(f"cache.max_bytes: stage {phase_spec.name!r} needs {need} more bytes in"
                                   f" {ctx.cache_root} ({used} used, {len(busy)} other datasets in use, budget"
                                   f" {budget}); raise cache.max_bytes or free the cache")
        free = shutil.disk_usage(cache_dir).free
        if need > free:
            raise StorageError(f"cache.directory: {cache_dir} has {free} bytes free, stage {phase_spec.name!r}"
                               f" needs {need}; free disk or point cache.directory elsewhere")
        progress = Progress(ctx.log, f"cache phase {phase_spec.name}", need, unit="bytes", every=2.0, files=len(todo),
                            ctx=ctx if record_progress else None, stage="warm_cache").start()

        def one(entry: dict, dst: Path) -> None:
            fetch(ctx.storage, f"{prefix}/{entry['path']}", dst, entry)
            progress.add(entry["bytes"], files=1)

        with ThreadPoolExecutor(max_workers=spec.cache.concurrency) as pool:
            for fut in as_completed([pool.submit(one, e, d) for e, d in todo]):
                fut.result()
        seconds = time.monotonic() - t0
        ctx.log.info("cache phase %s ready: %d files (%d already cached) in %.2fs", phase_spec.name, len(entries),
                     len(entries) - len(todo), seconds)
        summary.append(WarmUpPhase(name=phase_spec.name, files=len(entries), downloaded=len(todo), bytes=need,
                                   seconds=round(seconds, 3)))
        if i == 0:
            # The trainer reads the manifest from the cache; it goes in once phase 1 is verified.
            atomic_write_bytes(cache_dir / "manifest.json", json.dumps(manifest, indent=2).encode())
    os.utime(cache_dir)
    return WarmCacheResult(cache_dir=str(cache_dir), format=fmt, phases=summary,
                           pending_phases=max(0, len(spec.cache.phases) - 1 - max(phase_indices, default=0)),
                           seconds=round(time.monotonic() - t_all, 3))


def run(ctx: RunContext) -> WarmCacheResult:
    return warm(ctx, [0])


def warm_rest(ctx: RunContext) -> WarmCacheResult:
    """The later phases (what `run` left for the train task to bring in beside training)."""
    return warm(ctx, list(range(1, len(ctx.spec.cache.phases))))
