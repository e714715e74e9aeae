"""Average the weights of the last K committed checkpoints (for export).

    python -m ballast.training.average CHECKPOINT_DIR --last 3 --out model.pt      # one tensor file
    python -m ballast.training.average CHECKPOINT_DIR --last 3 --out averaged/     # safetensors shards

Only committed checkpoints whose files match their manifests are used; the output holds tensors only.
Into a directory, the mean is written as published weights are (`export`: model.safetensors, or
shards and their index above `--shard-bytes`), one output shard at a time, each tensor averaged as it
is read from every checkpoint (`averaged`): no process holds the whole model, the checkpoints sharded
or not. A `.pt` file is written by `torch.save`, which takes the whole model at once. The trainer uses
`average` too, to resume from the mean of the last checkpoints (training.checkpoint.resume_average_last).
Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ballast.training.checkpoint import export
from ballast.training.checkpoint.commit import committed, verify
from ballast.training.failure import CheckpointFailure


def averaged(paths: list[Path]) -> export.Source:
    """The mean of the model weights of several checkpoints (the seed documents' mean of the last 3), as
    a source of tensors read by name (`export.source`'s kind): each tensor asked for is read from every
    checkpoint in turn into a float64 running sum and divided, so what is held is the tensors asked for,
    not the model. A checkpoint holding other tensors (names or sizes) is refused naming it."""
    if not paths:
        raise CheckpointFailure("no checkpoints to average")
    sources = [export.source(Path(p)) for p in paths]  # model.pt, or a sharded checkpoint's pieces
    for p, s in zip(paths[1:], sources[1:], strict=True):
        if s.sizes != sources[0].sizes:
            raise CheckpointFailure(f"{p}: holds other tensors than {paths[0]}; cannot average different models")

    def read(names: list[str]) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}  # float64 running sums of the floating-point tensors, the first's others
        dtypes: dict[str, Any] = {}
        for i, src in enumerate(sources):
            for k, t in src.read(names).items():
                if not torch.is_floating_point(t):
                    out.setdefault(k, t)
                elif i:
                    out[k].add_(t)
                else:
                    out[k], dtypes[k] = t.double(), t.dtype
        return {k: (out[k].div_(len(sources)).to(dtypes[k]) if k in dtypes else out[k]) for k in names}

    return export.Source(dict(sources[0].sizes), read)


def average(paths: list[Path]) -> dict[str, Any]:
    """The mean model of several checkpoints, whole (`averaged`, every tensor read at once)."""
    src = averaged(paths)
    return src.read(list(src.sizes))


def main(argv: list[str] | None = None) -> int:
    """The export CLI: 0 with the file written, 1 with one line on stderr when a checkpoint is refused."""
    p = argparse.ArgumentParser(prog="python -m ballast.training.average", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint_dir", type=Path)
    p.add_argument("--last", type=int, default=3, help="how many of the newest checkpoints (default 3)")
    p.add_argument("--out", type=Path, required=True,
                   help="a .pt file (the whole mean at once), or a directory: safetensors, a shard at a time")
    p.add_argument("--shard-bytes", type=int, default=export.MAX_SHARD_BYTES,
                   help="into a directory: the largest shard file (default 5 GB, transformers' own)")
    args = p.parse_args(argv)
    if args.last < 1:
        p.error(f"--last must be >= 1 (got {args.last})")
    if args.shard_bytes < 1:
        p.error(f"--shard-bytes must be >= 1 (got {args.shard_bytes})")
    try:
        paths = committed(args.checkpoint_dir)[-args.last:]
        for path in paths:
            verify(path)
        if args.out.suffix != ".pt":
            done = export.export(averaged(paths), args.out, max_shard_bytes=args.shard_bytes)
            print(f"{args.out / done.weights_file}: mean of {', '.join(p.name for p in paths)}"
                  f" ({len(done.files)} files)")
            return 0
        state = average(paths)
    except CheckpointFailure as exc:
        print(f"average: {exc}", file=sys.stderr)
        return 1
    import torch

    tmp = args.out.with_name(f".{args.out.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, args.out)
    print(f"{args.out}: mean of {', '.join(p.name for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
