"""The spec's task side: training.task, model {name, options}, seq_len, what each task needs of the
dataset (one located line per mismatch, CONTRACT 1), evaluation.metric and mode resolved from the task,
and the run config's model data (CONTRACT 3) and data section (CONTRACT 5)."""

from __future__ import annotations

import pytest
from helpers import example_data, write_spec

from ballast.errors import SpecError
from ballast.launch.config import run_config
from ballast.spec import load_spec, parse_spec

pytestmark = pytest.mark.unit
PATHS = {"data_dir": "d", "data_format": "petastorm", "checkpoint_dir": "c", "output_dir": "o"}


def lm_data() -> dict:
    d = example_data()
    d["dataset"] = {"location": "raw/corpus", "fields": [{"name": "text", "type": "string"}], "text": "text",
                    "tokenizer": {"kind": "bytes"}}
    d["validation"] = {"rules": []}
    d["training"].update(task="causal_lm", model={"name": "gpt", "options": {"layers": 2, "width": 64, "heads": 4}},
                         seq_len=64)
    d["training"].pop("hidden_size", None)
    d["evaluation"] = {"patience": 3}
    return d


def seg_data(label_shape=(16, 16), label_type="int64") -> dict:
    d = example_data()
    d["dataset"].update(fields=[{"name": "image", "type": "float32", "shape": [16, 16, 3]},
                                {"name": "mask", "type": label_type, "shape": list(label_shape)}],
                        label="mask", num_classes=3)
    d["validation"] = {"rules": []}
    d["training"].update(task="segmentation", model={"name": "unet", "options": {"depth": 2}})
    d["evaluation"] = {"patience": 3}
    return d


def problems(d: dict, tmp_path) -> list[str]:
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(tmp_path / "bad.yaml", data=d))
    return [line.split(": ", 1)[1] for line in err.value.problems]


def test_a_language_model_spec_and_its_run_config():
    spec = parse_spec(lm_data())
    assert (spec.training.task, spec.training.model.name, spec.training.seq_len) == ("causal_lm", "gpt", 64)
    assert (spec.evaluation.metric, spec.evaluation.mode) == ("loss", "min")  # the task's default, its direction
    cfg = run_config(spec, manifest={"tokenizer": {"kind": "bytes", "vocab_size": 257}}, **PATHS)
    assert cfg.model.name == "gpt" and cfg.model.options == {"layers": 2, "width": 64, "heads": 4}
    assert cfg.model.data == {"task": "causal_lm", "input_shape": [64], "input_dtype": "int64", "seq_len": 64,
                              "inputs": {"tokens": {"shape": [64], "dtype": "int64"}}, "vocab_size": 257}
    assert (cfg.data.features, cfg.data.label) == (["tokens"], None)
    assert (cfg.early_stop.metric, cfg.early_stop.mode) == ("loss", "min")
    assert cfg.version == 2


def test_segmentation_and_regression_model_data():
    spec = parse_spec(seg_data())
    assert (spec.evaluation.metric, spec.evaluation.mode) == ("mean_iou", "max")
    data = run_config(spec, **PATHS).model.data
    assert data == {"task": "segmentation", "input_shape": [16, 16, 3], "input_dtype": "float32",
                    "inputs": {"image": {"shape": [16, 16, 3], "dtype": "float32"}}, "num_classes": 3,
                    "target_shape": [16, 16]}
    d = example_data()
    d["dataset"].update(fields=[{"name": "a", "type": "float32", "shape": [3]}, {"name": "b", "type": "int32"},
                                {"name": "y", "type": "float32"}], label="y")
    d["dataset"].pop("num_classes")
    d["validation"] = {"rules": []}
    d["training"]["task"] = "regression"
    d["evaluation"] = {"metric": "mae"}
    spec = parse_spec(d)
    assert (spec.evaluation.metric, spec.evaluation.mode) == ("mae", "min")
    cfg = run_config(spec, **PATHS)
    assert cfg.model.data["inputs"] == {"a": {"shape": [3], "dtype": "float32"}, "b": {"shape": [], "dtype": "int32"}}
    assert cfg.model.data["target_shape"] == [] and "num_classes" not in cfg.model.data
    assert (cfg.data.features, cfg.data.label) == (["a", "b"], "y")


def test_old_specs_keep_working():
    spec = load_spec("dags/specs/digits.yaml")
    assert spec.training.task == "classification" and spec.training.model.name == "mlp"
    assert spec.training.model.options == {} and spec.training.model_options == {"hidden_size": 128, "dropout": 0.1}
    d = example_data()
    d["training"]["model"] = {"name": "mlp", "options": {"hidden_size": 32}}  # options win over the flat defaults
    assert parse_spec(d).training.model_options == {"hidden_size": 32, "dropout": 0.1}


