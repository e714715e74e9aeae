"""A node's share of a checkpoint made whole for what its ranks read, from the run's storage.

Several nodes on object storage each hold a share of a checkpoint (`local-files.json`): its own ranks'
files, or, pulled for a resume, every file but the shard files. Before such a directory passes the gate
(`gate.latest_passing`'s `prepare`), its ranks plan what they read and one rank per directory runs the
launcher's fetch command (`checkpoint.fetch`: `python -m ballast.node --job REF --fetch`, given the
directory and the file names), which copies each file from storage and checks it against the manifest.
The ranks wait for it in a collective, so a fetch has the process group's timeout less
FETCH_MARGIN_SECONDS. Importing this module does not import torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ballast.training.checkpoint import dcp
from ballast.training.checkpoint.commit import DCP_METADATA, MANIFEST, SHARD_SUFFIX, held_files
from ballast.training.failure import CheckpointFailure

FETCH_MARGIN_SECONDS = 30.0
"""The rank that copies a node's missing checkpoint files from storage has the process group's timeout
less this: the other ranks wait for it in a collective, and it reports its failure before they give up."""


class NodeFetch:
    """`prepare` for the gate: `fetch(path)` (collective over the checkpoint group, through `gather`)."""

    def __init__(self, command: list[str], *, model: Any, optimizer: Any, dist: Any, root: Path,
                 gather: Callable[[Any], list[Any]]) -> None:
        self.command, self.model, self.optimizer, self.dist = command, model, optimizer, dist
        self.root, self.gather = Path(root), gather

    def __call__(self, path: Path) -> str | None:
        """Collective: the files of checkpoint `path` that this node's ranks read and its directory lacks,
        copied from storage by one rank per directory (the launcher's `fetch` command, which checks each
        against the manifest). First every file but the shard files (a node's own save lacks rank 0's
        metadata and trainer state), then the shard files each rank's load reads (DCP's load plan of its
        shards, from the metadata whose sha256 matches the manifest's; every file of a checkpoint
        that is not sharded). Returns why it could not be done (the same on every rank), or None."""
        import socket

        here = [socket.gethostname(), str(self.root.resolve())]  # the ranks sharing this directory

        def wanted(shards: bool) -> tuple[set[str], str | None]:
            try:
                files = json.loads((path / MANIFEST).read_text())["files"]
                if not shards:
                    return {f for f in files if not f.endswith(SHARD_SUFFIX)}, None
                if DCP_METADATA not in files:
                    return set(files), None
                # the metadata's bytes held to the manifest's sha256 as they are read (dcp_metadata)
                return dcp.needed_files(self.model, self.optimizer, path), None
            except CheckpointFailure as exc:
                return set(), str(exc)
            except Exception as exc:  # noqa: BLE001  (every rank must reach the gathers below)
                return set(), f"{path}: cannot plan which of its files this rank reads ({dcp.first_line(exc)})"

        for shards in (False, True):
            needed, failure = wanted(shards)
            everyone = self.gather([here, sorted(needed), failure])
            failure = next((f for _, _, f in everyone if f), None)
            if failure:
                return failure
            peers = [r for r, (where, _, _) in enumerate(everyone) if where == here]
            if self.dist.rank == peers[0]:
                try:
                    held = held_files(path)
                    missing = sorted(set().union(*(everyone[r][1] for r in peers)) - (held or set()))
                    failure = self._run(path, missing) if held is not None and missing else None
                except CheckpointFailure as exc:
                    failure = str(exc)
            failure = next((f for f in self.gather(failure) if f), None)
            if failure:
                return failure
        return None

    def _run(self, path: Path, names: list[str]) -> str | None:
        """The launcher's fetch command for `names`, ended with this rank if it dies (parent-death signal)."""
        import os
        import subprocess
        import sys

        t0 = time.monotonic()
        limit = max(1.0, self.dist.cfg.timeout_seconds - FETCH_MARGIN_SECONDS)
        argv = [sys.executable, "-m", "ballast.training.parentdeath", "--parent", str(os.getpid()), "--signal",
                "KILL", "--", *self.command, str(path), *names]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, check=False)
        except subprocess.TimeoutExpired:
            return (f"{path}: fetching {len(names)} file(s) from storage took over {limit:.0f}s (the process"
                    f" group's timeout, distributed.timeout_seconds, less {FETCH_MARGIN_SECONDS:.0f}s: the node's"
                    " other ranks wait for it in a collective)")
        except OSError as exc:
            return f"{path}: could not fetch {len(names)} file(s) from storage ({exc})"
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            return f"{path}: could not fetch {len(names)} file(s) from storage ({why[:500]})"
        # Every node's own line (the trainer's log is rank 0's alone): what this node read from storage.
        print(f"[train] rank {self.dist.rank}: fetched from storage {len(names)} file(s) of {path.name} this node's"
              f" ranks read: {', '.join(names)} ({time.monotonic() - t0:.2f}s)", flush=True)
        return None
