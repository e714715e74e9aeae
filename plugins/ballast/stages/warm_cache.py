"""Stage 3: copy the converted shards into the node-local cache, in stages, each file verified.

Stage k brings the training shards up to its cumulative `fraction` (stage 1 holds what the first
steps of the first epoch read); validation and test shards come with the last stage. A file counts as
cached only after its size and sha256 match the manifest; it is written under a temporary name and
renamed. A re-run skips files already verified. Object keys that would leave the cache directory are
refused, and a stage that would exceed the byte budget or the free disk is refused before it starts.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ballast.context import RunContext
from ballast.errors import DataError, StorageError
from ballast.storage import atomic_write_bytes, safe_join, sha256_file


def plan_stages(files: list[dict], fmt: str, fractions: list[float]) -> list[list[dict]]:
    """Split the manifest's files of one format into cumulative cache stages."""
    train = [f for f in files if f["format"] == fmt and f["split"] == "train"]
    rest = [f for f in files if f["format"] == fmt and f["split"] != "train"]
    out, done = [], 0
    for i, frac in enumerate(fractions):
        upto = len(train) if i == len(fractions) - 1 else max(1, math.ceil(frac * len(train)))
        stage = train[done:upto]
        done = max(done, upto)
        if i == len(fractions) - 1:
            stage = stage + rest
        out.append(stage)
    return out


def _verified(path: Path, entry: dict) -> bool:
    if not path.is_file() or path.stat().st_size != entry["bytes"]:
        return False
    return sha256_file(path) == entry["sha256"]



def run(ctx: RunContext) -> dict:
    spec = ctx.spec
    conv = ctx.result("convert")
    prefix = conv["prefix"]
    manifest = json.loads(ctx.storage.read_bytes(f"{prefix}/manifest.json"))
    fmt = "petastorm" if "petastorm" in spec.conversion.formats else spec.conversion.formats[0]
    cache_dir = ctx.cache_root / spec.name / conv["dataset_id"]
    cache_dir.mkdir(parents=True, exist_ok=True)
    stages = plan_stages(manifest["files"], fmt, [s.fraction for s in spec.cache.stages])
    budget = spec.cache.max_bytes
    summary = []
    t_all = time.monotonic()
    for stage_spec, entries in zip(spec.cache.stages, stages):
        t0 = time.monotonic()
        todo = []
        for e in entries:
            dst = safe_join(cache_dir, e["path"])  # refuses '..' and absolute keys from the manifest
            if not _verified(dst, e):
                todo.append((e, dst))
        need = sum(e["bytes"] for e, _ in todo)
        used = sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file())
        if budget is not None and used + need > budget:
            raise StorageError(f"cache.max_bytes: stage {stage_spec.name!r} needs {need} more bytes in {cache_dir}"
                               f" ({used} used, budget {budget}); raise cache.max_bytes or free the cache")
        free = shutil.disk_usage(cache_dir).free
        if need > free:
            raise StorageError(f"cache.directory: {cache_dir} has {free} bytes free, stage {stage_spec.name!r}"
                               f" needs {need}; free disk or point cache.directory elsewhere")
        done_bytes = 0

        def fetch(entry: dict, dst: Path) -> int:
            ctx.storage.download(f"{prefix}/{entry['path']}", dst)
            if not _verified(dst, entry):
                dst.unlink(missing_ok=True)
                raise DataError(f"{ctx.storage.describe(prefix + '/' + entry['path'])}: size or sha256 differs from"
                                f" the dataset manifest; the converted dataset is damaged, re-run convert")
            return entry["bytes"]

        with ThreadPoolExecutor(max_workers=spec.cache.concurrency) as pool:
            futures = [pool.submit(fetch, e, d) for e, d in todo]
            for i, fut in enumerate(as_completed(futures), 1):
                done_bytes += fut.result()
                elapsed = max(time.monotonic() - t0, 1e-6)
                rate = done_bytes / elapsed
                if i % 20 == 0 or i == len(todo):
                    eta = (need - done_bytes) / rate if rate else 0.0
                    ctx.log.info("cache stage %s: %d/%d files, %.1f/%.1f MB, %.1f MB/s, ETA %.0fs",
                                 stage_spec.name, i, len(todo), done_bytes / 1e6, need / 1e6, rate / 1e6, eta)
        seconds = time.monotonic() - t0
        ctx.log.info("cache stage %s ready: %d files (%d already cached) in %.2fs", stage_spec.name, len(entries),
                     len(entries) - len(todo), seconds)
        summary.append({"stage": stage_spec.name, "files": len(entries), "downloaded": len(todo),
                        "bytes": need, "seconds": round(seconds, 3)})
    # The trainer reads the manifest from the cache; it goes last, like in storage.
    atomic_write_bytes(cache_dir / "manifest.json", json.dumps(manifest, indent=2).encode())
    os.utime(cache_dir)
    return {"cache_dir": str(cache_dir), "format": fmt, "stages": summary,
            "seconds": round(time.monotonic() - t_all, 3)}
