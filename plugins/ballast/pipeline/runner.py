"""Run one stage inside an Airflow task: apply run parameters, call the stage, record its result.

A failure of the training package that reaches here (`TrainingFailure`, a damaged checkpoint's
included) is translated once into the BallastError family (`ballast.errors.from_training`). Errors of
that family are logged as one line and go back to Airflow, whose retry policy (the stage's
`ballast.recovery.policy.StageRetryPolicy`, the one place that decides) retries or fails the task by
the error's class: a bad spec, data or checkpoint, a bug, a model below the publish threshold fail at
once by default.
"""

from __future__ import annotations

import importlib
import json
import logging
from typing import Any

from ballast.pipeline.context import RunContext
from ballast.errors import BallastError, SpecError, from_training
from ballast.pipeline.plan import STAGE_MODULES, STAGES
from ballast.records import AppliedParameter, EffectiveSpec
from ballast.spec import (apply_overrides, check_parameter_names, get_path, parameter_paths,
                          parse_spec)
from ballast.training.failure import TrainingFailure

log = logging.getLogger("ballast")


def effective_spec(spec_data: dict, spec_file: str, params: Any, *, given: Any = ()) -> Any:
    """The spec with the run's parameters applied. `params` are Airflow's (the DAG's parameters, the
    run's conf merged in); `given` the names the trigger sent (the run's conf). A name that is not one
    of the spec's parameters is refused in one line naming the closest: a typo must not train with the
    default."""
    spec = parse_spec(spec_data, source=spec_file)
    check_parameter_names(spec, {*(params or {}), *given}, source=f"{spec_file} (run parameters)")
    overrides = {k: params[k] for k in parameter_paths(spec) if params is not None and k in params}
    return apply_overrides(spec, overrides, source=f"{spec_file} (with run parameters)") if overrides else spec


def effective_spec_record(base_data: dict, spec: Any, *, spec_file: str, given: dict[str, Any],
                          run_id: str | None = None) -> EffectiveSpec:
    """What spec.json holds: the effective spec and which of the given parameters changed it."""
    base = parse_spec(base_data, source=spec_file)
    applied = {}
    for name, path in parameter_paths(spec).items():
        before, after = get_path(base, path), get_path(spec, path)
        if before != after:
            applied[name] = AppliedParameter(path=path, spec_value=before, value=after)
    return EffectiveSpec(spec_file=spec_file, run_id=run_id, parameters_given=given, parameters_applied=applied,
                         spec=spec.model_dump(mode="json"))


def claim_run_directory(ctx: RunContext) -> None:
    """Refuse a run directory that holds another run's records. Keys are one-to-one with run ids
    (`ballast.pipeline.context.safe_run_id`), but an earlier Ballast wrote `a:b` and `a_b` to one directory: the
    run that now owns that key must not resume from, or overwrite, the other's checkpoints and records."""
    key = f"{ctx.run_key}/spec.json"
    if not ctx.storage.exists(key):
        return
    try:
        owner = json.loads(ctx.storage.read_bytes(key)).get("run_id")
    except (ValueError, AttributeError):
        owner = None
    if owner != ctx.run_id:
        raise BallastError(f"{ctx.storage.describe(key)}: this run's directory holds another run's records"
                           f" ({'run ' + repr(owner) if owner else 'written before run ids were recorded'});"
                           f" trigger the run with another run id, or move that directory away")


def run_stage(stage: str, *, spec_data: dict, spec_file: str, context: dict[str, Any]) -> dict[str, Any]:
    if stage not in STAGE_MODULES:
        raise SpecError(f"unknown stage {stage!r}; stages: {', '.join(STAGE_MODULES)}")
    spec = None
    try:
        given = dict(getattr(context.get("dag_run"), "conf", None) or {})
        spec = effective_spec(spec_data, spec_file, context.get("params"), given=given)
        ti = context.get("ti")
        ctx = RunContext(spec=spec, dag_id=context["dag"].dag_id, run_id=context["run_id"],
                         try_number=getattr(ti, "try_number", 1) or 1, log=logging.getLogger(f"ballast.{stage}"),
                         task_id=getattr(ti, "task_id", None) or stage, state=context.get("task_state_store"),
                         spec_file=spec_file)
        if stage == STAGES[0]:
            claim_run_directory(ctx)
            effective = effective_spec_record(spec_data, spec, spec_file=spec_file, given=given, run_id=ctx.run_id)
            ctx.storage.write_bytes(f"{ctx.run_key}/spec.json", effective.model_dump_json(indent=2).encode())
        module = importlib.import_module(f"ballast.stages.{stage}")
        try:
            record = module.run(ctx)
        except TrainingFailure as exc:
            raise from_training(exc) from exc
        ctx.save_result(stage, record)
        return record.model_dump(mode="json")  # XCom: the record's JSON form
    except BallastError as exc:
        log.error("%s failed: %s", stage, exc)
        raise  # retry or fail: the stage's retry policy decides (ballast.recovery.policy)
