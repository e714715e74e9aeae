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
    """Mean of the model weights of several checkpoints (the seed documents' mean of the last 3)."""
    import torch

    if not paths:
        raise CheckpointFailure("no checkpoints to average")
    states = [model_weights(Path(p)) for p in paths]  # model.pt, or a sharded checkpoint's model (the export)
    keys = states[0].keys()
    for p, st in zip(paths, states):
        if st.keys() != keys:
            raise CheckpointFailure(f"{p}: holds other tensors than {paths[0]}; cannot average different models")
    out = {}
    for k in keys:
        t = states[0][k]
        out[k] = (torch.stack([st[k].double() for st in states]).mean(0).to(t.dtype)
                  if torch.is_floating_point(t) else t.clone())
    return out


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
