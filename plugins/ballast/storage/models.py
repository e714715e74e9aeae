"""The published models of a pipeline: `models/<name>/<version>/` (model.safetensors, or for a large
model its shards and model.safetensors.index.json; model_card.json, then PUBLISHED; versions published
before safetensors hold model.pt, a tensor-only torch file) and `models/<name>/LATEST` naming the newest version. Read by a warm start (the train task)
and by `evaluation.publish: if_better` (the evaluate task scores the last published model on the same
test split as the new one).

What storage holds is not trusted: a version read from `LATEST` must be one version name (a path
segment) before it is joined onto anything, the weights must match the sha256 their model card
records, checked on every load, a cached copy's included, and no model is built from a card's model
section before it is bounded and compared with the spec's (`model_mismatch`)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ballast.errors import BallastError, DataError
from ballast.pipeline.context import RunContext
from ballast.storage import sha256_file

VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""What publish names a version (a UTC time and the run's key): one path segment, never '.' or '..'."""
VERSION_BYTES = 256  # LATEST holds one version name: a bounded read
_SHA256 = re.compile(r"[0-9a-f]{64}")


class _Absent:
    def __repr__(self) -> str:
        return "(none)"


_ABSENT = _Absent()
"""A key one of two model sections has and the other lacks."""


@dataclass(frozen=True)
class Published:
    version: str
    prefix: str
    card: dict[str, Any]

    @property
    def model_section(self) -> dict[str, Any]:
        return self.card["model_section"]


def latest(ctx: RunContext) -> Published | None:
    """The pipeline's last published model, or None when it has published none."""
    storage, name = ctx.storage, ctx.spec.name
    key = f"models/{name}/LATEST"
    if not storage.exists(key):
        return None
    with storage.open_read(key) as f:
        raw = f.read(VERSION_BYTES)
    version = raw.decode("utf-8", "replace").strip()
    if not VERSION.fullmatch(version):
        raise BallastError(f"{storage.describe(key)}: {version[:80]!r} is not one version name (letters, digits,"
                           f" '.', '_', '-'; at most 128, no '/'); point LATEST at a published version or delete it")
    prefix = f"models/{name}/{version}"
    if not storage.exists(f"{prefix}/PUBLISHED"):
        raise BallastError(f"{storage.describe(key)} names {version!r}, which has no PUBLISHED marker: an"
                           f" incomplete publish; point LATEST at a complete version or delete it")
    try:
        card = json.loads(storage.read_bytes(f"{prefix}/model_card.json"))
    except ValueError as exc:
        raise BallastError(f"{storage.describe(prefix + '/model_card.json')}: unreadable model card ({exc})") from exc
    if not isinstance(card, dict) or not _SHA256.fullmatch(str(card.get("weights_sha256"))):
        # Published by an earlier Ballast (or edited): its weights cannot be checked, so they are not loaded.
        ctx.log.warning("%s: no weights_sha256 (published by an earlier Ballast?): its weights cannot be checked,"
                        " so it is neither an if_better baseline nor a warm start; the next model published"
                        " carries one", storage.describe(prefix + "/model_card.json"))
        return None
    return Published(version=version, prefix=prefix, card=card)


def _size_fields() -> dict[str, Any]:
    """The size fields of a model section's `data` that a model is built to (an embedding of vocab_size
    rows, positions for seq_len tokens, num_classes outputs), each with the bounds a spec puts on it: the
    spec's own field for seq_len (training.seq_len) and num_classes (dataset.num_classes); a vocabulary,
    which conversion finds, is held to int32 token ids there (ballast.data.text)."""
    from typing import Annotated

    from pydantic import Field

    from ballast.training.config.sections import ModelSettings, NumClasses

    seq_len = Annotated[(int, *ModelSettings.model_fields["seq_len"].metadata)]
    return {"seq_len": seq_len, "vocab_size": Annotated[int, Field(ge=1, le=2**31 - 1)], "num_classes": NumClasses}


