"""Stage 7: publish the evaluated model, its card and the run's report.

Layout in storage: `models/<name>/<version>/model.pt` (tensors only), `model_card.json`, then the
`PUBLISHED` marker, and finally `models/<name>/LATEST` naming the version. A version without the
marker is incomplete and must not be used. The run's report goes to `runs/<dag>/<run>/report.json`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ballast.context import RunContext, safe_run_id


def run(ctx: RunContext) -> dict:
    spec = ctx.spec
    ev = ctx.result("evaluate")
    train = ctx.result("train")
    conv = ctx.result("convert")
    ver = ctx.result("verify_checkpoint")
    version = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + safe_run_id(ctx.run_id)[-12:]
    prefix = f"models/{spec.name}/{version}"
    best = Path(ev["checkpoint"])
    card = {
        "name": spec.name, "version": version, "dag_id": ctx.dag_id, "run_id": ctx.run_id,
        "model": spec.training.model, "hidden_size": spec.training.hidden_size,
        "input": spec.dataset.features[0].model_dump(), "num_classes": spec.dataset.num_classes,
        "test": {k: ev[k] for k in ("metric", "value", "accuracy", "loss", "test_rows")},
        "dataset_id": conv["dataset_id"], "checkpoint": str(best), "checkpoint_step": ver["best"]["step"],
        "training": {"epochs": train["epochs"], "steps": train["steps"], "stopped_early": train["stopped_early"]},
        "spec": spec.model_dump(mode="json"), "published": time.time(),
        "load_with": "torch.load(path, weights_only=True) -> state_dict for training.models.build_model(...)",
    }
    ctx.storage.upload(best / "model.pt", f"{prefix}/model.pt")
    ctx.storage.write_bytes(f"{prefix}/model_card.json", json.dumps(card, indent=2).encode())
    ctx.storage.write_bytes(f"{prefix}/PUBLISHED", f"{version}\n".encode())
    ctx.storage.write_bytes(f"models/{spec.name}/LATEST", f"{version}\n".encode())

    report = {
        "pipeline": spec.name, "dag_id": ctx.dag_id, "run_id": ctx.run_id,
        "model": ctx.storage.describe(f"{prefix}/model.pt"),
        "model_card": ctx.storage.describe(f"{prefix}/model_card.json"),
        "checkpoints": train["checkpoint_dir"],
        "test": card["test"], "training": card["training"],
        "stages": {s: ctx.result(s) for s in ("validate", "convert", "warm_cache", "train", "verify_checkpoint")},
    }
    ctx.storage.write_bytes(f"{ctx.run_key}/report.json", json.dumps(report, indent=2, default=str).encode())
    ctx.log.info("published %s: test %s %.4f", ctx.storage.describe(prefix), ev["metric"], ev["value"])
    return {"version": version, "model": report["model"], "model_card": report["model_card"],
            "report": ctx.storage.describe(f"{ctx.run_key}/report.json"), "checkpoints": train["checkpoint_dir"],
            "metric": ev["metric"], "value": ev["value"]}
