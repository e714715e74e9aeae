"""The epoch plan: which samples each rank reads, in which order, from any position.

An epoch's order is fixed by (seed, epoch): the files are permuted, each file's blocks, and each
block's rows; the concatenated sequence is cut into `world` equal contiguous parts, one per rank. So
each rank reads about 1/world of the blocks, every rank gets the same number of samples, and a rank's
position in the epoch (a sample count) says exactly which samples remain: a run resumes mid-epoch by
skipping that many, whatever the number of loader workers. The cache warm-up uses the same plan to
bring in the files the first steps read before the rest.
"""

from __future__ import annotations

import numpy as np

from ballast.training.dataset.format import Block

SpanList = list[tuple[int, np.ndarray]]
"""(block index, row indices within the block) pairs, in reading order."""


def rank_spans(blocks: list[Block], *, seed: int, epoch: int, rank: int, world: int) -> SpanList:
    """This rank's samples for an epoch, in order, as (block index, row indices within the block) spans."""
    # Files are permuted, then each file's blocks, then each block's rows: a rank reads whole files in
    # turn (so a cache warm-up phase holding its first files holds its first steps), and the mix changes
    # every epoch.
    files: dict[str, list[int]] = {}
    for i, b in enumerate(blocks):
        files.setdefault(b.path, []).append(i)
    groups = list(files.values())
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    order: list[int] = []
    for k in rng.permutation(len(groups)):
        inner = np.random.Generator(np.random.PCG64([seed, epoch, int(k), 0xF11E])).permutation(len(groups[k]))
        order.extend(groups[k][j] for j in inner)
    total = sum(b.rows for b in blocks)
    per_rank = total // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    spans, at = [], 0
    for b in order:
        n = blocks[b].rows
        if at + n > lo and at < hi:
            rows = np.random.Generator(np.random.PCG64([seed, epoch, int(b)])).permutation(n)
            spans.append((int(b), rows[max(lo - at, 0):min(hi - at, n)]))
        at += n
        if at >= hi:
            break
    return spans


def skip_samples(spans: SpanList, start: int) -> SpanList:
    """The spans left after the first `start` samples: where a run resumed mid-epoch goes on."""
    out = []
    for b, rows in spans:
        if start >= len(rows):
            start -= len(rows)
            continue
        out.append((b, rows[start:]))
        start = 0
    return out
