"""Stage 3b: the cache's later stages (the rest of the training files, then the test set), warmed
while training already runs on stage 1. Same verification and resumption as warm_cache."""

from __future__ import annotations

from ballast.context import RunContext
from ballast.stages.warm_cache import warm


def run(ctx: RunContext) -> dict:
    later = list(range(1, len(ctx.spec.cache.stages)))
    if not later:
        ctx.log.info("the cache has a single stage; warm_cache brought everything")
    return warm(ctx, later) if later else {"stages": [], "pending_stages": 0}
