"""The torch side of a task: its loss, the summable parts of its metrics, its scores, and how a batch
becomes the model's inputs and the loss's targets.

Metrics are computed from parts that add up over batches and ranks (one all-reduce of a float list),
so a score means the same on one rank and on many, and in the validation history and the test report.
The formulas are in `ballast.training.tasks` (CONTRACT 2): perplexity = exp(mean token loss);
bits_per_byte = token losses in nats / ln 2 / the UTF-8 bytes the scored tokens stand for; mean_iou
and dice average over the classes present in prediction or target; rmse and mae over all elements.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from ballast.training.tasks import METRICS, TASKS

Batch = Any
"""A tensor (one feature) or a dict of tensors by field name (several)."""


def rows(x: Batch) -> int:
    """Samples in a batch of inputs."""
    return len(next(iter(x.values()))) if isinstance(x, dict) else len(x)


def take(x: Batch, start: int, stop: int) -> Batch:
    """Rows [start, stop) of a tensor, an array, a dict of either, or None."""
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: v[start:stop] for k, v in x.items()}
    return x[start:stop]


def to_device(x: Batch, device: Any) -> Batch:
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: v.to(device, non_blocking=True) for k, v in x.items()}
    return x.to(device, non_blocking=True)


def as_tensors(x: Any) -> Batch:
    """numpy arrays (or a dict of them) as tensors, without copying what can be shared (a read-only
    array, e.g. one over an Arrow buffer, is copied: a tensor may be written to)."""
    import numpy as np
    import torch

    def one(a: Any) -> Any:
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a if a.flags.writeable else a.copy())

    if x is None:
        return None
    if isinstance(x, dict):
        return {k: one(v) for k, v in x.items()}
    return one(x)


def micro_batches(x: Batch, y: Any, size: int, count: int) -> Iterator[tuple[Batch, Any]]:
    """`count` slices of `size` rows of (inputs, target)."""
    for i in range(count):
        yield take(x, i * size, (i + 1) * size), take(y, i * size, (i + 1) * size)


def logits_of(output: Any) -> Any:
    """A model's output tensor: a Hugging Face model's output object carries it as `.logits`."""
    return output.logits if hasattr(output, "logits") else output


class TaskOps:
    """A task's loss and metrics. `num_classes` for classification and segmentation; `token_bytes` (the
    UTF-8 bytes each token id stands for, from the dataset's tokenizer) for causal_lm's bits_per_byte."""

    def __init__(self, task: str, *, num_classes: int | None = None, token_bytes: list[int] | None = None):
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
        self.task, self.num_classes = task, num_classes
        if task == "segmentation" and not num_classes:
            raise ValueError("task segmentation needs num_classes")
        self._token_bytes_list = token_bytes
        self._token_bytes = None

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics `scores` returns (bits_per_byte only where the tokenizer's byte lengths are known)."""
        names = METRICS[self.task]
        return tuple(m for m in names if m != "bits_per_byte" or self._token_bytes_list is not None)

    # -- a batch -> (inputs, target) ---------------------------------------------------------------

    def prepare(self, inputs: Batch, target: Any) -> tuple[Batch, Any]:
        """The model's inputs and the loss's target from a batch as the loader yields it: causal_lm cuts
        each sequence of seq_len + 1 tokens into tokens[:, :-1] (inputs) and tokens[:, 1:] (targets)."""
        if self.task != "causal_lm":
            return inputs, target
        tokens = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs
        tokens = tokens.long()
        return tokens[:, :-1], tokens[:, 1:]

    def _fit(self, output: Any, target: Any) -> Any:
        """Regression: (N, 1) for a scalar target, or any output with the target's element count, as the
        target's shape."""
        if output.shape != target.shape and output.numel() == target.numel():
            return output.reshape(target.shape)
        return output

    # -- loss --------------------------------------------------------------------------------------

    def loss(self, output: Any, target: Any) -> Any:
        """The mean loss of a batch (what backward runs on)."""
        import torch.nn.functional as F

        out = logits_of(output).float()
        if self.task == "regression":
            return F.mse_loss(self._fit(out, target), target.float())
        if self.task == "causal_lm":
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        return F.cross_entropy(out, target)

    # -- summable parts and scores -----------------------------------------------------------------

    def parts(self, output: Any, target: Any) -> list[float]:
        """The summable metric parts of a batch, in this task's fixed order (`scores` reads them)."""
        import torch
        import torch.nn.functional as F

        out = logits_of(output).float().detach()
        n = float(len(target))
        if self.task == "classification":
            if not len(target):
                return [0.0, 0.0, 0.0]
            loss = F.cross_entropy(out, target, reduction="none").double().sum()
            return [n, float(loss), float((out.argmax(1) == target).sum())]
        if self.task == "causal_lm":
            losses = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), reduction="none")
            nbytes = 0.0
            if self._token_bytes_list is not None:
                if self._token_bytes is None or self._token_bytes.device != target.device:
                    self._token_bytes = torch.tensor(self._token_bytes_list, dtype=torch.float64, device=target.device)
                nbytes = float(self._token_bytes[target.reshape(-1)].sum())
            return [n, float(target.numel()), float(losses.double().sum()), nbytes]
        if self.task == "segmentation":
            c = int(self.num_classes or out.shape[1])
            pred = out.argmax(1).reshape(-1)
            truth = target.reshape(-1)
            inter = torch.bincount(truth[pred == truth], minlength=c)[:c].double()
            predicted = torch.bincount(pred, minlength=c)[:c].double()
            actual = torch.bincount(truth, minlength=c)[:c].double()
            loss = float(F.cross_entropy(out, target, reduction="none").double().sum()) if len(target) else 0.0
            return [n, float(truth.numel()), loss, *inter.tolist(), *predicted.tolist(), *actual.tolist()]
        fitted = self._fit(out, target)
        err = (fitted.double() - target.double())
        return [n, float(target.numel()), float((err * err).sum()), float(err.abs().sum())]

    def empty_parts(self) -> list[float]:
        """The parts of no rows (a rank with nothing to score still takes part in the all-reduce)."""
        width = {"classification": 3, "causal_lm": 4, "regression": 4}.get(self.task)
        return [0.0] * (width if width is not None else 3 + 3 * int(self.num_classes or 0))

    def scores(self, parts: list[float]) -> dict[str, float]:
        """Every metric of the task, and `samples` (rows scored), from summed parts; no rows score 0."""
        n = parts[0]
        if self.task == "classification":
            _, loss, correct = parts
            return {"accuracy": correct / max(n, 1.0), "loss": loss / max(n, 1.0), "samples": n}
        if self.task == "causal_lm":
            _, tokens, loss, nbytes = parts
            mean = loss / max(tokens, 1.0)
            out = {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "samples": n}
            if self._token_bytes_list is not None:
                out["bits_per_byte"] = loss / math.log(2) / max(nbytes, 1.0)
            return out
        if self.task == "segmentation":
            c = (len(parts) - 3) // 3
            pixels, loss = parts[1], parts[2]
            inter, pred, truth = parts[3:3 + c], parts[3 + c:3 + 2 * c], parts[3 + 2 * c:]
            ious = [i / (p + t - i) for i, p, t in zip(inter, pred, truth) if p + t - i > 0]
            dices = [2 * i / (p + t) for i, p, t in zip(inter, pred, truth) if p + t > 0]
            return {"mean_iou": sum(ious) / len(ious) if ious else 0.0,
                    "dice": sum(dices) / len(dices) if dices else 0.0, "loss": loss / max(pixels, 1.0), "samples": n}
        _, elements, sq, ab = parts
        e = max(elements, 1.0)
        return {"rmse": math.sqrt(sq / e), "mae": ab / e, "loss": sq / e, "samples": n}

    def score(self, output: Any, target: Any) -> dict[str, float]:
        """The scores of one batch on its own."""
        return self.scores(self.parts(output, target))


