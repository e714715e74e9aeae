"""The Ballast spec: one YAML file parsed once into a typed, frozen model.

No Airflow, no I/O beyond reading the file, no heavy imports: this package runs at DAG-parse time.
One module per section (`dataset`, `validation`, `conversion` with the cache, `training` with evaluation,
`recovery`, `deployment` for schedule and storage, `execution`), the whole in `root`, run parameters
in `overrides`, one-line messages in `messages`, file reading in `loading`. Every setting a training
process also reads is declared once, in `training.config.sections`, and composed here. Unknown keys
are rejected; every problem is reported as ``FILE:LINE: field.path: what is wrong (got VALUE); fix``.
"""

from __future__ import annotations

from typing import Any

from ballast.spec.conversion import CacheSpec, CachePhaseSpec, ConversionSpec
from ballast.spec.dataset import DatasetSpec, FieldSpec, SplitSpec
from ballast.spec.deployment import ScheduleSpec, StorageSpec
from ballast.spec.execution import ExecutionSpec, KubernetesSpec, SlurmSpec
from ballast.spec.loading import json_schema, load_spec, parse_spec
from ballast.spec.overrides import apply_overrides, check_parameter_names, get_path, parameter_paths
from ballast.spec.root import SPEC_VERSION, Spec
from ballast.spec.recovery import RecoverySpec
from ballast.spec.training import EvaluationSpec, TrainingSpec
from ballast.spec.validation import RuleSpec, ValidationSpec


def overridable_field(path: str) -> tuple[Any, str]:
    """(owning model class, field name) of a dotted spec path; ValueError if it cannot be a parameter."""
    from ballast.spec.overrides import resolve_field

    return resolve_field(path, Spec)


__all__ = [
    "SPEC_VERSION", "CacheSpec", "CachePhaseSpec", "ConversionSpec", "DatasetSpec", "EvaluationSpec",
    "ExecutionSpec", "FieldSpec", "KubernetesSpec", "RecoverySpec", "RuleSpec", "ScheduleSpec", "SlurmSpec", "Spec",
    "SplitSpec", "StorageSpec", "TrainingSpec", "ValidationSpec", "apply_overrides", "check_parameter_names",
    "get_path", "json_schema", "load_spec", "overridable_field", "parameter_paths", "parse_spec",
]
