"""The torch side of reading: per-rank batches of an epoch through a DataLoader.

Loader workers decode whole spans (the rows a rank needs from one block, training.dataset.order) in
parallel; spans are dealt to workers round-robin and the DataLoader returns them in order, so the
sample order never depends on the worker count. The main process cuts the stream of spans into
batches. This is the only module of the package that imports torch.
"""

from __future__ import annotations

import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ballast.training.dataset.format import Block, blocks_of, read_manifest
from ballast.training.dataset.order import SpanList, rank_spans, skip_samples
from ballast.training.dataset.reader import BlockDecoder, import_readers, read_block
from ballast.training.failure import DataFailure
from ballast.training.forkgate import GATE
from ballast.training.parentdeath import die_with_parent, ignore_stop_signals, stop_signals_blocked


class Spans(IterableDataset):
    """Decoded spans of a rank's epoch, from the position `where` holds; worker w of k decodes spans
    w, w+k, ... so that the DataLoader, taking one item from each worker in turn, returns them in their
    planned order. `where` is (epoch, start sample) in memory shared with the workers, which live for
    the whole run (persistent) and read it each time the loader is iterated."""

    def __init__(self, data_dir: Path, fmt: str, blocks: list[Block], plan: tuple[int, int, int],
                 decoder: BlockDecoder, wait_seconds: float, where: Any):
        self.args = (Path(data_dir), fmt, blocks, plan, decoder, wait_seconds)
        self.where = where

    def spans(self) -> SpanList:
        _, _, blocks, (seed, rank, world), _, _ = self.args
        epoch, start = self.where[0], self.where[1]
        return skip_samples(rank_spans(blocks, seed=seed, epoch=epoch, rank=rank, world=world), start)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        data_dir, fmt, blocks, _, decoder, wait = self.args
        info = get_worker_info()
        wid, k = (info.id, info.num_workers) if info else (0, 1)
        for b, rows in self.spans()[wid::k]:
            x, y = read_block(data_dir, blocks[b], fmt, decoder, wait)
            take = partial(_take, rows=rows)
            yield _map(x, take), (None if y is None else take(y))


def _take(a: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a[rows]))


def _map(x: Any, fn: Callable[[Any], Any]) -> Any:
    """fn on a tensor (one feature) or on each tensor of a dict (several)."""
    return {k: fn(v) for k, v in x.items()} if isinstance(x, dict) else fn(x)


def _cat(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], dict):
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return torch.cat(parts)


def _start(loader: DataLoader, *, forks: bool) -> Iterator[Any]:
    """iter(loader); where it forks the workers (`forks`: its first iteration), with SIGTERM and SIGINT
    blocked on this thread meanwhile:
    a worker inherits the mask, so a group's signal arriving between its fork and its init function
    (in which it still had the rank's handlers, then torch's) waits there to be discarded. The rank
    itself still gets the signal, through another thread, or here once unblocked. Only for forked
    workers, whose init function unblocks them (a spawned worker would keep the mask for good)."""
    if loader.worker_init_fn is None or not forks:
        return iter(loader)
    # GATE: not while the checkpoint writer's thread is inside torch.save (training.forkgate)
    with stop_signals_blocked(), GATE:
        return iter(loader)


def _init_forked_worker(rank_pid: int, worker_id: int) -> None:
    """In a forked loader worker: live and die with the rank, quietly, and drop the rank's sockets.

    - SIGKILL when the rank dies (training.parentdeath): at once, where DataLoader's own check of its
      parent notices only within 5 s;
    - SIGTERM and SIGINT ignored: a worker's life is its rank's. A signal to the whole process group (a
      preemption notice, an interrupt) reached the workers too; dying of it, they had the rank fail
      ("DataLoader worker ... exited unexpectedly", printed with tracebacks) instead of committing its
      preemption checkpoint. The rank's own shutdown of its workers does not need the signal: they end
      on the loader's end-of-work message, or with the rank. The worker starts with both blocked
      (`_start`), so one sent before this point waits, and is discarded by SIG_IGN here.
    """
    ignore_stop_signals()
    die_with_parent(signal.SIGKILL, rank_pid)
    _drop_inherited_sockets(worker_id)


def _drop_inherited_sockets(_worker_id: int) -> None:
    """In a forked loader worker: close its copies of the rank's TCP sockets (gloo, the rendezvous store,
    the metrics endpoint). The worker talks to the rank through pipes only, and it ends with os._exit,
    so nothing in it uses or later closes these descriptors."""
    import socket
    import stat

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
            family = sock.family
            sock.detach()
        except OSError:
            continue
        if family in (socket.AF_INET, socket.AF_INET6):
            os.close(fd)


