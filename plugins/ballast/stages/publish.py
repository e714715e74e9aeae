"""Stage 7: publish the evaluated model, its card and the run's report.

Layout in storage: `models/<name>/<version>/model.safetensors` (the weights as safetensors: loadable
without Ballast and without unpickling anything), or for a model larger than one shard
(`evaluation.publish_shard_bytes`, 5 GB by default) the shards `model-0000k-of-0000N.safetensors` and
their index `model.safetensors.index.json` (the Hugging Face layout; written from the checkpoint one
shard at a time, never the whole model in memory: `ballast.training.checkpoint.export`),
`model_card.json` (task, metrics, data, model name, options and the shapes it was built for,
tokenizer, the weights' sha256: of each file), for a language model its `tokenizer.json`, then the
`PUBLISHED` marker, and finally `models/<name>/LATEST` naming the version. A version without the
marker is incomplete and must not be used. The run's report goes to `runs/<dag>/<run>/report.json`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from ballast.pipeline.context import RunContext, safe_run_id
from ballast.records import PublishResult, RecoverySummary, RunReport, StageRecords, TrainingOutcome
from ballast.recovery import history
from ballast.storage import sha256_file

WEIGHTS = "model.safetensors"
CONFIG = "config.json"  # transformers' config of a hf_causal_lm model (ballast.training.checkpoint.export)
TOKENIZER = "tokenizer.json"


def to_safetensors(src: Path, dest: Path, *, metadata: dict[str, str], max_shard_bytes: int | None = None,
                   model_section: dict | None = None) -> dict[str, str]:
    """The tensor file `src`, or the model of the checkpoint directory `src` (its model.pt, or a sharded
    checkpoint's model pieces; loaded without unpickling), as published weights in the directory `dest`:
    one model.safetensors, or shards and their index when the model is larger than `max_shard_bytes`
    (read and written one shard at a time). Tensors that share memory (tied embeddings) are written
    each in full, so that a plain `load_state_dict` of the loaded weights restores them. A `hf_causal_lm`
    model (`model_section`) is written in transformers' names with its config.json (first in the
    result). Returns {file name: sha256} in the order to upload (the weights' index, if any, last)."""
    from ballast.training.checkpoint.export import MAX_SHARD_BYTES, export

    done = export(src, dest, max_shard_bytes=max_shard_bytes or MAX_SHARD_BYTES, metadata=metadata,
                  model_section=model_section)
    return {name: sha256_file(dest / name) for name in ([done.config] if done.config else []) + done.files}


def _tokenizer(ctx: RunContext, conv) -> tuple[dict | None, bytes | None]:
    """A language model's tokenizer, as the card names it, and the bytes to publish as tokenizer.json:
    the built-in bytes vocabulary (no file), or the tokenizer file the dataset was tokenized with, read
    (from storage or its path, as conversion read it) and checked against the sha256 the dataset's
    manifest records. Called before anything is uploaded: a file that cannot be read or is not the one
    the data was tokenized with is a DataError, and nothing of the model is published."""
    from ballast.data.text import tokenizer_bytes
    from ballast.errors import BallastError, DataError

    if ctx.spec.training.task != "causal_lm":
        return None, None
    manifest_key = f"{conv.prefix}/manifest.json"
    manifest = json.loads(ctx.storage.read_bytes(manifest_key))
    info = dict(manifest.get("tokenizer") or {})
    info.pop("token_bytes", None)
    tok = ctx.spec.dataset.tokenizer
    if tok is None or not getattr(tok, "file", None):
        return info, None
    where = ctx.storage.describe(manifest_key)
    want = info.get("sha256")
    if info.get("kind") != "file" or not isinstance(want, str):
        raise DataError(f"{where}: tokenizer records no sha256 of a tokenizer file (kind {info.get('kind')!r}), but"
                        f" dataset.tokenizer.file is {tok.file!r}: the data was not tokenized with that file;"
                        f" run the pipeline again so that conversion tokenizes it with that file")
    try:
        data, source = tokenizer_bytes(ctx, tok.file)
    except (BallastError, OSError) as exc:
        raise DataError(f"dataset.tokenizer.file: {tok.file!r} cannot be read to publish it beside the model"
                        f" ({str(exc).splitlines()[0][:300]}); restore the tokenizer file the data was tokenized"
                        f" with (sha256 {want}) there, then publish again") from exc
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise DataError(f"dataset.tokenizer.file: {source} has sha256 {got}, but the data was tokenized with a file"
                        f" of sha256 {want} ({where}): it changed since conversion, and the model must not be"
                        f" published with another tokenizer; restore the file the data was tokenized with, or run"
                        f" the pipeline again to convert and train with this one")
    info.update(file=TOKENIZER, source_key=tok.file)
    return info, data


def _weights_file(ctx: RunContext, prefix: str) -> str:
    """The weights' file name of an earlier published version (model.pt before safetensors)."""
    try:
        return json.loads(ctx.storage.read_bytes(f"{prefix}/model_card.json")).get("weights_file", "model.pt")
    except (OSError, ValueError):
        return WEIGHTS


def run(ctx: RunContext) -> PublishResult:
    spec = ctx.spec
    ev = ctx.result("evaluate")
    train = ctx.result("train")
    conv = ctx.result("convert")
    ver = ctx.result("verify_checkpoint")
    version = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + safe_run_id(ctx.run_id)[-12:]
    prefix = f"models/{spec.name}/{version}"
    best = Path(ev.checkpoint)
    from ballast.training import checkpoint as ckpt  # no torch: the checkpoint package imports it lazily

    recorded = ckpt.recorded_model(best)
    test = ev.scores()
    training = TrainingOutcome(epochs=train.epochs, steps=train.steps, stopped_early=train.stopped_early)
    # The tokenizer first: checked against the data's manifest before the weights are exported or uploaded.
    tokenizer, tokenizer_data = _tokenizer(ctx, conv)
    out = ctx.work_dir / "publish"
    files = to_safetensors(best, out, metadata={"pipeline": spec.name, "version": version},
                           max_shard_bytes=spec.evaluation.publish_shard_bytes, model_section=recorded)
    weights_file = list(files)[-1]  # model.safetensors, or the shards' index (written last)
    config = files.pop(CONFIG, None)  # hf_causal_lm: transformers' config.json beside the weights
    card = {
        "name": spec.name, "version": version, "dag_id": ctx.dag_id, "run_id": ctx.run_id,
        # What the checkpoint records about its model, not the spec (which may have been edited since).
        "task": spec.training.task, "model": recorded, "model_section": recorded,
        "inputs": [f.model_dump() for f in spec.dataset.features],
        "metric": ev.metric, "test": test.model_dump(mode="json"),
        "dataset_id": conv.dataset_id, "data_fingerprint": ctx.result("validate").input_fingerprint,
        "checkpoint": str(best), "checkpoint_step": ver.best.step,
        # Checked by every reader of the published weights (`ballast.storage.models.weights`).
        "weights_file": weights_file, "weights_sha256": files[weights_file],
        # Sharded: every shard's sha256 too (the index's names them; a reader checks each it fetches).
        "weights_shards": {k: v for k, v in files.items() if k != weights_file} or None,
        "transformers_config_sha256": config,
        "tokenizer": tokenizer,
        "training": training.model_dump(mode="json"),
        "spec": spec.model_dump(mode="json"), "published": time.time(),
        "load_with": ("safetensors.torch.load_file('model.safetensors')" if weights_file == WEIGHTS else
                      "safetensors.torch.load_file of each file the weight_map of model.safetensors.index.json"
                      " names, merged") + " -> the state_dict of the model that the entry point `model.name`"
                     " (group ballast.models) builds from model.options and model.data"
                     + ("; or transformers.AutoModelForCausalLM.from_pretrained(<this directory>)" if config else ""),
    }
    attempts = history.load_all(ctx)
    summary = RecoverySummary.of(attempts)
    card["lineage"] = {
        "dataset_id": conv.dataset_id, "raw_fingerprint": ctx.result("validate").input_fingerprint,
        "spec_file": ctx.spec_file, "checkpoint": str(best), "checkpoint_step": ver.best.step,
        "quarantined_checkpoints": ver.quarantined,
        "attempts": [h.model_dump(mode="json") for h in attempts], "recovery": summary.model_dump(mode="json"),
    }
    card["lineage"]["warm_started_from"] = train.warm_started_from
    publish, reason = _beats_published(ctx, ev)
    if publish:
        for name in ([CONFIG] if config else []) + list(files):  # the shards, then their index; PUBLISHED after all
            ctx.storage.upload(out / name, f"{prefix}/{name}")
        if tokenizer_data is not None:  # the bytes checked above, not the file read again
            ctx.storage.write_bytes(f"{prefix}/{TOKENIZER}", tokenizer_data)
        ctx.storage.write_bytes(f"{prefix}/model_card.json", json.dumps(card, indent=2).encode())
        ctx.storage.write_bytes(f"{prefix}/PUBLISHED", f"{version}\n".encode())
        ctx.storage.write_bytes(f"models/{spec.name}/LATEST", f"{version}\n".encode())
    else:
        ctx.log.warning("not published: %s", reason)
        version, prefix = ev.baseline_version, f"models/{spec.name}/{ev.baseline_version}"

    report = RunReport(
        pipeline=spec.name, dag_id=ctx.dag_id, run_id=ctx.run_id, published=publish,
        model=ctx.storage.describe(f"{prefix}/{weights_file if publish else _weights_file(ctx, prefix)}"),
        model_card=ctx.storage.describe(f"{prefix}/model_card.json"),
        checkpoints=train.checkpoint_dir, test=test, training=training,
        stages=StageRecords(validate_=ctx.result("validate"), convert=conv, warm_cache=ctx.result("warm_cache"),
                            train=train, verify_checkpoint=ver),
        recovery=summary, attempts=attempts,
    )
    report_key = ctx.report_key
    ctx.storage.write_bytes(report_key, report.model_dump_json(indent=2).encode())
    if publish:
        ctx.log.info("published %s: test %s %.4f%s", ctx.storage.describe(prefix), ev.metric, ev.value,
                     f" ({reason})" if reason else "")
    return PublishResult(published_version=version, model=report.model, model_card=report.model_card,
                         report=ctx.storage.describe(report_key), checkpoints=train.checkpoint_dir,
                         metric=ev.metric, value=ev.value, published=publish, reason=reason)


def _beats_published(ctx: RunContext, ev) -> tuple[bool, str | None]:
    """(publish?, why) under evaluation.publish; `always` publishes without a reason."""
    from ballast.training.scores import improved

    spec_ev = ctx.spec.evaluation
    if spec_ev.publish != "if_better":
        return True, None
    if ev.baseline is None:  # none published, or none the evaluate task could compare with (its log says why)
        first = not ctx.storage.exists(f"models/{ctx.spec.name}/LATEST")
        return True, ("the first published model of the pipeline" if first else
                      "no published model to compare with: the evaluate task's log says why")
    better = improved(ev.value, ev.baseline.value, mode=spec_ev.mode, min_delta=spec_ev.min_delta)
    verb = "beats" if better else "does not beat"
    return better, (f"test {ev.metric} {ev.value:.4f} {verb} the published model {ev.baseline_version}"
                    f" ({ev.baseline.value:.4f}) on the same {ev.test_rows} test rows (evaluation.publish: if_better)")

