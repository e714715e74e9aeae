"""A test's training process under torchrun: the real Trainer resumes from its run config's checkpoints,
then (test only) either gathers what it restored for the test to compare, or starts a save that one rank
does not survive. Usage: python sharded_worker.py RUN_CONFIG {dump OUT | crash-save}

dump OUT     rank 0 writes the full restored model and optimizer state (gathered here, in the test's
             worker: the trainer never gathers) and the step to OUT, with torch.save
crash-save   the next step's checkpoint is saved synchronously; rank 1 exits right after writing its
             shards, before the commit: the save never completes
crash-write  the same, but rank 1 exits in the middle of writing its shard file (64 KiB into it)
"""

from __future__ import annotations

import contextlib
import os
import sys


def main() -> None:
    import torch
    from ballast.training.checkpoint import dcp
    from ballast.training.config import RunConfig
    from ballast.training.trainer import Trainer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    cfg, mode = RunConfig.load(sys.argv[1]), sys.argv[2]
    t = Trainer(cfg)
    if not t.resume():
        raise SystemExit("sharded_worker: nothing to resume from")
    if mode == "dump":
        msd, osd = get_state_dict(t.model, t.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if t.rank == 0:
            torch.save({"model": msd, "optim": osd["state"], "step": t.state.step}, sys.argv[3])
    elif mode == "crash-write":
        make = dcp._hashing_file_system

        def dying(digests, staging=None, shard_bytes=0):  # rank 1's shard stream ends the process once 64 KiB of it are on disk
            fs = make(digests, staging, shard_bytes)
            real = fs.create_stream

            @contextlib.contextmanager
            def create_stream(path, m):
                with real(path, m) as stream:
                    if "w" in m and t.rank == 1 and str(path).endswith(".distcp"):
                        write = stream.write

                        def write_then_die(b):
                            n = write(b)
                            if stream.size > 1 << 16:
                                stream._drain(stream.pos)  # what is staged, onto the disk
                                os._exit(17)
                            return n

                        stream.write = write_then_die
                    yield stream

            fs.create_stream = create_stream
            return fs

        dcp._hashing_file_system = dying
        t.state.step += 1
        t.save("test", asynchronous=False)
    elif mode == "crash-save":
        write = dcp.write

        def write_then_die(state, directory, *, rank, group, **kw):
            names = write(state, directory, rank=rank, group=group, **kw)
            if rank == 1:
                os._exit(17)  # killed between its shards and the commit
            return names

        dcp.write = write_then_die
        t.state.step += 1
        t.save("test", asynchronous=False)
    t.dist.ckpt_barrier()
    os._exit(0)  # the trainer's watchdog and metrics threads need no orderly end here


if __name__ == "__main__":
    main()
