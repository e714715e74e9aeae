"""Run parameters: which spec fields a person may change when triggering a run, and applying them.

Each path in the spec's `overridable` list becomes a run parameter named after its last part
(`training.learning_rate` -> `learning_rate`). A parameter that is not one of them is refused, naming
the closest allowed one: a typo must never train with the default.
"""

from __future__ import annotations

import collections.abc
import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from ballast.errors import SpecError


AUTHOR_ONLY: dict[str, str] = {
    "version": "the spec's format",
    "name": "the pipeline's identity: its DAG, its run directories, its models",
    "owner": "the pipeline's owner",
    "storage.uri": "where the data, checkpoints and models live",
    "storage.conn_id": "the connection, and so the credentials, storage is reached with",
    "dataset.location": "where the raw data is read",
    "cache.directory": "a directory on the worker and the nodes",
    "cache.max_bytes": "the node-wide cache budget: other pipelines' datasets are evicted to keep it",
    "conversion.spark_master": "where the conversion runs",
    "execution.backend": "where training runs",
    "execution.env": "the training processes' environment",
    "execution.kubernetes": "the pods' image, account, secrets and volumes",
    "execution.slurm": "the job's partitions, account and interpreter",
    "notifications": "who hears of the pipeline, through which connections",
    "training.rehearsal.scheduled": "a rehearsal safeguard",
    "dataset.tokenizer": "the tokenizer file read from storage or the worker's disk",
    "training.model": "the model's code and size: what is built, and how much memory it takes",
}
"""Fields (and sections, with every field below them) no run parameter may change: identity, storage,
locations, directories, the environment, where and as whom training runs, who is notified. Whoever may
trigger a run could otherwise read or write another pipeline's files, or run code of their choosing."""


def _shape(ann: Any) -> str:
    """What a field annotation holds: "section" (a section, optional or not), "mapping", "list", "any"
    (unchecked values) or "scalar" (a single value, optional or not: str, number, bool, enum, Literal)."""
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _shape(typing.get_args(ann)[0])
    if origin is typing.Union or origin is types.UnionType:
        shapes = {_shape(a) for a in typing.get_args(ann) if a is not type(None)}
        return next((s for s in ("section", "mapping", "list", "any") if s in shapes), "scalar")
    if ann is Any:
        return "any"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    kind = origin or ann
    if isinstance(kind, type) and issubclass(kind, collections.abc.Mapping):
        return "mapping"
    if isinstance(kind, type) and issubclass(kind, (list, tuple, set, frozenset)):
        return "list"
    return "scalar"


def resolve_field(path: str, root: type[BaseModel]) -> tuple[type[BaseModel], str]:
    """Resolve a dotted path to (owning model class, field name); only scalar fields qualify, and none
    of AUTHOR_ONLY."""
    for prefix, what in AUTHOR_ONLY.items():
        if path == prefix or path.startswith(prefix + "."):
            raise ValueError(f"overridable: {path!r} is the spec author's alone ({what}); a run parameter cannot"
                             f" change it")
    model: type[BaseModel] = root
    parts = path.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            raise ValueError(f"overridable: {path!r} is not a spec field ({'.'.join(parts[:i + 1])} unknown)")
        ann, shape = field.annotation, _shape(field.annotation)
        if i < len(parts) - 1:
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):  # an optional section's may be absent
                what = "an optional section" if shape == "section" else "not a section"
                raise ValueError(f"overridable: {path!r}: {'.'.join(parts[:i + 1])} is {what}; a run parameter"
                                 f" can change only a field of a section every spec has")
            model = ann
        else:
            if shape == "section":
                raise ValueError(f"overridable: {path!r} is a section; name one of its fields")
            if shape != "scalar":
                what = {"mapping": "a map", "list": "a list", "any": "a value of any shape"}[shape]
                raise ValueError(f"overridable: {path!r} is {what}; only single values can be overridden")
            return model, part
    raise ValueError(f"overridable: empty path {path!r}")


def get_path(spec: BaseModel, path: str) -> Any:
    value: Any = spec
    for part in path.split("."):
        value = getattr(value, part)
    return value


REHEARSAL_PARAMETER = "rehearsal"
"""With rehearsal faults declared, this run parameter switches them on for one run."""


def parameter_paths(spec: Any) -> dict[str, str]:
    """Run parameter name -> the spec field it overrides: the `overridable` paths, named after their
    last part, and `rehearsal` when the spec declares rehearsal faults."""
    paths = {p.rsplit(".", 1)[-1]: p for p in spec.overridable}
    if spec.training.rehearsal.faults:
        paths.setdefault(REHEARSAL_PARAMETER, "training.rehearsal.enabled")
    return paths


def check_parameter_names(spec: Any, names: Any, *, source: str = "run parameters") -> None:
    """Refuse names that are not run parameters of this spec, in one line naming each one, the closest
    allowed name and the allowed list."""
    allowed = sorted(parameter_paths(spec))
    unknown = sorted(set(names) - set(allowed))
    if not unknown:
        return
    more = len(unknown) - 10
    unknown = [n if len(n) <= 60 else n[:57] + "..." for n in unknown[:10]]  # a trigger's conf is anyone's
    if more > 0:
        unknown.append(f"... ({more} more)")
    hints = []
    for name in unknown[:10]:
        close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
        if not close:  # abbreviations such as lr for learning_rate: the initials of the words
            close = [a for a in allowed if "".join(w[0] for w in a.split("_")) == name][:1]
        if close:
            hints.append(f"{name} -> {close[0]}?")
    msg = f"{source}: unknown parameter(s) {', '.join(unknown)}; allowed: {', '.join(allowed) or 'none'}"
    if hints:
        msg += f"; closest: {', '.join(hints)}"
    raise SpecError(msg)


def apply_overrides(spec: Any, overrides: dict[str, Any], *, source: str = "run parameters") -> Any:
    """Return a new spec with `{parameter: value}` overrides applied and validated again."""
    from ballast.spec.messages import validation_error

    check_parameter_names(spec, overrides, source=source)
    by_name = parameter_paths(spec)
    data = spec.model_dump(mode="json")
    for name, value in overrides.items():
        *head, last = by_name[name].split(".")
        node = data
        for part in head:
            node = node[part]
        node[last] = value
    paths = {by_name[name] for name in overrides}
    if "evaluation.metric" in paths and "evaluation.mode" not in paths:
        data["evaluation"]["mode"] = None  # the new metric's own direction (Spec resolves it)
    try:
        return type(spec).model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, type(spec), source=source, text=None) from None
