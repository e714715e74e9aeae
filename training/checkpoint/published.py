"""The published weights' layout, as the Hugging Face ecosystem reads it, and its loader.

One file, `model.safetensors`, when the model fits one shard; above that, safetensors shards
`model-00001-of-0000N.safetensors` ... and `model.safetensors.index.json`:
{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}} (what transformers'
`save_pretrained` writes and `from_pretrained` reads). Written by `export`; read here, one shard file
at a time, never by unpickling. Importing this module does not import torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ballast.training.failure import CheckpointFailure

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
INDEX_BYTES = 64 << 20  # an index names every tensor once: bounded, far above any real model's


def shard_name(k: int, n: int) -> str:
    """The k-th (1-based) of n shard files: model-0000k-of-0000n.safetensors."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def read_index(path: Path) -> dict[str, str]:
    """The weight map of the index file `path` (tensor name -> shard file name), checked: JSON of the
    Hugging Face form, every file a shard name of one set (a bare name: nothing outside the directory)."""
    path = Path(path)
    try:
        if path.stat().st_size > INDEX_BYTES:
            raise ValueError(f"larger than {INDEX_BYTES} bytes")
        index = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointFailure(f"{path}: not a safetensors index ({type(exc).__name__}: {exc}); publish the"
                                " model again") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointFailure(f"{path}: weight_map must map each tensor name to its shard file; publish the"
                                " model again")
    files = set(weight_map.values())
    if files != {shard_name(k, len(files)) for k in range(1, len(files) + 1)}:
        bad = sorted(f for f in files if not SHARD.fullmatch(f))[:1] or sorted(files)[:3]
        raise CheckpointFailure(f"{path}: weight_map names {', '.join(repr(f[:80]) for f in bad)}, not one set of"
                                f" shards model-00001-of-0000N.safetensors ... (N files); publish the model again")
    return weight_map


def load_sharded(path: Path) -> dict[str, Any]:
    """The state dict of the sharded weights whose index is `path` (its shards beside it), each shard
    read with `safetensors.torch.load_file`; a shard that is missing, damaged or holds other tensors
    than the index says is a CheckpointFailure naming the file."""
    from safetensors.torch import load_file

    path = Path(path)
    weight_map = read_index(path)
    out: dict[str, Any] = {}
    for name in sorted(set(weight_map.values())):
        f = path.parent / name
        try:
            tensors = load_file(str(f), device="cpu")
        except Exception as exc:  # FileNotFoundError, SafetensorError (a damaged header or truncated data)
            raise CheckpointFailure(f"{f}: cannot load as a safetensors shard of {path.name}"
                                    f" ({type(exc).__name__}: {exc})") from exc
        want = {k for k, v in weight_map.items() if v == name}
        if set(tensors) != want:
            diff = sorted(set(tensors) ^ want)[:3]
            raise CheckpointFailure(f"{f}: holds other tensors than {path.name} maps to it ({', '.join(diff)});"
                                    " publish the model again")
        out.update(tensors)
    return {k: out[k] for k in weight_map}  # the index's order (the model's)
