"""Stage 6: score the best checkpoint on the held-out test split and gate publishing.

Early stopping already happened inside training (validation split, `evaluation.patience`); this stage
measures the chosen model on rows training never saw, with the trainer's own task metrics and
comparison (training.tasks.ops, training.scores), on the model the checkpoint records
(verify_checkpoint.load_model). The record holds every metric of the task by name. Below
`evaluation.threshold` the run fails without retrying and nothing is published.

The test split streams from the node-local cache in batches of `evaluation.batch_size` rows
(training.dataset.reader.iter_split, a block read at a time), and each model's summable metric parts
(TaskOps.parts) add up batch by batch: the scores equal those of the split scored whole, and memory
holds a block and a batch, whatever the split's size; the rows scored are reported as the work goes
(done, total, rate, ETA) in the task log. With `evaluation.publish: if_better` the
published model is scored in the same pass, side by side. A model whose weights are larger than this
process may hold runs with its blocks read as they run (training.checkpoint.streamed): slower, not
out of memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ballast.pipeline.context import RunContext
from ballast.errors import ConfigError, QualityGateError
from ballast.records import EvaluateResult, HeldOutScores
from ballast.stages.verify_checkpoint import load_model, recorded_section


def task_of(section: Any, cache_dir: str) -> Any:
    """The recorded model's task (training.tasks.ops.TaskOps), with the dataset tokenizer's byte lengths."""
    from ballast.training.tasks import ops as task_ops

    manifest = json.loads((Path(cache_dir) / "manifest.json").read_text())
    return task_ops.TaskOps(section.task, num_classes=section.data.get("num_classes"),
                            token_bytes=(manifest.get("tokenizer") or {}).get("token_bytes"))


@dataclass
class Tally:
    """What scoring one model on a split adds up, batch by batch: the task's summable metric parts, and
    (classification) per label the rows seen and the rows predicted right."""

    parts: list[float]
    seen: list[int] = field(default_factory=list)
    right: list[int] = field(default_factory=list)

    def add(self, task: Any, output: Any, target: Any, per_class: bool) -> None:
        """One batch's output against its target."""
        import torch

        from ballast.training.tasks import ops as task_ops

        self.parts = [a + b for a, b in zip(self.parts, task.parts(output, target))]
        if per_class:
            logits = task_ops.logits_of(output)
            width = int(logits.shape[1])
            hit = target[logits.argmax(1) == target]
            self.seen = _summed(self.seen, torch.bincount(target, minlength=width).tolist())
            self.right = _summed(self.right, torch.bincount(hit, minlength=width).tolist())

    def per_class_accuracy(self, digits: int = 4) -> dict[int, float]:
        """Accuracy within each label present (ops.per_class_accuracy's figures, from counts)."""
        return {c: round(r / n, digits) for c, (n, r) in enumerate(zip(self.seen, self.right)) if n}


def _summed(a: list[int], b: list[int]) -> list[int]:
    """Two count vectors added, the shorter padded with zeros."""
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


def score_batches(models: list[Any], task: Any, batches: Iterable[Any], *, per_class: bool = False,
                  progress: Any = None) -> list[Tally]:
    """Each model's tally over the batches of a split (reader.Split each, as iter_split yields them):
    one forward pass per model and batch, under no_grad; the task's metrics are `task.scores(t.parts)`.
    `progress` (ballast.data.progress.Progress) counts the rows scored."""
    import torch

    from ballast.training.tasks import ops as task_ops

    tallies = [Tally(task.empty_parts()) for _ in models]
    for model in models:
        model.eval()
    with torch.no_grad():
        for batch in batches:
            x, y = task.prepare(task_ops.as_tensors(batch.features), task_ops.as_tensors(batch.labels))
            for model, tally in zip(models, tallies):
                tally.add(task, model(x), y, per_class)
            if progress is not None:
                progress.add(len(batch))
    return tallies