def test_a_text_spec_without_text_is_one_located_line(tmp_path):
    d = lm_data()
    d["dataset"] = {"location": "raw/x", "fields": [{"name": "ids", "type": "float32", "shape": [100]}]}
    assert problems(d, tmp_path) == [
        "dataset.text: task causal_lm needs `text` naming a string field (tokenized by the pipeline), or exactly one"
        " integer array field of token ids (got fields ids)"]
    d["dataset"]["fields"] = [{"name": "ids", "type": "int32", "shape": [1000]}]  # pre-tokenized ids
    assert run_config(parse_spec(d), **PATHS).data.features == ["tokens"]


def test_a_label_of_the_wrong_shape_is_one_located_line(tmp_path):
    path = write_spec(tmp_path / "seg.yaml", data=seg_data(label_shape=(16, 8)))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.strip().startswith("label:"))
    assert err.value.problems == [
        f"{path}:{line}: dataset.label: task segmentation needs a label of the feature 'image''s spatial shape"
        f" [16, 16, 3] or [16, 16] (feature [16, 16, 3]); got int64 [16, 8]"]
    assert parse_spec(seg_data(label_shape=(16, 16)))  # [H, W, C] -> [H, W]


def test_each_mismatch_is_its_own_line(tmp_path):
    d = example_data()
    d["training"]["task"] = "regression"  # an integer label and num_classes: two lines
    assert problems(d, tmp_path) == [
        "dataset.num_classes: task regression predicts values, not classes; remove num_classes",
        "dataset.label: task regression needs a float label (float32 or float64, scalar or array); field 'label' is"
        " not (got int64 [])",
        "evaluation.metric: 'accuracy' is not a metric of task regression (rmse, mae, loss)"]


def test_metric_and_mode_against_the_task(tmp_path):
    d = lm_data()
    d["evaluation"] = {"metric": "accuracy"}
    assert problems(d, tmp_path) == [
        "evaluation.metric: 'accuracy' is not a metric of task causal_lm (loss, perplexity, bits_per_byte)"]
    d["evaluation"] = {"metric": "perplexity", "mode": "max"}
    assert problems(d, tmp_path) == [
        "evaluation.mode: metric 'perplexity' improves when it goes min; set mode: min or leave mode out"]
    d["evaluation"] = {"metric": "bits_per_byte"}
    assert parse_spec(d).evaluation.mode == "min"
    d["dataset"] = {"location": "raw/ids", "fields": [{"name": "ids", "type": "int32", "shape": [1000]}]}
    assert problems(d, tmp_path) == [
        "evaluation.metric: bits_per_byte needs the bytes each token stands for, which only a text dataset's tokenizer"
        " gives (dataset.text); use loss or perplexity for pre-tokenized ids"]


def test_seq_len_belongs_to_causal_lm(tmp_path):
    d = lm_data()
    del d["training"]["seq_len"]
    assert problems(d, tmp_path) == ["training.seq_len: task causal_lm needs seq_len (tokens per training sequence)"]
    d = example_data()
    d["training"]["seq_len"] = 128
    assert problems(d, tmp_path) == [
        "training.seq_len: only task causal_lm reads seq_len (the task is classification); remove it"]


def test_the_json_schema_takes_a_plain_model_name_or_a_mapping():
    from ballast.spec import json_schema

    schema = json_schema()
    model = schema["$defs"]["TrainingSpec"]["properties"]["model"]
    assert [m.get("type") or m.get("$ref") for m in model["anyOf"]] == ["string", "#/$defs/ModelChoice"]
    assert set(schema["$defs"]["ModelChoice"]["properties"]) == {"name", "options"}
    assert schema["$defs"]["TrainingSpec"]["properties"]["task"]["enum"] == [
        "classification", "causal_lm", "segmentation", "regression"]


def test_a_run_parameter_changing_the_metric_takes_its_direction():
    from ballast.spec import apply_overrides

    d = example_data()
    d["overridable"] = [*d.get("overridable", []), "evaluation.metric"]
    spec = parse_spec(d)
    assert (spec.evaluation.metric, spec.evaluation.mode) == ("accuracy", "max")
    changed = apply_overrides(spec, {"metric": "loss"})
    assert (changed.evaluation.metric, changed.evaluation.mode) == ("loss", "min")
    with pytest.raises(SpecError, match=r"evaluation\.metric: 'perplexity' is not a metric of task classification"):
        apply_overrides(spec, {"metric": "perplexity"})
