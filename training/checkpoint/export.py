"""A checkpoint's model as published weights (safetensors), written one output shard at a time.

The tensors are planned from their sizes alone (DCP's metadata, or the shapes of an mmap'd model.pt):
in the model's order, a shard closes before the tensor that would take it over `max_shard_bytes`,
and a tensor larger than that gets a file of its own (transformers' `save_pretrained` does the same,
5 GB by default). One shard is then read and written at a time: from a sharded (DCP) checkpoint,
DCP's reader fetches the pieces of that shard's tensors from the rank files that hold them (the
metadata read by `dcp`'s restricted unpickler; nothing else is unpickled), and the tensors are freed
once their file is written. No process holds more than one output shard's tensors (at most
`max_shard_bytes`, or the one tensor larger than it) plus a piece being read: never the whole model.

One shard: `model.safetensors`, as before. Several: `model-0000k-of-0000N.safetensors` and
`model.safetensors.index.json` (the layout in `published`). A `hf_causal_lm` model is written in
transformers' own tensor names with its `config.json`, so `AutoModelForCausalLM.from_pretrained(dir)`
loads it (`transformers_layout`; Ballast's wrapper takes those names back, `models.hf`). Each file is written under a temporary
name and renamed; the index last. Tensors that share memory (tied embeddings) are each written in
full, so that `load_state_dict` of the loaded dict restores them. Importing this module does not
import torch.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ballast.training.checkpoint import dcp
from ballast.training.checkpoint.commit import DCP_METADATA
from ballast.training.checkpoint.published import INDEX, SHARD, SINGLE, shard_name
from ballast.training.failure import CheckpointFailure

MAX_SHARD_BYTES = 5_000_000_000
"""transformers' default `max_shard_size` ("5GB")."""
CONFIG = "config.json"


@dataclass(frozen=True)
class Exported:
    files: list[str]
    """The files written, in the order written: the shards, then the index (or the one model.safetensors)."""
    weights_file: str
    """What a reader opens: model.safetensors, or the index of the shards."""
    total_size: int
    """The tensors' bytes."""
    config: str | None = None
    """config.json, written beside the weights for transformers (`transformers_layout`), if any."""


@dataclass(frozen=True)
class Source:
    sizes: dict[str, int]
    """Each tensor's bytes, in the model's order."""
    read: Callable[[list[str]], dict[str, Any]]
    """The named tensors, whole, read now (and nothing else)."""


def _dcp_source(path: Path) -> Source:
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = dcp.reader(path)  # its metadata read and checked once, for every batch of tensors
    meta = source.read_metadata()
    prefix = dcp.MODEL + "."
    entries = {fqn[len(prefix):]: e for fqn, e in meta.state_dict_metadata.items()
               if fqn.startswith(prefix) and isinstance(e, TensorStorageMetadata)}
    files: dict[str, set[str]] = {}  # tensor -> the rank files holding its pieces
    for index, info in meta.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)

    def read(names: list[str]) -> dict[str, Any]:
        out = {n: torch.empty(tuple(entries[n].size), dtype=entries[n].properties.dtype) for n in names}
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({dcp.MODEL: out}, path, no_dist=True, read=source)
        except CheckpointFailure:
            raise
        except (Exception, CheckpointException) as exc:  # DCP's wraps what its reader raised (a damaged record);
            # it derives from BaseException, not Exception
            held = ", ".join(sorted({f for n in names for f in files.get(prefix + n, ())}))
            raise CheckpointFailure(f"{path}: cannot read the shards {held} through DCP"
                                    f" ({dcp.first_line(exc)})") from exc
        return out

    return Source({n: e.properties.dtype.itemsize * _numel(e.size) for n, e in entries.items()}, read)


