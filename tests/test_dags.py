"""Plan building and DAG integrity: DagBag over dags/, stage order, params, broken specs, parse cost."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys

import pytest
from ballast.pipeline.plan import STAGES, UPSTREAM, build_plan
from ballast.spec import load_spec
from helpers import EXAMPLE_SPEC, ROOT, write_spec


@pytest.mark.unit
def test_plan_orders_stages_and_sets_retries():
    plan = build_plan(load_spec(EXAMPLE_SPEC), spec_file=str(EXAMPLE_SPEC))
    assert [s.name for s in plan.stages] == list(STAGES)
    assert {s.name: s.upstream for s in plan.stages} == UPSTREAM
    retries = {s.name: s.retries for s in plan.stages}
    assert retries["validate"] == 0  # bad data is not fixed by retrying
    assert retries["train"] == 10_000  # classes without a count (recovery.policy): the policy ends the task
    # The other stages' killed task processes no policy counts: their counts (oom 3, divergence 1, unknown 1)
    # and an hour of each rate (lost 30, preempted 30, communication 20, hardware 6, hang 6).
    assert retries["evaluate"] == retries["convert"] == retries["publish"] == 3 + 1 + 1 + 30 + 30 + 20 + 6 + 6
    assert plan.cron == "0 3 * * 1" and plan.asset is None
    assert plan.tags == ("ballast", "example", "vision")


@pytest.mark.unit
def test_plan_params_carry_type_bounds_and_description():
    plan = build_plan(load_spec(EXAMPLE_SPEC), spec_file="x")
    params = {p.key: p for p in plan.params}
    assert set(params) == {"learning_rate", "epochs", "micro_batch_size", "patience"}
    assert params["epochs"].schema == {"type": "integer", "minimum": 1, "maximum": 100000}
    assert params["learning_rate"].schema == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 10.0}
    assert params["epochs"].default == 30
    assert params["epochs"].path == "training.epochs"
    assert "early stopping" in params["epochs"].description


@pytest.mark.integration
def test_dagbag_has_no_import_errors_and_stages_in_order():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(str(ROOT / "dags"))
    assert bag.import_errors == {}
    dag = bag.dags["ballast_digits"]
    ups = {t.task_id: t.upstream_task_ids for t in dag.tasks}
    assert ups == {
        "validate": set(), "convert": {"validate"}, "warm_cache": {"convert"}, "train": {"warm_cache"},
        "verify_checkpoint": {"train"}, "evaluate": {"verify_checkpoint"}, "publish": {"evaluate"},
    }
    assert dag.tags == {"ballast", "example", "vision"} or set(dag.tags) == {"ballast", "example", "vision"}
    assert dag.owner == "data-team"
    assert dag.default_args["retries"] == 97 and dag.task_dict["train"].retries == 10_000
    assert dag.task_dict["train"].retry_policy.serialize()["stage"] == "train"
    assert dag.task_dict["validate"].retry_policy is None
    assert dag.task_dict["validate"].retries == 0
    assert dag.params["epochs"] == 30
    assert dag.max_active_runs == 1


@pytest.mark.integration
def test_param_bounds_refuse_bad_values_before_a_run():
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.exceptions import ParamValidationError

    dag = DagBag(str(ROOT / "dags")).dags["ballast_digits"]
    bad = copy.deepcopy(dag.params)
    with pytest.raises(ParamValidationError, match="epochs"):
        bad["epochs"] = 0
        bad.validate()
    good = copy.deepcopy(dag.params)
    good["epochs"] = 5
    assert good.validate()["epochs"] == 5


@pytest.mark.integration
def test_asset_schedule(tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    dags = tmp_path / "dags"
    (dags / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "ballast_pipelines.py", dags)
    write_spec(dags / "specs" / "digits.yaml",
               lambda d: d.update(schedule={"asset": "s3://raw-bucket/digits"}))
    dag = DagBag(str(dags)).dags["ballast_digits"]
    assert [a.uri for a in dag.timetable.asset_condition.objects] == ["s3://raw-bucket/digits"]


@pytest.mark.integration
def test_broken_spec_beside_good_ones_gives_one_import_error_naming_the_field(tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    dags = tmp_path / "dags"
    (dags / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "ballast_pipelines.py", dags)
    write_spec(dags / "specs" / "digits.yaml")
    write_spec(dags / "specs" / "other.yaml", lambda d: d.update(name="other"))
    write_spec(dags / "specs" / "broken.yaml",
               lambda d: d.update(name="broken") or d["training"].update(micro_batch_size=0))
    bag = DagBag(str(dags))
    assert set(bag.dags) == {"ballast_digits", "ballast_other"}
    assert len(bag.import_errors) == 1
    (path, message), = bag.import_errors.items()
    assert path.endswith("ballast_pipelines.py")
    assert "broken.yaml" in message and "training.micro_batch_size: must be >= 1 (got 0)" in message


@pytest.mark.integration
def test_duplicate_names_are_an_import_error(tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    dags = tmp_path / "dags"
    (dags / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "ballast_pipelines.py", dags)
    write_spec(dags / "specs" / "a.yaml")
    write_spec(dags / "specs" / "b.yaml")
    bag = DagBag(str(dags))
    assert list(bag.dags) == ["ballast_digits"]
    assert "b.yaml: name: 'digits' is already used by another spec" in next(iter(bag.import_errors.values()))


@pytest.mark.integration
def test_parsing_imports_no_heavy_module():
    probe = (
        "import sys, json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag({str(ROOT / 'dags')!r})\n"
        "heavy = ('torch','great_expectations','petastorm','pyspark','boto3','kubernetes','tfrecord','cv2','sklearn',"
        " 'transformers','tokenizers','safetensors','ballast.training.models.classic',"
        " 'ballast.training.models.gpt','ballast.training.models.unet','ballast.training.models.hf')\n"
        "print(json.dumps({'dags': list(bag.dags), 'heavy': [m for m in heavy if m in sys.modules]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # (jsonschema, which checks a model's options, is no budget of ours: airflow.sdk imports it itself.)
    assert sorted(result["dags"]) == ["ballast_digits", "ballast_lm", "ballast_segmentation"] and result["heavy"] == []


@pytest.mark.integration
def test_training_package_never_imports_airflow():
    probe = ("import sys, ballast.training.trainer, ballast.training.checkpoint, ballast.training.dataset.loader,"
             " ballast.training.__main__\n"
             "print([m for m in sys.modules if m.split('.')[0] == 'airflow'"
             " or m.startswith('ballast.') and not m.startswith('ballast.training')])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.integration
def test_the_node_program_never_imports_airflow():
    """What a training pod runs (docker/training.Dockerfile has no Airflow)."""
    probe = ("import sys, ballast.node, ballast.stages.warm_cache, ballast.storage.checkpoints, ballast.launch.config\n"
             "print([m for m in sys.modules if m.split('.')[0] == 'airflow'])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.integration
def test_airflow_does_not_exec_package_files_as_plugins():
    # Airflow execs every .py under plugins/ as a top-level module named after the file; without
    # plugins/.airflowignore, plugins/ballast/bench/train_runtime.py and friends would land in
    # sys.modules under bare names and could shadow real packages (this hid `training` once).
    from airflow._shared.module_loading import find_path_from_directory

    found = [p for p in find_path_from_directory(str(ROOT / "plugins"), ".airflowignore", "glob") if p.endswith(".py")]
    assert not any("/ballast/" in p for p in found), found
