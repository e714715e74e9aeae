"""The whole spec: its sections, and the checks that tie one section to another."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ballast.spec.conversion import NAME_PATTERN, CacheSpec, ConversionSpec
from ballast.spec.dataset import DatasetSpec
from ballast.spec.deployment import ScheduleSpec, StorageSpec
from ballast.spec.execution import ExecutionSpec
from ballast.spec.notifications import NotificationsSpec
from ballast.spec.overrides import resolve_field
from ballast.spec.recovery import RecoverySpec
from ballast.spec.training import EvaluationSpec, TrainingSpec
from ballast.spec.validation import ValidationSpec
from ballast.training.config.sections import Section

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

    @model_validator(mode="after")
    def _check_cross(self) -> Spec:
        names = {f.name for f in self.dataset.fields}
        for i, rule in enumerate(self.validation.rules):
            if rule.column is not None and rule.column not in names:
                raise ValueError(f"validation.rules[{i}].column: {rule.column!r} is not a dataset field"
                                 f" ({', '.join(sorted(names))})")
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
        if backend != "local" and s3 and self.training.nodes > 1:
            raise ValueError(f"storage.uri: a {self.training.nodes}-node try on {backend} commits each checkpoint from"
                             f" every node, which needs storage every node sees as a file system (a path; on"
                             f" Kubernetes with execution.kubernetes.storage_claim); s3:// storage takes one node")
        leaves: dict[str, str] = {}
        for path in self.overridable:
            resolve_field(path, Spec)  # raises ValueError naming the path
            leaf = path.rsplit(".", 1)[-1]
            if leaf in leaves:
                raise ValueError(f"overridable: {path!r} and {leaves[leaf]!r} would both be parameter {leaf!r}")
            leaves[leaf] = path
        return self
