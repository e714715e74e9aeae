"""Checkpoints between a node's disk and the pipeline's object storage, with the commit protocol kept:
a checkpoint is pushed files first, then manifest.json, then COMMITTED, and pulled the same way, so a
reader on either side applies the same predicate (`training.checkpoint.committed`). Nothing to do when
storage is a path (a shared file system): training commits there directly.
"""

from __future__ import annotations

from pathlib import Path

from ballast.context import RunContext
from ballast.storage import safe_join


def pull(ctx: RunContext, ckpt_dir: Path) -> list[str]:
    """The committed checkpoints in storage that this node lacks, copied marker last."""
    from training import checkpoint as ckpt

    prefix = f"{ctx.run_key}/checkpoints/"
    names = sorted({k[len(prefix):].split("/", 1)[0] for k in ctx.storage.list(prefix)})
    have = {p.name for p in ckpt.committed(ckpt_dir)} if ckpt_dir.exists() else set()
    pulled = []
    for name in names:
        if name in have or not ctx.storage.exists(f"{prefix}{name}/{ckpt.COMMIT_MARKER}"):
            continue
        keys = list(ctx.storage.list(f"{prefix}{name}/"))
        dest = safe_join(ckpt_dir, name)
        last = [k for k in keys if k.endswith("/" + ckpt.COMMIT_MARKER)]
        for key in [k for k in keys if k not in last] + last:
            ctx.storage.download(key, safe_join(dest, key[len(f"{prefix}{name}/"):]))
        pulled.append(name)
    return pulled


def push(ctx: RunContext, ckpt_dir: Path) -> list[str]:
    """Committed checkpoints not yet in storage: files first, then manifest.json, then COMMITTED (a
    reader of storage applies the same predicate as on local disk)."""
    from training import checkpoint as ckpt

    done = []
    for path in ckpt.committed(ckpt_dir) if ckpt_dir.exists() else []:
        prefix = f"{ctx.run_key}/checkpoints/{path.name}"
        if ctx.storage.exists(f"{prefix}/{ckpt.COMMIT_MARKER}"):
            continue
        files = sorted(p.name for p in path.iterdir() if p.is_file())
        order = [f for f in files if f not in (ckpt.MANIFEST, ckpt.COMMIT_MARKER)] + [ckpt.MANIFEST, ckpt.COMMIT_MARKER]
        for name in order:
            ctx.storage.upload(path / name, f"{prefix}/{name}")
        done.append(ctx.storage.describe(prefix))
        ctx.log.info("checkpoint uploaded: %s", ctx.storage.describe(prefix))
    return done
