"""Average the weights of the last K committed checkpoints into one model file (for export).

    python -m ballast.training.average CHECKPOINT_DIR --last 3 --out model.pt

Only committed checkpoints whose files match their manifests are used; the output holds tensors only.
The trainer uses `average` too, to resume from the mean of the last checkpoints
(training.checkpoint.resume_average_last). Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ballast.training.checkpoint.commit import committed, verify
from ballast.training.checkpoint.dcp import model_weights
from ballast.training.failure import CheckpointFailure


def average(paths: list[Path]) -> dict[str, Any]:
    """Mean of the model weights of several checkpoints (the seed documents' mean of the last 3): one
    checkpoint's model read at a time into float64 running sums (the mean model, not K of them, held)."""
    import torch

    if not paths:
        raise CheckpointFailure("no checkpoints to average")
    out: dict[str, Any] = {}  # float64 running sums of the floating-point tensors, the first's others
    dtypes: dict[str, Any] = {}
    for i, p in enumerate(paths):
        state = model_weights(Path(p))  # model.pt, or a sharded checkpoint's model (the export)
        if i and state.keys() != out.keys():
            raise CheckpointFailure(f"{p}: holds other tensors than {paths[0]}; cannot average different models")
        for k, t in state.items():
            if not torch.is_floating_point(t):
                out.setdefault(k, t)
            elif i:
                out[k].add_(t)
            else:
                out[k], dtypes[k] = t.double(), t.dtype
        del state
    return {k: (t.div_(len(paths)).to(dtypes[k]) if k in dtypes else t) for k, t in out.items()}


def main(argv: list[str] | None = None) -> int:
    """The export CLI: 0 with the file written, 1 with one line on stderr when a checkpoint is refused."""
    p = argparse.ArgumentParser(prog="python -m ballast.training.average", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint_dir", type=Path)
    p.add_argument("--last", type=int, default=3, help="how many of the newest checkpoints (default 3)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.last < 1:
        p.error(f"--last must be >= 1 (got {args.last})")
    try:
        paths = committed(args.checkpoint_dir)[-args.last:]
        for path in paths:
            verify(path)
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
