"""Spec parsing: the example, every class of bad input, overrides, the lint and schema commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ballast.errors import SpecError
from ballast.spec import Spec, apply_overrides, json_schema, load_spec, parse_spec
from helpers import EXAMPLE_SPEC, example_data, write_spec


@pytest.mark.unit
def test_example_spec_parses_into_frozen_model():
    spec = load_spec(EXAMPLE_SPEC)
    assert spec.dag_id == "ballast_digits"
    assert spec.training.world_size == 2
    assert spec.training.grad_accum_steps == 1
    assert spec.dataset.features[0].shape == (8, 8)
    assert spec.conversion.formats == ("petastorm", "tfrecord")
    with pytest.raises(Exception, match="frozen"):
        spec.training.epochs = 3  # type: ignore[misc]


@pytest.mark.unit
def test_the_old_name_cache_stages_is_read_with_a_deprecation_notice(tmp_path, caplog):
    phases = [{"name": "a", "fraction": 0.5}, {"name": "b", "fraction": 1.0}]
    data = example_data()
    data["cache"] = {"stages": phases}
    spec = parse_spec(data)
    assert [p.name for p in spec.cache.phases] == ["a", "b"]
    assert "cache.stages is deprecated: rename it to cache.phases" in caplog.text
    path = write_spec(tmp_path / "both.yaml", lambda d: d.update(cache={"stages": phases, "phases": phases}))
    with pytest.raises(SpecError, match=r"cache: .*give `phases` only \(`stages` is its old name\)"):
        load_spec(path)


@pytest.mark.unit
def test_defaults_come_from_the_seed_documents():
    spec = parse_spec({**example_data(), "recovery": {}, "evaluation": {"metric": "accuracy"}})
    assert spec.recovery.of("oom").retries == 3  # out-of-memory retried at most 3 times
    # preemptions are the cloud's weather: no count, no delay, at most 30 an hour
    assert spec.recovery.of("preempted").retries is None and spec.recovery.of("preempted").per_hour == 30
    assert spec.recovery.of("preempted").delay(1, 30) == 0
    assert spec.recovery.of("data").retries == 0 and spec.recovery.of("config").retries == 0
    assert spec.recovery.ceiling == 10_000  # classes without a count: the policy ends the task, not Airflow
    assert spec.recovery.model_copy(update={"retries": 12}).ceiling == 12
    counted = parse_spec({**example_data(), "recovery": {"policy": {c: 2 for c in (
        "lost", "preempted", "hardware", "communication", "hang")}}}).recovery
    assert counted.ceiling == 5 * 2 + 3 + 1 + 1  # the budgets' sum (oom 3, divergence 1, unknown 1)
    assert spec.evaluation.patience == 3
    assert spec.training.checkpoint.every_seconds == 3600
    assert spec.training.grad_clip_norm == 1.0


# Each bad input gets one line naming file, line, field path, the bad value and what is allowed.
BAD = [
    ("unknown_key", lambda d: d["training"].update(bogus=1),
     r"bad\.yaml:\d+: training\.bogus: unknown key 'bogus'; allowed here: task, model, hidden_size"),
    ("wrong_type", lambda d: d["training"].update(epochs="ten"),
     r"bad\.yaml:\d+: training\.epochs: must be an integer \(got 'ten'\)"),
    ("negative_size", lambda d: d["training"].update(micro_batch_size=-4),
     r"bad\.yaml:\d+: training\.micro_batch_size: must be >= 1 \(got -4\)"),
    ("zero_shard", lambda d: d["conversion"].update(shard_rows=0),
     r"conversion\.shard_rows: must be >= 1 \(got 0\)"),
    ("indivisible_batch", lambda d: d["training"].update(global_batch_size=100),
     r"training\.global_batch_size: must be a multiple of micro_batch_size x processes_per_node x nodes"
     r" = 32 x 2 x 1 = 64 \(got 100\)"),
    ("missing_dataset", lambda d: d.pop("dataset"), r"bad\.yaml: dataset: required field is missing"),
    ("unknown_capitalised_key", lambda d: d["training"].update(Epochs=3),
     r"bad\.yaml:\d+: training\.Epochs: unknown key 'Epochs'; allowed here: task, model, hidden_size"),
    ("unknown_capitalised_section", lambda d: d.update(Training={}),
     r"bad\.yaml:\d+: Training: unknown key 'Training'; allowed here: version, name"),
    ("unknown_model", lambda d: d["training"].update(model="resnet9000"),
     r"training\.model\.name: unknown model 'resnet9000'; registered: cnn, embed, gpt, hf_causal_lm, mlp, unet"),
    ("bad_precision", lambda d: d["training"].update(precision="fp64"),
     r"training\.precision: must be one of 'fp32', 'bf16' or 'fp16' \(got 'fp64'\)"),
    ("label_not_a_field", lambda d: d["dataset"].update(label="target"),
     r"dataset\.label: 'target' is not one of the fields \(image, label\)"),
    ("rule_column", lambda d: d["validation"]["rules"].append({"kind": "not_null", "column": "pixels"}),
     r"validation\.rules\[5\]\.column: 'pixels' is not a dataset field"),
    ("rule_needs_bounds", lambda d: d["validation"]["rules"].append({"kind": "between", "column": "label"}),
     r"validation\.rules\[5\]: rule 'between' needs min, max or both"),
    ("kubernetes_without_section", lambda d: d["execution"].update(backend="kubernetes"),
     r"execution\.kubernetes: backend 'kubernetes' needs a kubernetes section"),
    ("several_nodes_on_local", lambda d: d["training"].update(nodes=2, global_batch_size=128),
     r"training\.nodes: 2 nodes, but execution\.backend local trains on the Airflow worker alone"),
    ("slurm_without_section", lambda d: d["execution"].update(backend="slurm"),
     r"execution\.slurm: backend 'slurm' needs a slurm section with at least partition"),
    ("slurm_shell_in_partition", lambda d: d["execution"].update(backend="slurm", slurm={"partition": "gpu$(reboot)"}),
     r"execution\.slurm\.partition: 'gpu\$\(reboot\)' is not a valid Slurm name"),
    ("slurm_shell_in_python", lambda d: d["execution"].update(backend="slurm", slurm={"partition": "gpu",
                                                                                       "python": "python3; id"}),
     r"execution\.slurm\.python: 'python3; id' is not a valid interpreter path"),
    ("env_name_with_shell", lambda d: d["execution"].update(env={"A=1 B": "x"}),
     r"execution\.env: 'A=1 B' is not a valid environment variable name"),
    ("bad_cron", lambda d: d["schedule"].update(cron="every monday"),
     r"schedule\.cron: not a 5-field cron expression: 'every monday'"),
    ("cron_and_asset", lambda d: d["schedule"].update(asset="s3://bucket/raw"),
     r"schedule: set cron or asset, not both"),
    ("phase_fractions", lambda d: d["cache"].update(phases=[{"name": "a", "fraction": 0.5},
                                                            {"name": "b", "fraction": 0.4}]),
     r"cache\.phases: phase fractions must increase \(got \[0\.5, 0\.4\]\)"),
    ("override_section", lambda d: d["overridable"].append("training.checkpoint"),
     r"overridable: 'training\.checkpoint' is a section; name one of its fields"),
    ("override_unknown", lambda d: d["overridable"].append("training.speed"),
     r"overridable: 'training\.speed' is not a spec field"),
    ("override_clash", lambda d: d["overridable"].append("training.checkpoint.every_steps") or
     d["overridable"].append("recovery.retries") or d["overridable"].append("dataset.split.seed") or
     d["overridable"].append("training.seed"),
     r"overridable: 'training\.seed' and 'dataset\.split\.seed' would both be parameter 'seed'"),
    ("metric_mode", lambda d: d["evaluation"].update(mode="min"),
     r"evaluation\.mode: metric 'accuracy' improves when it goes max; set mode: max"),
    ("bad_storage", lambda d: d["storage"].update(uri="s3://"),
     r"storage\.uri: must be a local path or s3://bucket/prefix \(got 's3://'\)"),
    ("bad_name", lambda d: d.update(name="My Pipeline"), r"name: must match"),
    ("png_for_floats", lambda d: d["dataset"]["fields"][0].update(codec="png"),
     r"bad\.yaml:\d+: dataset\.fields\[0\]\.codec: png stores uint8 images of shape \[H, W\] or \[H, W, 3\] \(got float32 \[8, 8\]\); use codec: ndarray"),
    ("format_not_converted", lambda d: d["conversion"].update(formats=["tfrecord"]) or
     d["training"].update(data_format="petastorm"),
     r"training\.data_format: 'petastorm' is not among conversion\.formats \(tfrecord\)"),
    ("unknown_engine", lambda d: d["conversion"].update(engine="dask"),
     r"conversion\.engine: must be one of 'arrow' or 'spark' \(got 'dask'\)"),
    ("bad_fraction", lambda d: d["validation"].update(on_failure="quarantine", max_bad_fraction=1.5),
     r"validation\.max_bad_fraction: must be < 1"),
    ("bad_retry_mode", lambda d: d["storage"].update(retry_mode="forever"),
     r"storage\.retry_mode: must be one of 'standard', 'adaptive' or 'legacy' \(got 'forever'\)"),
]


@pytest.mark.unit
@pytest.mark.parametrize("edit,pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_gets_one_line_naming_file_and_field(tmp_path, edit, pattern):
    path = write_spec(tmp_path / "bad.yaml", edit)
    with pytest.raises(SpecError, match=pattern) as info:
        load_spec(path)
    assert all(line.startswith(str(path)) for line in info.value.problems)
    assert all("\n" not in line for line in info.value.problems)


@pytest.mark.unit
def test_line_numbers_point_at_the_bad_key(tmp_path):
    path = write_spec(tmp_path / "bad.yaml", lambda d: d["training"].update(epochs=0))
    lineno = next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith("epochs:"))
    with pytest.raises(SpecError, match=rf"bad\.yaml:{lineno}: training\.epochs: must be >= 1 \(got 0\)"):
        load_spec(path)


@pytest.mark.unit
def test_several_problems_are_all_reported(tmp_path):
    path = write_spec(tmp_path / "bad.yaml", lambda d: d["training"].update(epochs=0, precision="fp64", bogus=1))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert len(info.value.problems) == 3


@pytest.mark.unit
@pytest.mark.parametrize("content,pattern", [
    (b"name: x\ntraining: [1, 2\n", r"bad\.yaml:3: invalid YAML: did not find expected ',' or '\]'"),
    (b"- a\n- b\n", r"bad\.yaml: a spec is a YAML mapping of sections .* this file is a list"),
    (b"", r"bad\.yaml: a spec is a YAML mapping .* this file is empty"),
    (b"\xff\xfe\x00bad", r"bad\.yaml: not UTF-8 text"),
    (b"name: !!python/object/apply:os.system ['true']\n", r"bad\.yaml:1: invalid YAML: could not determine a constructor"),
], ids=["syntax", "list", "empty", "binary", "python_tag"])
def test_unreadable_yaml(tmp_path, content, pattern):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(SpecError, match=pattern):
        load_spec(path)


@pytest.mark.unit
def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match=r"nope\.yaml: cannot read spec \(No such file or directory\)"):
        load_spec(tmp_path / "nope.yaml")


@pytest.mark.unit
def test_overrides_are_applied_and_revalidated():
    spec = load_spec(EXAMPLE_SPEC)
    new = apply_overrides(spec, {"learning_rate": 0.01, "epochs": 2})
    assert (new.training.learning_rate, new.training.epochs) == (0.01, 2)
    assert spec.training.epochs == 30  # the original is untouched
    with pytest.raises(SpecError, match=r"run parameters: unknown parameter\(s\) dropout; allowed: epochs, learning_rate"):
        apply_overrides(spec, {"dropout": 0.5})
    with pytest.raises(SpecError, match=r"training\.micro_batch_size: must be >= 1 \(got 0\)"):
        apply_overrides(spec, {"micro_batch_size": 0})
    with pytest.raises(SpecError, match=r"training\.global_batch_size: must be a multiple"):
        apply_overrides(spec, {"micro_batch_size": 24})


@pytest.mark.unit
def test_json_schema_describes_fields():
    schema = json_schema()
    assert schema["title"] == "Ballast training pipeline spec"
    training = schema["$defs"]["TrainingSpec"]["properties"]
    assert training["micro_batch_size"]["minimum"] == 1
    assert "Samples per process" in training["micro_batch_size"]["description"]
    assert schema["$defs"]["TrainingSpec"]["additionalProperties"] is False


def _ballast(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ballast.dev.cli", *args], capture_output=True, text=True)


@pytest.mark.integration
def test_lint_command_exit_codes_and_one_line_per_error(tmp_path):
    good = write_spec(tmp_path / "good.yaml")
    bad = write_spec(tmp_path / "bad.yaml", lambda d: d["training"].update(epochs=0, bogus=True))
    ok = _ballast("lint", str(good))
    assert ok.returncode == 0 and "ok (ballast_digits)" in ok.stdout
    res = _ballast("lint", str(good), str(bad))
    assert res.returncode == 1
    lines = [line for line in res.stdout.splitlines() if line.startswith(str(bad))]
    assert len(lines) == 2, res.stdout
    assert "Traceback" not in res.stdout + res.stderr


@pytest.mark.integration
def test_schema_command_prints_json(tmp_path):
    out = tmp_path / "schema.json"
    res = _ballast("schema", "-o", str(out))
    assert res.returncode == 0
    assert json.loads(out.read_text())["properties"]["training"]["$ref"] == "#/$defs/TrainingSpec"


@pytest.mark.unit
def test_every_model_field_is_documented():
    missing = []

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            if not field.description and not (isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields")):
                missing.append(prefix + name)
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")

    walk(Spec, "")
    assert not missing, f"fields without a docstring: {missing}"


@pytest.mark.unit
def test_each_settings_section_reaches_the_run_config_whole():
    """The spec's training inherits settings sections flat (their fields are its YAML keys); the run config
    gets each as one section (`Section.section`), every field of it, plus only what the try decided."""
    from ballast.launch.config import run_config
    from ballast.training.config import sections as s

    d = example_data()
    d["training"].update(seed=7, precision="bf16", parallelism="fsdp", loader_workers=0, loader_prefetch=3,
                         gpu_memory_fraction=0.5, weight_decay=0.2, dropout=0.3, lr_reference_batch_size=16,
                         lr_plateau={"patience": 2}, checkpoint={"every_steps": 5}, monitors={"spike_window": 9},
                         rehearsal={"max_steps": 40})
    d["evaluation"] = {**d.get("evaluation", {}), "metric": "loss", "mode": "min", "patience": 4, "threshold": 0.5}
    d["recovery"] = {**d.get("recovery", {}), "preempt_grace_seconds": 30}
    d["execution"] = {**d.get("execution", {}), "hang_timeout_seconds": 99}
    spec = parse_spec(d)
    t = spec.training
    cfg = run_config(spec, data_dir="/d", data_format="tfrecord", checkpoint_dir="/c", output_dir="/o",
                     micro_batch_size=4)
    decided = {"micro_batch_size": 4, "learning_rate": t.effective_learning_rate}  # the try's, not the spec's
    carried = {s.RunSettings: cfg, s.LoaderSettings: cfg.data, s.BatchSettings: cfg.batch,
               s.OptimSettings: cfg.optim, s.NumericsSettings: cfg.numerics, s.DistributedSettings: cfg.distributed,
               s.ResourceSettings: cfg.resources}
    for cls, got in carried.items():
        assert got.model_dump(include=set(cls.model_fields)) == {**t.section(cls).model_dump(), **{
            k: v for k, v in decided.items() if k in cls.model_fields}}, cls.__name__
    assert cfg.optim.learning_rate != t.learning_rate and cfg.batch.micro_batch_size != t.micro_batch_size
    # The model section: the entry point, its options (mlp's from the flat hidden_size and dropout), the task.
    assert (cfg.model.name, cfg.model.options) == (t.model.name, {"hidden_size": t.hidden_size, "dropout": 0.3})
    assert cfg.model.task == t.task == "classification" and cfg.model.data["num_classes"] == spec.dataset.num_classes
    assert (cfg.model.options["dropout"], cfg.data.loader_prefetch, cfg.distributed.parallelism) == (0.3, 3, "fsdp")
    assert cfg.checkpoint.model_dump(include=set(s.CheckpointSettings.model_fields)) == t.checkpoint.model_dump()
    assert cfg.monitors == t.monitors and cfg.early_stop == spec.evaluation.section(s.EarlyStopSettings)
    assert cfg.recovery == spec.recovery.section(s.RecoverySettings)
    assert cfg.execution == spec.execution.section(s.ExecutionSettings)
    assert cfg.rehearsal.max_steps == 40 and type(t.section(s.BatchSettings)) is s.BatchSettings
    with pytest.raises(TypeError, match="EvaluationSpec is not built from BatchSettings"):
        spec.evaluation.section(s.BatchSettings)
