"""The published-model store (issue 21, item 5): a version read from storage is one path segment before any
join, and the weights are checked against the model card's sha256 on every load, cached or not."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from ballast.storage import models as registry
from ballast.pipeline.context import RunContext
from ballast.errors import BallastError
from ballast.spec import parse_spec
from helpers import example_data

pytestmark = pytest.mark.unit

WEIGHTS = b"tensors only" * 100


def ctx_at(tmp_path) -> RunContext:
    d = example_data()
    d["storage"]["uri"] = str(tmp_path / "storage")
    return RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id="r1")


def publish(ctx: RunContext, version: str = "20261205T000000Z-r1", weights: bytes = WEIGHTS, **card) -> None:
    name, prefix = ctx.spec.name, f"models/{ctx.spec.name}/{version}"
    ctx.storage.write_bytes(f"{prefix}/model.pt", weights)
    card = {"version": version, "model_section": {}, "weights_sha256": hashlib.sha256(weights).hexdigest(), **card}
    ctx.storage.write_bytes(f"{prefix}/model_card.json", json.dumps(card).encode())
    ctx.storage.write_bytes(f"{prefix}/PUBLISHED", version.encode())
    ctx.storage.write_bytes(f"models/{name}/LATEST", f"{version}\n".encode())


@pytest.mark.parametrize("version", ["/tmp/poc", "../../../../tmp/poc", "..", ".", "a/b", "a\\b", "x" * 300, ""])
def test_a_crafted_latest_is_refused_naming_the_file_and_nothing_is_written_outside(tmp_path, version):
    ctx = ctx_at(tmp_path)
    publish(ctx)
    ctx.storage.write_bytes(f"models/{ctx.spec.name}/LATEST", version.encode())
    with pytest.raises(BallastError, match=r"LATEST.*not one version name"):
        registry.latest(ctx)
    assert not (tmp_path / "poc").exists()


def test_weights_are_checked_against_the_card_cached_or_not(tmp_path):
    ctx = ctx_at(tmp_path)
    publish(ctx)
    dest = tmp_path / "work"
    path = registry.weights(ctx, registry.latest(ctx), dest)
    assert path.read_bytes() == WEIGHTS and path.parent == dest
    path.write_bytes(b"tampered")  # a cached copy changed on disk: checked again, fetched again
    assert registry.weights(ctx, registry.latest(ctx), dest).read_bytes() == WEIGHTS
    # The stored weights no longer match their card: refused naming the object, the cache left clean.
    ctx.storage.write_bytes(f"{registry.latest(ctx).prefix}/model.pt", b"swapped")
    path.unlink()
    with pytest.raises(BallastError, match=r"model.pt.*sha256.*model card"):
        registry.weights(ctx, registry.latest(ctx), dest)
    assert [p.name for p in dest.iterdir()] == []


def test_a_card_without_the_weights_checksum_is_no_baseline_and_no_warm_start(tmp_path, caplog):
    """Published before cards carried the checksum: its weights cannot be checked, so they are never loaded;
    the pipeline goes on as if it had published nothing (the next model it publishes carries one)."""
    ctx = ctx_at(tmp_path)
    publish(ctx, weights_sha256=None)
    with caplog.at_level(logging.INFO, logger=ctx.log.name):  # not a handler left on the logger for later tests
        assert registry.latest(ctx) is None
    assert "model_card.json: no weights_sha256" in caplog.text
    forged = registry.Published(version="20261205T000000Z-r1", prefix=f"models/{ctx.spec.name}/20261205T000000Z-r1",
                                card={"model_section": {}})
    with pytest.raises(BallastError, match=r"model_card.json.*weights_sha256"):
        registry.weights(ctx, forged, tmp_path / "work")
