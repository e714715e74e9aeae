"""Training failures reaching a stage: translated once by failure class, failing fast or retried by one table."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import training.failure as tf
from ballast import errors
from ballast.context import RunContext
from ballast.records import CheckedCheckpoint, VerifyResult
from ballast.runner import run_stage
from ballast.spec import parse_spec
from ballast.stages import convert, validate, warm_cache
from conftest import example_data

RUN_ID = "manual__2026-01-01T00:00:00+00:00"


def spec_data(tmp_path: Path, raw: Path) -> dict:
    d = example_data()
    d["dataset"]["location"] = str(raw)
    d["storage"]["uri"] = str(tmp_path / "storage")
    d["cache"]["directory"] = str(tmp_path / "cache")
    return d


def airflow_context() -> dict:
    return {"dag": SimpleNamespace(dag_id="ballast_digits"), "run_id": RUN_ID, "params": {},
            "ti": SimpleNamespace(try_number=1)}


def write_checkpoint(root: Path, spec, step: int) -> Path:
    """A committed checkpoint of the spec's model, with the trainer state a real one records."""
    from training import checkpoint as ckpt
    from training.models import build_model

    t, feature = spec.training, spec.dataset.features[0]
    model = build_model(t.model, input_shape=list(feature.shape), num_classes=spec.dataset.num_classes,
                        hidden=t.hidden_size)
    w = ckpt.Writer(root, step, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", model.state_dict())
    w.write_json("trainer.json", {"step": step, "epoch": 1, "history": [{"epoch": 0, "accuracy": 0.5}],
                                  "model": t.model, "input_shape": list(feature.shape),
                                  "num_classes": spec.dataset.num_classes, "hidden_size": t.hidden_size})
    return w.commit()


def test_a_damaged_best_checkpoint_at_evaluate_fails_the_task_without_retry(tmp_path, digits_raw):
    from airflow.sdk.exceptions import AirflowFailException

    d = spec_data(tmp_path, digits_raw)
    ctx = RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id=RUN_ID)
    for module in (validate, convert, warm_cache):
        ctx.save_result(module.__name__.rsplit(".", 1)[-1], module.run(ctx))
    warm_cache.warm_rest(ctx)
    best = write_checkpoint(tmp_path / "ckpt", ctx.spec, 10)
    checked = CheckedCheckpoint(path=str(best), step=10, files=3, parameters=1)
    ctx.save_result("verify_checkpoint", VerifyResult(last=checked, best=checked))
    model_file = best / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])  # damaged after verification

    with pytest.raises(AirflowFailException, match=rf"^evaluate: {model_file}: ") as failed:
        run_stage("evaluate", spec_data=d, spec_file="digits.yaml", context=airflow_context())
    assert "\n" not in str(failed.value)


@pytest.mark.parametrize("failure,error,retried", [
    ("ConfigFailure", "ConfigError", False),
    ("DataFailure", "DataError", False),
    ("CheckpointFailure", "DataError", False),
    ("DivergenceFailure", "LaunchError", True),
    ("Preempted", "LaunchError", True),
])
def test_training_failures_are_translated_once_by_class(failure, error, retried):
    exc = getattr(tf, failure)("run.json: something\n  on a second line")
    out = errors.from_training(exc)
    assert type(out).__name__ == error and str(out) == "run.json: something on a second line"
    assert errors.retry_helps(out) is retried
    if isinstance(out, errors.LaunchError):
        assert out.failure_class == exc.failure_class


@pytest.mark.parametrize("cls,retried", [("user_code", False), ("oom", True), ("communication", True),
                                         ("hang", True), ("unknown", True)])
def test_launch_failures_are_retried_by_class(cls, retried):
    assert errors.retry_helps(errors.training_error("training failed", cls)) is retried


@pytest.mark.parametrize("failure_class,fails_fast", [("data", True), ("communication", False)])
def test_the_runner_fails_fast_or_hands_back_for_a_retry(tmp_path, monkeypatch, failure_class, fails_fast):
    from airflow.sdk.exceptions import AirflowFailException

    from ballast.stages import publish

    def boom(ctx):
        raise tf.TrainingFailure("/ckpt/step-00000010/model.pt: broken", failure_class=failure_class)

    monkeypatch.setattr(publish, "run", boom)
    d = spec_data(tmp_path, tmp_path / "raw")
    expected = AirflowFailException if fails_fast else errors.LaunchError
    with pytest.raises(expected, match=r"/ckpt/step-00000010/model\.pt: broken"):
        run_stage("publish", spec_data=d, spec_file="digits.yaml", context=airflow_context())