def model_mismatch(published: Published, ours: dict[str, Any]) -> str | None:
    """Why the published model is not the model `ours` describes ({name, options, data}: the spec's model
    section as the trainer builds it, `ballast.stages.train.run_config_model`), or None when it is.

    A card is read from storage, not checked as a spec is, and a model is built from what it says: its
    size fields (`_size_fields`) are held to the spec's bounds first, then the section must validate as
    a model section and name the same model, options and data as the spec. Nothing is built here."""
    from pydantic import TypeAdapter, ValidationError

    from ballast.training.config.messages import describe, one_line, short
    from ballast.training.config.run import ModelConfig

    section = published.card.get("model_section")
    if not isinstance(section, dict) or not isinstance(section.get("data"), dict):
        return f"model_section must be a mapping of name, options and data (got {short(section)})"
    data = section["data"]
    for key, kind in _size_fields().items():
        if key in data:
            try:
                TypeAdapter(kind).validate_python(data[key], strict=True)
            except ValidationError as exc:
                return one_line(("model_section", "data", key), *describe(exc.errors()[0], ModelConfig)[1:])
    try:
        theirs = ModelConfig.model_validate(section).model_dump(mode="json")
    except ValidationError as exc:
        loc, msg, value = describe(exc.errors()[0], ModelConfig)
        return one_line(("model_section", *loc), msg, value)
    diff = []
    for part in ("name", "options", "data"):
        mine, card = ours.get(part), theirs[part]
        if isinstance(mine, dict) and isinstance(card, dict):
            diff += [f"{part}.{k} {short(card.get(k, _ABSENT))} vs {short(mine.get(k, _ABSENT))}"
                     for k in sorted(set(mine) | set(card), key=str) if mine.get(k, _ABSENT) != card.get(k, _ABSENT)]
        elif mine != card:
            diff.append(f"{part} {short(card)} vs {short(mine)}")
    if diff:
        return "another model than this spec trains (card vs spec: " + ", ".join(diff) + ")"
    return None


def weights(ctx: RunContext, published: Published, dest_dir: Path) -> Path:
    """The published model's weights under `dest_dir`, each file a cached copy whose sha256 matches the
    model card, or downloaded (into a file of this call's own) and checked before it takes the name:
    the one weights file, or for sharded weights the index (the path returned) with every shard beside
    it in a directory of their own (`dest_dir/<version>/`)."""
    from ballast.training.checkpoint.published import INDEX, SHARD

    name = published.card.get("weights_file", "model.pt")
    card_key = ctx.storage.describe(published.prefix + "/model_card.json")
    if name not in ("model.safetensors", "model.pt", INDEX):
        raise DataError(f"{card_key}: weights_file {str(name)[:80]!r} is neither model.safetensors, {INDEX} nor"
                        f" model.pt; publish the model again")
    want = published.card.get("weights_sha256")
    if not isinstance(want, str) or not _SHA256.fullmatch(want):
        raise DataError(f"{card_key}: no weights_sha256 (published by an earlier Ballast, or edited): its weights"
                        f" cannot be checked; publish the model again")
    if not VERSION.fullmatch(published.version):  # `latest` checked it; a Published made elsewhere is checked too
        raise BallastError(f"{published.prefix}: {published.version[:80]!r} is not one version name")
    if name != INDEX:
        dest_dir.mkdir(parents=True, exist_ok=True)
        return _fetch(ctx, f"{published.prefix}/{name}", dest_dir / f"{published.version}{Path(name).suffix}", want)
    shards = published.card.get("weights_shards")
    if not isinstance(shards, dict) or not shards or not all(
            isinstance(k, str) and SHARD.fullmatch(k) and isinstance(v, str) and _SHA256.fullmatch(v)
            for k, v in shards.items()):
        raise DataError(f"{card_key}: weights_shards must map each shard file (model-0000k-of-0000N.safetensors)"
                        f" to its sha256; publish the model again")
    folder = dest_dir / published.version
    folder.mkdir(parents=True, exist_ok=True)
    for shard, sha in shards.items():  # the names checked above: bare file names, nothing outside `folder`
        _fetch(ctx, f"{published.prefix}/{shard}", folder / shard, sha)
    return _fetch(ctx, f"{published.prefix}/{INDEX}", folder / INDEX, want)


def _fetch(ctx: RunContext, key: str, dest: Path, want: str) -> Path:
    """`dest` holding the object `key`, whose sha256 must be `want`: the cached copy if it matches."""
    if dest.is_file() and sha256_file(dest) == want:
        return dest
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    os.close(fd)
    try:
        ctx.storage.download(key, Path(tmp))
        if sha256_file(Path(tmp)) != want:
            raise DataError(f"{ctx.storage.describe(key)}: its sha256 differs from the model card's: the"
                            f" published model is damaged or was replaced; publish it again")
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest


def load(path: Path, model_section: dict[str, Any], *, budget: int | None = None,
         log: Callable[[str], Any] | None = None) -> Any:
    """The model a published card describes, with its weights (safetensors: one file, or the index of
    its shards; or an earlier version's tensor-only model.pt: loaded without unpickling either way), in
    eval mode: read whole where they fit `budget` bytes (default: what this process may hold), else
    block by block as the model runs (training.checkpoint.streamed)."""
    from ballast.training.checkpoint import streamed
    from ballast.training.config.run import ModelConfig

    return streamed.load(path, ModelConfig.model_validate(model_section),
                         budget=streamed.memory_budget() if budget is None else budget, log=log)
