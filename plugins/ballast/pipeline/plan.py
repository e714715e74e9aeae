"""Plan: the spec turned into plain data (stages, their order and settings, run parameters).

No Airflow here; the renderer (`ballast.airflow.dags`) turns a Plan into a DAG, and tests can check a Plan
without Airflow at all.
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass, field
from typing import Any

from ballast.spec import Spec, get_path, overridable_field, parameter_paths

# The stages every pipeline runs, in order, with what each waits for. Each is the module
# ballast.stages.<name>. Training starts once the cache's first warm-up phase is in; the train task
# warms the later phases in the background on the same node while torchrun runs (the trainer waits
# for any shard not there yet).
UPSTREAM: dict[str, tuple[str, ...]] = {
    "validate": (),
    "convert": ("validate",),
    "warm_cache": ("convert",),
    "train": ("warm_cache",),
    "verify_checkpoint": ("train",),
    "evaluate": ("verify_checkpoint",),
    "publish": ("evaluate",),
}
STAGES: tuple[str, ...] = tuple(UPSTREAM)
STAGE_MODULES: tuple[str, ...] = (*STAGES, "evaluate_round")
"""Every module of ballast.stages a task runs (a round's evaluate is evaluate_round)."""

# Stages whose failures are about the input, not the machine: retrying cannot help.
NO_RETRY = frozenset({"validate"})


ROUND_STAGES = ("train", "verify_checkpoint", "evaluate")
"""With training.rounds > 1, these run once per round, in a TaskGroup `round_<k>`; a round's `evaluate`
scores the validation split and decides early stopping (module ballast.stages.evaluate_round)."""


@dataclass(frozen=True)
class StagePlan:
    name: str
    """The task id (`round_2.train` inside a round's group)."""
    upstream: tuple[str, ...]
    retries: int
    doc: str
    module: str = ""
    """ballast.stages.<module> runs it (default: the stage's name)."""
    group: str | None = None
    """The TaskGroup it belongs to (a round), if any."""
    trigger_rule: str = "all_success"

    @property
    def local_name(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class ParamPlan:
    key: str
    """Parameter name in the trigger form and in `conf`."""
    path: str
    """Spec field it overrides."""
    default: Any
    schema: dict[str, Any]
    """JSON-schema keywords for airflow.sdk.Param (type, minimum, maximum, enum, ...)."""
    description: str
    title: str


@dataclass(frozen=True)
class Plan:
    dag_id: str
    spec_file: str
    spec_data: dict[str, Any]
    description: str
    owner: str
    tags: tuple[str, ...]
    cron: str | None
    asset: str | None
    start_date: dt.date
    catchup: bool
    retries: int
    retry_delay_seconds: float
    stages: tuple[StagePlan, ...]
    params: tuple[ParamPlan, ...] = field(default=())


_DOCS = {
    "validate": "Check the raw data with Great Expectations before anything trusts it.",
    "convert": "Write Petastorm (Parquet) and TFRecord shards with a manifest of sizes and sha256.",
    "warm_cache": "Copy what training needs first to the node-local cache, each file verified against the manifest.",
    "train": "Run distributed training with torchrun (the rest of the cache warms beside it); resume from the latest committed checkpoint.",
    "verify_checkpoint": "Check the final checkpoint's manifest, hashes and tensors before anyone uses it.",
    "evaluate": "Score the best checkpoint on the held-out test split; gate publishing on the threshold.",
    "publish": "Write the model, its card and the run report to storage, atomically.",
}


def build_plan(spec: Spec, *, spec_file: str) -> Plan:
    retries = spec.recovery.ceiling
    rounds = spec.training.rounds
    stages = []
    for name in STAGES:
        if rounds > 1 and name in ROUND_STAGES:
            continue
        stages.append(StagePlan(name=name, upstream=UPSTREAM[name], retries=0 if name in NO_RETRY else (
            retries if name == "train" else spec.recovery.stage_ceiling),
                                doc=_DOCS[name], module=name))
    if rounds > 1:
        stages = _with_rounds(stages, rounds, retries, spec.training.epochs_per_round, spec.recovery.stage_ceiling)
    tags = tuple(dict.fromkeys(("ballast", *spec.tags)))
    return Plan(
        dag_id=spec.dag_id,
        spec_file=spec_file,
        spec_data=spec.model_dump(mode="json"),
        description=spec.description or f"Ballast pipeline {spec.name}",
        owner=spec.owner,
        tags=tags,
        cron=spec.schedule.cron,
        asset=spec.schedule.asset,
        start_date=spec.schedule.start_date,
        catchup=spec.schedule.catchup,
        retries=spec.recovery.stage_ceiling,
        retry_delay_seconds=spec.recovery.retry_delay_seconds,
        stages=tuple(stages),
        params=tuple(_param(spec, key, path) for key, path in parameter_paths(spec).items()),
    )


def _with_rounds(stages: list[StagePlan], rounds: int, retries: int, epochs: int, others: int) -> list[StagePlan]:
    """One train -> verify_checkpoint -> evaluate group per round after warm_cache; the test-split
    evaluate after all of them (it runs when at least one round finished and none failed: the rounds
    early stopping skipped do not hold it back); publish last."""
    head = [s for s in stages if s.name in ("validate", "convert", "warm_cache")]
    rounds_plan: list[StagePlan] = []
    before = "warm_cache"
    for k in range(1, rounds + 1):
        group = f"round_{k}"
        for name in ROUND_STAGES:
            doc = {"train": f"Round {k} of {rounds}: train {epochs} more epochs from round {k - 1}'s verified"
                            f" checkpoint (skipped once early stopping has ended training).",
                   "verify_checkpoint": _DOCS["verify_checkpoint"],
                   "evaluate": "Score the round's checkpoint on the validation split; decide early stopping."}[name]
            rounds_plan.append(StagePlan(name=f"{group}.{name}", upstream=(before,),
                                         retries=retries if name == "train" else others, doc=doc,
                                         module="evaluate_round" if name == "evaluate" else name, group=group))
            before = f"{group}.{name}"
    last_evals = tuple(f"round_{k}.evaluate" for k in range(1, rounds + 1))
    tail = [StagePlan(name="evaluate", upstream=last_evals, retries=others, doc=_DOCS["evaluate"], module="evaluate",
                      trigger_rule="none_failed_min_one_success"),
            StagePlan(name="publish", upstream=("evaluate",), retries=others, doc=_DOCS["publish"], module="publish")]
    return head + rounds_plan + tail


_KEYWORDS = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum", "minLength",
             "maxLength", "pattern")


@functools.cache
def _properties(model: type) -> dict[str, Any]:
    # Generating a JSON schema is slow; models are fixed classes, so once per class is enough.
    return model.model_json_schema()["properties"]


def _param(spec: Spec, key: str, path: str) -> ParamPlan:
    model, name = overridable_field(path)
    prop = dict(_properties(model)[name])
    if "anyOf" in prop:  # `X | None` -> type [x, "null"]
        variants = prop.pop("anyOf")
        prop["type"] = [v.get("type") for v in variants if v.get("type")]
        for v in variants:
            prop.update({k: v[k] for k in _KEYWORDS if k in v and k != "type"})
    if "const" in prop:
        prop["enum"] = [prop.pop("const")]
    schema = {k: prop[k] for k in _KEYWORDS if k in prop}
    section = path.split(".")[0]
    return ParamPlan(
        key=key,
        path=path,
        default=get_path(spec, path),
        schema=schema,
        description=(prop.get("description") or "").replace("\n", " "),
        title=f"{section}: {name.replace('_', ' ')}",
    )
