"""The whole spec: its sections, and the checks that tie one section to another."""

from __future__ import annotations

from typing import Literal

from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from ballast.spec.conversion import NAME_PATTERN, CacheSpec, ConversionSpec
from ballast.spec.dataset import DatasetSpec
from ballast.spec.deployment import ScheduleSpec, StorageSpec
from ballast.spec.execution import ExecutionSpec
from ballast.spec.notifications import NotificationsSpec
from ballast.spec.overrides import resolve_field
from ballast.spec.recovery import RecoverySpec
from ballast.spec.training import EvaluationSpec, TrainingSpec
from ballast.spec.validation import TEXT_RULES, ValidationSpec
from ballast.training.config.sections import Section, resolve_early_stop
from ballast.training.tasks import DEFAULT_TASK, metric_of

SPEC_VERSION = 1


class Spec(Section):
    version: Literal[1] = SPEC_VERSION
    """Spec format version."""
    name: str = Field(pattern=NAME_PATTERN)
    """Pipeline name; the DAG id is `ballast_<name>`."""
    description: str = ""
    """Shown on the DAG page."""
    owner: str = "ballast"
    """DAG owner."""
    tags: tuple[str, ...] = ()
    """DAG tags (`ballast` is always added)."""
    dataset: DatasetSpec
    validation: ValidationSpec = ValidationSpec()
    conversion: ConversionSpec = ConversionSpec()
    cache: CacheSpec = CacheSpec()
    training: TrainingSpec
    recovery: RecoverySpec = RecoverySpec()
    evaluation: EvaluationSpec = EvaluationSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    storage: StorageSpec = StorageSpec()
    execution: ExecutionSpec = ExecutionSpec()
    notifications: NotificationsSpec = NotificationsSpec()
    """Who hears of a failed or retried task: a webhook (HTTP connection), email (SMTP connection)."""
    overridable: tuple[str, ...] = ()
    """Dotted field paths (e.g. training.learning_rate) a person may change when triggering a run.
    Each becomes a run parameter named after its last part."""

    @property
    def dag_id(self) -> str:
        return f"ballast_{self.name}"

    @property
    def train_format(self) -> str:
        """The converted format training reads."""
        return self.training.data_format or self.conversion.formats[0]

    @model_validator(mode="before")
    @classmethod
    def _resolve_metric(cls, data: Any) -> Any:
        """evaluation.metric defaults to the task's metric, evaluation.mode to the metric's direction."""
        if not isinstance(data, dict):
            return data
        training = data.get("training")
        task = training.get("task", DEFAULT_TASK) if isinstance(training, dict) else DEFAULT_TASK
        return {**data, "evaluation": resolve_early_stop(data.get("evaluation"), task)}

    @model_validator(mode="after")
    def _check_task(self) -> Spec:
        """What the task needs of the dataset (CONTRACT 1), one located line per mismatch."""
        problems = task_problems(self)
        try:
            metric_of(self.training.task, self.evaluation.metric)
        except ValueError as exc:
            problems.append((("evaluation", "metric"), str(exc)))
        if self.evaluation.metric == "bits_per_byte" and self.dataset.text is None:
            problems.append((("evaluation", "metric"), "bits_per_byte needs the bytes each token stands for, which only"
                                                       " a text dataset's tokenizer gives (dataset.text); use loss or"
                                                       " perplexity for pre-tokenized ids"))
        if problems:
            raise ValidationError.from_exception_data("Spec", [
                InitErrorDetails(type=PydanticCustomError("value_error", "{error}", {"error": msg}), loc=loc,
                                 input=None) for loc, msg in problems])
        return self

    @model_validator(mode="after")
    def _check_cross(self) -> Spec:
        names = {f.name for f in self.dataset.fields}
        for i, rule in enumerate(self.validation.rules):
            if rule.column is not None and rule.column not in names:
                raise ValueError(f"validation.rules[{i}].column: {rule.column!r} is not a dataset field"
                                 f" ({', '.join(sorted(names))})")
            if rule.kind in TEXT_RULES and rule.column != self.dataset.text:
                raise ValueError(f"validation.rules[{i}].column: rule {rule.kind!r} checks the text column"
                                 f" (dataset.text: {self.dataset.text!r}), not {rule.column!r}")
        fmt = self.training.data_format
        if fmt is not None and fmt not in self.conversion.formats:
            raise ValueError(f"training.data_format: {fmt!r} is not among conversion.formats"
                             f" ({', '.join(self.conversion.formats)}); add it there or pick one of those")
        tries = self.recovery.ceiling + 1
        for i, fault in enumerate(self.training.rehearsal.faults):
            if fault.on_try is not None and fault.on_try > tries:
                raise ValueError(f"training.rehearsal.faults[{i}].on_try: try {fault.on_try} never comes: the train"
                                 f" task has at most {tries} tries (recovery.retries / the policy's budgets)")
        gpus = self.execution.gpus_per_node
        if gpus and gpus != self.training.processes_per_node:
            raise ValueError(f"training.processes_per_node: {self.training.processes_per_node} processes per node"
                             f" but execution.{self.execution.backend}.gpus_per_node is {gpus}; one process per GPU:"
                             f" set processes_per_node: {gpus}")
        backend, s3 = self.execution.backend, self.storage.uri.startswith("s3://")
        if backend == "local" and self.training.nodes > 1:
            raise ValueError(f"training.nodes: {self.training.nodes} nodes, but execution.backend local trains on the"
                             f" Airflow worker alone (the try would wait in rendezvous for nodes that never come);"
                             f" set nodes: 1, or backend slurm or kubernetes")
        if backend == "kubernetes" and not s3 and self.execution.kubernetes.storage_claim is None:
            raise ValueError(f"execution.kubernetes.storage_claim: storage.uri is a path ({self.storage.uri!r}) that"
                             f" training pods cannot see; name a ReadWriteMany PersistentVolumeClaim holding it, or"
                             f" use s3:// storage")
        leaves: dict[str, str] = {}
        for path in self.overridable:
            resolve_field(path, Spec)  # raises ValueError naming the path
            leaf = path.rsplit(".", 1)[-1]
            if leaf in leaves:
                raise ValueError(f"overridable: {path!r} and {leaves[leaf]!r} would both be parameter {leaf!r}")
            leaves[leaf] = path
        return self


