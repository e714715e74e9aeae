"""Render plans into Airflow DAGs. The only layer that imports Airflow at DAG-parse time.

`build_dags(spec_dir)` is what the thin file in dags/ calls. Each good spec becomes one DAG; broken
specs are gathered into one stand-in whose validation fails, so that Airflow shows exactly one import
error for the DAG file, naming each broken spec's file and field, while the good DAGs still load. Any
other error while building one spec's DAG (a bug) is that spec's line in the same import error.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Asset, BaseOperator, Param, TaskGroup

from ballast.errors import SpecError
from ballast.airflow.notify import callbacks
from ballast.pipeline.plan import Plan, build_plan
from ballast.recovery.policy import StageRetryPolicy
from ballast.spec import load_spec

SPEC_SUFFIXES = (".yaml", ".yml")


def spec_files(spec_dir: str | Path) -> list[Path]:
    spec_dir = Path(spec_dir)
    return sorted(p for p in spec_dir.iterdir() if p.suffix in SPEC_SUFFIXES and not p.name.startswith("."))


def build_dags(spec_dir: str | Path) -> dict[str, DAG]:
    """Every spec in spec_dir as a DAG, keyed by dag_id (plus the broken-spec stand-in, if any)."""
    dags: dict[str, DAG] = {}
    problems: list[str] = []
    for path in spec_files(spec_dir):
        try:
            plan = build_plan(load_spec(path), spec_file=str(path))
            if plan.dag_id in dags:
                problems.append(f"{path}: name: {plan.spec_data['name']!r} is already used by another spec"
                                f" ({dags[plan.dag_id].fileloc}); pick a unique name")
                continue
            dags[plan.dag_id] = build_dag(plan)
        except SpecError as exc:
            problems.extend(exc.problems)
        except Exception as exc:  # a bug of ours, not the spec's: still this spec's error alone, not the file's
            problems.append(unexpected(path, exc))
    if problems:
        dags["ballast_broken_specs"] = BrokenSpecs(problems)
    return dags


def unexpected(path: Path, exc: BaseException) -> str:
    """One line for an error no check anticipated while reading or rendering the spec at `path`."""
    detail = " ".join(str(exc).split())
    detail = detail if len(detail) <= 300 else detail[:297] + "..."
    return f"{path}: cannot build its DAG: {type(exc).__name__}: {detail or 'no message'} (a bug of Ballast's)"


def build_dag(plan: Plan) -> DAG:
    schedule: Any = None
    if plan.cron:
        schedule = plan.cron
    elif plan.asset:
        schedule = [Asset(plan.asset)]
    params = {
        p.key: Param(p.default, description=p.description, title=p.title, **p.schema)
        for p in plan.params
    }
    with DAG(
        dag_id=plan.dag_id,
        description=plan.description,
        doc_md=_doc(plan),
        schedule=schedule,
        start_date=dt.datetime.combine(plan.start_date, dt.time(), tzinfo=dt.timezone.utc),
        catchup=plan.catchup,
        tags=list(plan.tags),
        params=params,
        max_active_runs=1,
        default_args={
            "owner": plan.owner,
            "retries": plan.retries,
            "retry_delay": dt.timedelta(seconds=plan.retry_delay_seconds),
        },
    ) as dag:
        tasks: dict[str, StageOperator] = {}
        groups: dict[str, TaskGroup] = {}
        for stage in plan.stages:
            group = None
            if stage.group is not None:
                group = groups.get(stage.group) or groups.setdefault(stage.group, TaskGroup(stage.group))
            tasks[stage.name] = task = StageOperator(
                task_id=stage.local_name,
                task_group=group,
                trigger_rule=stage.trigger_rule,
                stage=stage.module or stage.name,
                spec_data=plan.spec_data,
                spec_file=plan.spec_file,
                retries=stage.retries,
                retry_policy=StageRetryPolicy(plan.spec_data["recovery"], stage.name) if stage.retries else None,
                doc_md=stage.doc,
                **callbacks(plan.spec_data.get("notifications"), stage.module or stage.name, plan.spec_data,
                            plan.spec_file),
            )
            for up in stage.upstream:
                tasks[up] >> task
    return dag


class StageOperator(BaseOperator):
    """Runs one Ballast stage. Nothing is templated: spec text such as '{{' stays as written."""

    template_fields = ()
    ui_color = "#dfe9f5"

    def __init__(self, *, stage: str, spec_data: dict, spec_file: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.stage = stage
        self.spec_data = spec_data
        self.spec_file = spec_file

    def execute(self, context: Any) -> dict:
        # Imported here: the runner pulls in the stage module, which imports its heavy libraries.
        from ballast.pipeline.runner import run_stage

        return run_stage(self.stage, spec_data=self.spec_data, spec_file=self.spec_file, context=context)

    def on_kill(self) -> None:
        # The task is being stopped (marked failed, timed out): take any training processes down with it.
        from ballast.launch.driver import stop_all

        stop_all()


def _doc(plan: Plan) -> str:
    lines = [f"**{plan.description}**", "", f"Spec: `{plan.spec_file}`", "",
             "| stage | what it does |", "|---|---|"]
    lines += [f"| `{s.name}` | {s.doc} |" for s in plan.stages]
    if plan.params:
        lines += ["", "Trigger parameters: " + ", ".join(f"`{p.key}` ({p.path})" for p in plan.params)]
    return "\n".join(lines)


class BrokenSpecs(DAG):
    """Stand-in for the specs that failed to load: its validation raises their errors, so the DAG
    processor records one import error for the DAG file while the other DAGs are bagged as usual."""

    def __init__(self, problems: list[str]):
        super().__init__(dag_id="ballast_broken_specs", schedule=None)
        self._problems = problems

    def validate(self) -> None:
        raise SpecError(self._problems)
