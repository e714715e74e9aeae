"""The published models of a pipeline: `models/<name>/<version>/` (model.pt, model_card.json, then
PUBLISHED) and `models/<name>/LATEST` naming the newest version. Read by a warm start (the train task)
and by `evaluation.publish: if_better` (the evaluate task scores the last published model on the same
test split as the new one)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ballast.context import RunContext
from ballast.errors import BallastError


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
    version = storage.read_bytes(key).decode().strip()
    prefix = f"models/{name}/{version}"
    if not storage.exists(f"{prefix}/PUBLISHED"):
        raise BallastError(f"{storage.describe(key)} names {version!r}, which has no PUBLISHED marker: an"
                           f" incomplete publish; point LATEST at a complete version or delete it")
    try:
        card = json.loads(storage.read_bytes(f"{prefix}/model_card.json"))
    except ValueError as exc:
        raise BallastError(f"{storage.describe(prefix + '/model_card.json')}: unreadable model card ({exc})") from exc
    return Published(version=version, prefix=prefix, card=card)


def weights(ctx: RunContext, published: Published, dest_dir: Path) -> Path:
    """The published model's weights, downloaded (or found) under `dest_dir`."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / f"{published.version}.pt"
    if not dest.exists():
        tmp = dest.with_suffix(".part")
        ctx.storage.download(f"{published.prefix}/model.pt", tmp)
        tmp.replace(dest)
    return dest


def load(path: Path, model_section: dict[str, Any]) -> Any:
    """The model a published card describes, with its weights (loaded without unpickling)."""
    from training import checkpoint as ckpt
    from training.config.run import ModelConfig
    from training.models import build_configured_model

    model = build_configured_model(ModelConfig.model_validate(model_section))
    model.load_state_dict(ckpt.load_tensors(path))
    return model