def _file_source(path: Path) -> Source:
    """A tensor file: model.pt mapped (torch.load with mmap: its pages are read as the shards need
    them), or a safetensors file read lazily."""
    import torch

    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            handle = safe_open(str(path), framework="pt", device="cpu")
            sizes = {}
            for name in handle.keys():  # noqa: SIM118  (a safe_open handle is not iterable)
                sl = handle.get_slice(name)
                sizes[name] = _numel(sl.get_shape()) * _dtype_size(sl.get_dtype())
            return Source(sizes, lambda names: {n: handle.get_tensor(n) for n in names})
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # UnpicklingError, RuntimeError, SafetensorError... for a bad file
        raise CheckpointFailure(f"{path}: cannot load as a tensor file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointFailure(f"{path}: not a dict of tensors (a model's state dict)")
    return Source({k: v.numel() * v.element_size() for k, v in state.items()},
                   lambda names: {n: state[n] for n in names})


def _index_source(path: Path) -> Source:
    """Published sharded weights (the index `path`, its shards beside it), each tensor read from its
    shard file as asked (a shard's header is read once, at the first tensor asked of it)."""
    from safetensors import safe_open

    from ballast.training.checkpoint.published import read_index

    weight_map = read_index(path)
    handles: dict[str, Any] = {}

    def shard(file: str) -> Any:
        if file not in handles:
            try:
                handles[file] = safe_open(str(path.parent / file), framework="pt", device="cpu")
            except Exception as exc:  # FileNotFoundError, SafetensorError (a damaged header)
                raise CheckpointFailure(f"{path.parent / file}: cannot open as a safetensors shard of {path.name}"
                                        f" ({type(exc).__name__}: {exc})") from exc
        return handles[file]

    sizes = {}
    for name, file in weight_map.items():
        try:
            sl = shard(file).get_slice(name)
        except CheckpointFailure:
            raise
        except Exception as exc:  # the shard lacks a tensor its index maps to it
            raise CheckpointFailure(f"{path.parent / file}: no tensor {name!r}, which {path.name} maps to it;"
                                    " publish the model again") from exc
        sizes[name] = _numel(sl.get_shape()) * _dtype_size(sl.get_dtype())
    return Source(sizes, lambda names: {n: shard(weight_map[n]).get_tensor(n) for n in names})


def source(src: Path) -> Source:
    """The model tensors of `src`: a tensor file, published sharded weights (their index), or a
    checkpoint directory (its model.pt, or a sharded checkpoint's model pieces)."""
    src = Path(src)
    if src.name.endswith(".safetensors.index.json"):
        return _index_source(src)
    if src.is_file():
        return _file_source(src)
    if (src / "model.pt").is_file() or not (src / DCP_METADATA).is_file():
        return _file_source(src / "model.pt")
    return _dcp_source(src)


def plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """The tensor names of each output shard, in order: at most `max_shard_bytes` each, a larger tensor
    alone."""
    if max_shard_bytes < 1:
        raise CheckpointFailure(f"max_shard_bytes must be >= 1 (got {max_shard_bytes})")
    shards: list[list[str]] = []
    current: list[str] = []
    held = 0
    for name, size in sizes.items():
        if current and held + size > max_shard_bytes:
            shards.append(current)
            current, held = [], 0
        current.append(name)
        held += size
        if held > max_shard_bytes:  # one tensor larger than a shard: its own file
            shards.append(current)
            current, held = [], 0
    return shards + [current] if current or not shards else shards


def shards(src: Path | Source, max_shard_bytes: int = MAX_SHARD_BYTES) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, its tensors) for each output file of the model of `src` (a path `source` reads, or a
    source: the mean of checkpoints, `average.averaged`), read one shard at a time: the caller drops a
    shard's tensors before asking for the next."""
    from_src = src if isinstance(src, Source) else source(src)
    groups = plan(from_src.sizes, max_shard_bytes)
    n = len(groups)
    for k, names in enumerate(groups, 1):
        yield (SINGLE if n == 1 else shard_name(k, n)), from_src.read(names)


def _own(tensors: dict[str, Any]) -> dict[str, Any]:
    """Contiguous tensors, each with memory of its own (a tied tensor's second name gets a copy:
    safetensors refuses shared memory)."""
    seen: set[int] = set()
    out = {}
    for name, value in tensors.items():
        value = value.detach().contiguous()
        ptr = value.untyped_storage().data_ptr()
        out[name] = value.clone() if ptr in seen else value
        seen.add(ptr)
    return out


def transformers_layout(model_section: dict[str, Any]) -> tuple[Callable[[str], str], dict[str, Any] | None] | None:
    """For a `hf_causal_lm` model: (the tensor names transformers has, i.e. without the Ballast wrapper's
    `model.`, and the config.json that `AutoModelForCausalLM.from_pretrained` needs: its `config` option,
    or the config.json of its `path` where that is readable here, else None); None for any other model."""
    if model_section.get("name") != "hf_causal_lm":
        return None
    options = model_section.get("options") or {}
    config = None
    if isinstance(options.get("config"), dict):
        config = dict(options["config"])  # {model_type, settings}: what AutoConfig.for_model was given
    elif options.get("path"):
        try:
            config = json.loads((Path(options["path"]) / "config.json").read_text())
        except (OSError, ValueError):
            config = None
    return (lambda name: name.removeprefix("model.")), config


def export(src: Path | Source, dest_dir: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES,
           metadata: dict[str, str] | None = None, model_section: dict[str, Any] | None = None) -> Exported:
    """Write the model of `src` into `dest_dir` as published weights, one shard in memory at a time;
    for a `hf_causal_lm` model (`model_section`) in transformers' names, with its config.json.
    Files of an earlier export there (either layout) are removed first."""
    from safetensors.torch import save_file

    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    for old in dest_dir.iterdir():
        if old.name in (SINGLE, INDEX, CONFIG) or SHARD.fullmatch(old.name):
            old.unlink()
    hf = transformers_layout(model_section or {})
    rename = hf[0] if hf else (lambda name: name)
    meta = {"format": "pt", **(metadata or {})}  # "format": transformers refuses a safetensors file without it
    weight_map: dict[str, str] = {}
    files, total = [], 0
    for name, tensors in shards(src, max_shard_bytes):
        tensors = {rename(k): v for k, v in _own(tensors).items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        _write(dest_dir / name, lambda tmp, t=tensors: save_file(t, str(tmp), metadata=meta))
        weight_map.update(dict.fromkeys(tensors, name))
        files.append(name)
        del tensors  # this shard's memory goes before the next shard is read
    config = None
    if hf and hf[1] is not None:
        _write(dest_dir / CONFIG, lambda tmp: tmp.write_text(json.dumps(hf[1], indent=2)))
        config = CONFIG
    if files == [SINGLE]:
        return Exported(files=files, weights_file=SINGLE, total_size=total, config=config)
    index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}
    _write(dest_dir / INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=2)))
    return Exported(files=[*files, INDEX], weights_file=INDEX, total_size=total, config=config)


def _write(dest: Path, write: Callable[[Path], Any]) -> None:
    tmp = dest.with_name(f".{dest.name}.part")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(dest)


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _dtype_size(name: str) -> int:
    """Bytes per element of a safetensors dtype name (F32, BF16, I64, F8_E4M3...)."""
    if name == "BOOL":
        return 1
    digits = "".join(c for c in name.split("_")[0] if c.isdigit())
    return max(1, int(digits) // 8) if digits else 1