def per_class_accuracy(logits: Any, labels: Any, *, digits: int = 4) -> dict[int, float]:
    """Accuracy within each label present in `labels`, rounded to `digits` (classification)."""
    pred = logits_of(logits).argmax(1)
    return {int(c): round(float((pred[labels == c] == c).float().mean()), digits) for c in labels.unique()}


def split_parts(model: Any, ops: TaskOps, features: Any, labels: Any, *, device: Any, batch: int,
                rank: int = 0, world: int = 1) -> list[float]:
    """The summed metric parts of a model on this rank's share (rows rank, rank + world, ...) of a whole
    split held in numpy arrays (`features` an array or a dict of them; `labels` None for causal_lm),
    scored `batch` rows at a time under no_grad. Every rank runs the same number of forward passes (a
    rank with fewer rows scores its first row again and discards it): a sharded model's forward is a
    collective."""
    import numpy as np
    import torch

    total = rows(features)
    idx = np.arange(rank, total, world)
    batch = max(1, batch)
    passes = math.ceil(math.ceil(total / world) / batch) if total else 0
    summed = ops.empty_parts()
    with torch.no_grad():
        for step in range(passes):
            pick = idx[step * batch:(step + 1) * batch]
            keep = len(pick) > 0
            pick = pick if keep else np.arange(min(1, total))
            x = as_tensors({k: v[pick] for k, v in features.items()} if isinstance(features, dict) else features[pick])
            y = None if labels is None else as_tensors(labels[pick])
            x, y = ops.prepare(to_device(x, device), to_device(y, device))
            output = model(x)
            if keep:
                summed = [a + b for a, b in zip(summed, ops.parts(output, y))]
    return summed
