"""The node-local cache is shared by every run on the node (issue 21, item 9): concurrent warm-ups of one
dataset both succeed, and `cache.max_bytes` covers the whole cache directory, evicting the least recently
used datasets that no running try holds."""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path

import pytest
from ballast.storage import cache_dir as cachedir
from ballast.errors import StorageError
from ballast.stages import convert, validate, warm_cache
from helpers import make_ctx, run_chain

pytestmark = pytest.mark.integration


class _Slow:
    """A storage read stream that hands out small pieces slowly: two warm-ups overlap on every file."""

    def __init__(self, stream):
        self._stream = stream

    def read(self, n=-1):
        time.sleep(0.002)
        return self._stream.read(min(n, 4096) if n and n > 0 else 4096)

    def close(self):
        self._stream.close()


def test_two_runs_warming_the_same_dataset_at_once_both_succeed(tmp_path, digits_raw):
    first = make_ctx(tmp_path, digits_raw)
    conv = run_chain(first, validate, convert)["convert"]
    second = make_ctx(tmp_path, digits_raw, run_id="backfill__2026-01-01T00:00:00+00:00")
    second.save_result("convert", conv)
    opened: list[str] = []

    def slow(key, start=0, *, _open):
        opened.append(key)
        return _Slow(_open(key, start))

    for ctx in (first, second):
        ctx.storage.open_read = functools.partial(slow, _open=ctx.storage.open_read)
    start, results, errors = threading.Barrier(2), {}, []

    def warm(ctx):
        start.wait()
        try:
            results[ctx.run_id] = warm_cache.warm(ctx, [0, 1])
        except Exception as exc:  # noqa: BLE001  (reported below, by run)
            errors.append(f"{ctx.run_id}: {exc}")

    threads = [threading.Thread(target=warm, args=(c,)) for c in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 2
    a, b = results.values()
    assert a.cache_dir == b.cache_dir
    # Every file came in once: the other run waited for it, then found it verified.
    assert len(opened) == len(set(opened)) == sum(p.files for p in a.phases)
    assert not [p for p in Path(a.cache_dir).rglob("*.part")]


def _old_dataset(root: Path, name: str, size: int, age: float, *, ballasts: bool = True) -> Path:
    d = root / "other_pipeline" / name
    d.mkdir(parents=True)
    (d / "data.bin").write_bytes(b"x" * size)
    if ballasts:
        (d / cachedir.IN_USE).touch()  # what a warm-up leaves: a dataset of Ballast's
    os.utime(d, (time.time() - age, time.time() - age))
    return d


def test_max_bytes_covers_the_whole_cache_evicting_the_least_recently_used_dataset_not_in_use(tmp_path, digits_raw):
    probe = make_ctx(tmp_path, digits_raw, lambda d: d["cache"].update(directory=str(tmp_path / "probe")))
    conv = run_chain(probe, validate, convert)["convert"]
    warm_cache.warm(probe, [0, 1])
    need = cachedir.usage(tmp_path / "probe")  # what the dataset takes in a cache
    root = tmp_path / "cache"
    oldest = _old_dataset(root, "oldest", 400_000, age=3000)
    held = _old_dataset(root, "held", 400_000, age=2000)  # older than `newer`, but a running try reads it
    newer = _old_dataset(root, "newer", 400_000, age=1000)
    foreign = _old_dataset(root, "users_own", 5_000_000, age=9000, ballasts=False)  # not Ballast's: never touched
    node_cache = root / "node-gpu7" / "digits" / "abc"  # a cluster node's own cache root, beside the worker's
    node_cache.mkdir(parents=True)
    (node_cache / cachedir.IN_USE).touch()
    (node_cache / "shard.bin").write_bytes(b"x" * 400_000)
    os.utime(node_cache, (time.time() - 9000, time.time() - 9000))
    ctx = make_ctx(tmp_path, digits_raw, lambda d: d["cache"].update(max_bytes=need + 900_000))
    ctx.save_result("convert", conv)
    with cachedir.in_use(held):
        warm_cache.warm(ctx, [0, 1])
    assert not oldest.exists() and held.exists() and newer.exists()  # one eviction was enough
    assert foreign.exists() and not (foreign / cachedir.IN_USE).exists() and node_cache.exists()
    assert sum(cachedir.usage(d) for d in cachedir.datasets(root)) <= need + 900_000
    # A budget that the datasets in use and this one cannot fit in: refused, the dataset in use kept.
    other_root = tmp_path / "cache2"
    busy = _old_dataset(other_root, "busy", 400_000, age=5000)
    tight = make_ctx(tmp_path, digits_raw, lambda d: d["cache"].update(max_bytes=need + 100_000,
                                                                       directory=str(other_root)))
    tight.save_result("convert", conv)
    with cachedir.in_use(busy), pytest.raises(StorageError, match=r"cache\.max_bytes: .* in use"):
        warm_cache.warm(tight, [0, 1])
    assert busy.exists()


def test_a_dataset_evicted_between_warm_up_and_training_is_warmed_again(tmp_path, digits_raw):
    """Nothing holds a dataset between the warm_cache task and the train task: the train task, holding it
    now, finds it gone and warms its first phase again instead of training on missing shards."""
    import logging

    from ballast.stages import train

    ctx = make_ctx(tmp_path, digits_raw)
    cache = run_chain(ctx, validate, convert, warm_cache)["warm_cache"]
    used, busy = cachedir.make_room(ctx.cache_root, keep=tmp_path / "other", need=1, budget=0,
                                    log=logging.getLogger("test"))
    assert not Path(cache.cache_dir).exists() and used == 0 and not busy  # evicted: no try held it
    with cachedir.in_use(Path(cache.cache_dir)):
        train.rewarm_if_evicted(ctx, cache)
    manifest = Path(cache.cache_dir) / "manifest.json"
    assert manifest.is_file()
    again = warm_cache.warm(ctx, [0])
    assert again.phases[0].downloaded == 0  # phase 1 is all there again, verified