def _published(ctx: RunContext, budget: int) -> tuple[Any, Any]:
    """The last published model and its registry entry (evaluation.publish: if_better), or (None, None).

    Only the model this spec trains is a baseline: a card whose model section is out of the spec's bounds
    or names another model (name, options, or the data the spec and this run's dataset decide: shapes,
    classes, seq_len, vocab_size) gets one warning naming what differs, and neither its weights are
    fetched nor a model built from it; this model is then published as when none was."""
    from ballast.stages.train import dataset_manifest, run_config_model
    from ballast.storage import models as registry

    published = registry.latest(ctx)
    if published is None:
        ctx.log.info("evaluation.publish if_better: no model published yet; this one will be the first")
        return None, None
    ours = run_config_model(ctx, dataset_manifest(ctx.result("warm_cache").cache_dir))
    problem = registry.model_mismatch(published, ours)
    if problem is not None:
        ctx.log.warning("evaluation.publish if_better: %s: %s; the published model %s is no baseline for this"
                        " run, which is published as if none were (the spec's model changed since, or the card was"
                        " edited; to compare, train the published model's architecture)",
                        ctx.storage.describe(f"{published.prefix}/model_card.json"), problem, published.version)
        return None, None
    return registry.load(registry.weights(ctx, published, ctx.work_dir / "baseline"), published.model_section,
                         budget=budget, log=ctx.log.info), published


def run(ctx: RunContext) -> EvaluateResult:
    from ballast.training import checkpoint as ckpt
    from ballast.training.checkpoint import streamed
    from ballast.data.progress import Progress
    from ballast.training.dataset.format import blocks_of, read_manifest
    from ballast.training.dataset.reader import iter_split
    from ballast.training.scores import reaches

    spec = ctx.spec
    ev = spec.evaluation
    best = Path(ctx.result("verify_checkpoint").best.path)
    cache = ctx.result("warm_cache")
    # The weights held here: whole where they fit this process's budget, else streamed block by block as
    # the model runs (training.checkpoint.streamed); a baseline to score beside it takes half.
    budget = streamed.memory_budget() // (2 if ev.publish == "if_better" else 1)
    model = load_model(best, budget=budget, log=ctx.log.info)  # a damaged file: a CheckpointFailure, no retry
    task = task_of(recorded_section(best), cache.cache_dir)
    if ev.metric not in task.metrics:
        raise ConfigError(f"evaluation.metric: {ev.metric!r} is not computed for this dataset (task {task.task}"
                          f" reports {', '.join(task.metrics)} here); choose one of those")
    baseline_model, published = _published(ctx, budget) if ev.publish == "if_better" else (None, None)
    batches = iter_split(Path(cache.cache_dir), "test", fmt=cache.format, batch_rows=ev.batch_size,
                         num_classes=spec.dataset.num_classes)
    models = [model] if baseline_model is None else [model, baseline_model]
    total = sum(b.rows for b in blocks_of(read_manifest(Path(cache.cache_dir)), "test", cache.format))
    progress = Progress(ctx.log, "evaluate", total)  # in the task log, every few seconds and at the end
    tallies = score_batches(models, task, batches, per_class=task.task == "classification", progress=progress)
    scores = task.scores(tallies[0].parts)
    rows = int(scores["samples"])
    value = scores[ev.metric]
    baseline = None
    if published is not None:
        theirs = task.scores(tallies[1].parts)
        ctx.log.info("published model %s on the same test split: %s = %.4f", published.version, ev.metric,
                     theirs[ev.metric])
        baseline = HeldOutScores.of(task=task.task, metric=ev.metric, scores=theirs, test_rows=rows)
    history = ckpt.read_trainer_state(best)["history"]
    ok = None if ev.threshold is None else reaches(value, ev.threshold, mode=ev.mode)
    held_out = HeldOutScores.of(task=task.task, metric=ev.metric, scores=scores, test_rows=rows)
    result = EvaluateResult(**held_out.model_dump(), per_class_accuracy=tallies[0].per_class_accuracy(),
                            checkpoint=str(best), validation_history=history, threshold=ev.threshold, passed=ok,
                            baseline=baseline, baseline_version=published.version if published else None)
    ctx.log.info("test %s = %.4f on %d held-out rows in batches of %d (checkpoint %s); %s", ev.metric, value, rows,
                 ev.batch_size, best, ", ".join(f"{k} {v:.4f}" for k, v in held_out.metrics.items()))
    if ok is False:
        ctx.save_result("evaluate", result)  # keep the numbers for the report even though we stop here
        raise QualityGateError(f"evaluation.threshold: test {ev.metric} {value:.4f} does not reach"
                               f" {ev.threshold} ({ev.mode}); the model is not published")
    return result