class EpochLoader:
    """Per-rank batches of the train split for an epoch, from any sample position, via a DataLoader."""

    def __init__(self, data_dir: Path, *, fmt: str, rank: int, world: int, seed: int, workers: int = 2,
                 prefetch: int = 2, wait_seconds: float = 0.0, split: str = "train"):
        self.data_dir = Path(data_dir)
        manifest = read_manifest(self.data_dir)
        self.fmt, self.rank, self.world, self.seed = fmt, rank, world, seed
        self.blocks = blocks_of(manifest, split, fmt)
        if not self.blocks:
            raise DataFailure(f"{self.data_dir}: the manifest lists no {fmt} shards for split {split!r}")
        self.decoder = BlockDecoder(manifest, fmt)
        self.workers, self.prefetch, self.wait_seconds = workers, prefetch, wait_seconds
        if workers:
            import_readers(fmt, self.decoder.codecs)
        self.samples_per_rank = sum(b.rows for b in self.blocks) // world
        self._loader: DataLoader | None = None
        self._where: Any = None
        self._forked = False
        self._finalizer: Any = None

    def spans(self, epoch: int) -> SpanList:
        return rank_spans(self.blocks, seed=self.seed, epoch=epoch, rank=self.rank, world=self.world)

    def batches(self, epoch: int, *, batch: int, start: int = 0) -> Iterator[tuple[Any, Any]]:
        """Full batches of `batch` samples from sample position `start` of this rank's epoch: (inputs,
        target), inputs a tensor (one feature) or a dict of tensors by name, target a tensor or None
        when the dataset has no label. One generator at a time: a new one ends the last's iteration."""
        loader = self._make_loader() if self._loader is None else self._loader
        self._where[0], self._where[1] = epoch, start  # what the workers read as this iteration begins
        first = self.decoder.features[0].name if len(self.decoder.features) > 1 else None
        xs, ys, have = [], [], 0
        forks, self._forked = not self._forked, True
        for x, y in _start(loader, forks=forks):
            xs.append(x)
            ys.append(y)
            have += len(x[first] if first else x)
            while have >= batch:
                xcat = _cat(xs)
                ycat = None if y is None else _cat(ys)
                yield _map(xcat, lambda t: t[:batch]), (None if ycat is None else ycat[:batch])
                xs, ys = [_map(xcat, lambda t: t[batch:])], [None if ycat is None else ycat[batch:]]
                have -= batch

    def _make_loader(self) -> DataLoader:
        """The rank's one DataLoader, its workers forked at its first iteration and kept for the run
        (persistent): an epoch, a resume or a rollback iterates it again from the position set in
        `_where`, without forking. Forking a worker while another thread of the rank holds a lock (the
        checkpoint writer's, in the serialiser, the allocator or an import) leaves that lock held in the
        worker for good, and the rank waits for its batches. Forked at every epoch's start, right after
        the epoch's asynchronous save began, ranks stood still there in CI twice (the second time with
        `GATE` around the serialiser; no stacks, so the lock is not known). Forked once, at the start of
        training, no save is in flight (and `GATE` still guards that fork)."""
        import multiprocessing
        from multiprocessing.util import Finalize

        workers = self.workers
        # Workers forked from this rank (Linux's default, stated because python -m ballast.training.torchrun
        # starts ranks from a forkserver, whose context they would otherwise inherit): forked, they start
        # with the readers imported, and as the rank's own children they notice when it dies and exit.
        # Started by the forkserver, they outlived a killed rank and held torchrun's output open. A forked
        # worker drops its copies of the rank's network sockets first: holding them, it kept a SIGKILLed
        # rank's gloo connections open until it noticed the death (5 s), and the other ranks waited that
        # long. It also ends the moment the rank does, and ignores the group's SIGTERM (_init_forked_worker).
        context = "fork" if sys.platform == "linux" and workers else None
        # (epoch, start) in shared memory, which the workers inherit; plain values without workers.
        self._where = multiprocessing.get_context(context).RawArray("q", 2) if workers else [0, 0]
        dataset = Spans(self.data_dir, self.fmt, self.blocks, (self.seed, self.rank, self.world), self.decoder,
                        self.wait_seconds, self._where)
        init = partial(_init_forked_worker, os.getpid()) if context == "fork" else None
        # Its own generator: creating the loader must not draw from torch's global RNG, or a run resumed
        # mid-epoch (loader created at the resume point) would see other dropout masks than the original.
        self._loader = DataLoader(dataset, batch_size=None, num_workers=workers,
                                  prefetch_factor=self.prefetch if workers else None,
                                  multiprocessing_context=context, worker_init_fn=init,
                                  persistent_workers=bool(workers), generator=torch.Generator().manual_seed(self.seed))
        self._forked = False
        if workers:
            # When this loader is collected, at `close`, or at exit by multiprocessing's handler (a rank's
            # too: a rank is a multiprocessing child, which runs no atexit handlers), before that handler
            # terminates and joins the children; priority 20: before the queues' own finalizers (10), which
            # stop their feeder threads.
            self._finalizer = Finalize(self, _end_workers, args=(self._loader,), exitpriority=20)
        return self._loader

    def close(self) -> None:
        """End the workers now (they live as long as the loader otherwise)."""
        if self._finalizer is not None:
            self._finalizer()
        self._loader = self._finalizer = None


def _end_workers(loader: DataLoader) -> None:
    """SIGKILL a persistent loader's workers: they hold nothing to save, and ignore SIGTERM, with which
    multiprocessing's exit handler would end them (then wait for them for good). Torch forgets their
    pids first, or its SIGCHLD handler would report them killed."""
    it = loader._iterator
    if it is None:
        return
    try:
        if it._worker_pids_set:
            from torch.utils.data._utils import signal_handling

            signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
    finally:
        for w in it._workers:
            if w.is_alive():
                w.kill()
            w.join(timeout=10)