_INTEGER = ("int32", "int64", "uint8")
_FLOAT = ("float32", "float64")


def task_problems(spec: Spec) -> list[tuple[tuple[str, ...], str]]:
    """(location, message) for each way the dataset does not fit `training.task`."""
    task, ds = spec.training.task, spec.dataset
    label, text = ds.label_field, ds.text_field
    out: list[tuple[tuple[str, ...], str]] = []
    if task == "causal_lm":
        if label is not None:
            out.append((("dataset", "label"), f"task causal_lm has no label (the targets are the next tokens); remove"
                                              f" label {ds.label!r}"))
        if text is None:
            ids = [f for f in ds.features if f.type in _INTEGER and len(f.shape) == 1]
            if len(ds.features) != 1 or len(ids) != 1:
                out.append((("dataset", "text"), "task causal_lm needs `text` naming a string field (tokenized by the"
                                                 " pipeline), or exactly one integer array field of token ids"
                                                 f" (got fields {', '.join(f.name for f in ds.fields)})"))
        if ds.num_classes is not None:
            out.append((("dataset", "num_classes"), "task causal_lm predicts tokens, not classes; remove num_classes"))
        return out
    if text is not None:
        out.append((("dataset", "text"), f"only task causal_lm reads a text column (the task is {task}); remove text,"
                                         f" or set training.task: causal_lm"))
    if not ds.features:
        out.append((("dataset", "fields"), f"task {task} needs at least one feature field besides the label"))
    if label is None:
        out.append((("dataset", "label"), f"task {task} needs a label field"))
    wants_classes = task in ("classification", "segmentation")
    if wants_classes and ds.num_classes is None:
        out.append((("dataset", "num_classes"), f"task {task} needs num_classes (labels lie in [0, num_classes))"))
    if not wants_classes and ds.num_classes is not None:
        out.append((("dataset", "num_classes"), f"task {task} predicts values, not classes; remove num_classes"))
    if label is None or not ds.features:
        return out
    got = f"got {label.type} {list(label.shape)}"
    if task == "classification" and (label.type not in _INTEGER or label.shape):
        out.append((("dataset", "label"), f"task classification needs a scalar integer label; field {label.name!r}"
                                          f" is not ({got})"))
    elif task == "segmentation":
        feature = ds.features[0]
        shape = list(feature.shape)
        spatial = [shape, shape[:-1]] if len(shape) in (3, 4) else [shape]
        spatial = [s for s in spatial if len(s) in (2, 3)]
        if label.type not in _INTEGER:
            out.append((("dataset", "label"), f"task segmentation needs an integer label mask; field {label.name!r}"
                                              f" is not ({got})"))
        elif list(label.shape) not in spatial:
            want = " or ".join(str(s) for s in spatial) or "[H, W] or [D, H, W]"
            out.append((("dataset", "label"), f"task segmentation needs a label of the feature {feature.name!r}'s"
                                              f" spatial shape {want} (feature {shape}); {got}"))
    elif task == "regression" and label.type not in _FLOAT:
        out.append((("dataset", "label"), f"task regression needs a float label (float32 or float64, scalar or array);"
                                          f" field {label.name!r} is not ({got})"))
    return out
