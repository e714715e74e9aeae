"""Average the weights of the last K committed checkpoints into one model file (for export).

    python -m training.average CHECKPOINT_DIR --last 3 --out model.pt

Only committed checkpoints whose files match their manifests are used; the output holds tensors only.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from training import checkpoint as ckpt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.average", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint_dir", type=Path)
    p.add_argument("--last", type=int, default=3, help="how many of the newest checkpoints (default 3)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        paths = ckpt.committed(args.checkpoint_dir)[-args.last:]
        for path in paths:
            ckpt.verify(path)
        state = ckpt.average(paths)
    except ckpt.CheckpointFailure as exc:
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
