"""From checkpoint to verdict: the stages rebuild the model a checkpoint records; training failures
that reach a stage are translated once by failure class, and fail fast or are retried by one rule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import ballast.training.failure as tf
from ballast import errors
from ballast.pipeline.context import RunContext
from ballast.records import CheckedCheckpoint, TrainResult, VerifyResult, WarmCacheResult
from ballast.pipeline.runner import run_stage
from ballast.spec import RecoverySpec, parse_spec
from ballast.stages import convert, evaluate, validate, verify_checkpoint, warm_cache
from helpers import example_data

RUN_ID = "manual__2026-01-01T00:00:00+00:00"


def spec_data(tmp_path: Path, raw: Path) -> dict:
    d = example_data()
    d["dataset"]["location"] = str(raw)
    d["storage"]["uri"] = str(tmp_path / "storage")
    d["cache"]["directory"] = str(tmp_path / "cache")
    return d


def airflow_context(run_id: str = RUN_ID) -> dict:
    return {"dag": SimpleNamespace(dag_id="ballast_digits"), "run_id": run_id, "params": {},
            "ti": SimpleNamespace(try_number=1)}


@pytest.fixture(scope="module")
def cached(tmp_path_factory, digits_raw) -> tuple[dict, WarmCacheResult]:
    """The digits data validated, converted and cached once for this module: (spec data, cache record)."""
    d = spec_data(tmp_path_factory.mktemp("cached"), digits_raw)
    ctx = RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id="prepare")
    for module in (validate, convert, warm_cache):
        ctx.save_result(module.__name__.rsplit(".", 1)[-1], module.run(ctx))
    warm_cache.warm_rest(ctx)
    return d, ctx.result("warm_cache")


def run_ctx(cached, run_id: str) -> RunContext:
    """A run of the cached data whose warm_cache record is saved (what evaluate reads)."""
    d, cache = cached
    ctx = RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id=run_id)
    ctx.save_result("warm_cache", cache)
    return ctx


def write_checkpoint(root: Path, spec, step: int, *, hidden: int | None = None) -> Path:
    """A committed checkpoint of the spec's model (another width with `hidden`), with the trainer state
    a real one records."""
    from ballast.launch.config import run_config
    from ballast.training import checkpoint as ckpt
    from ballast.training.models import build_configured_model

    section = run_config(spec, data_dir=".", data_format="petastorm", checkpoint_dir=".", output_dir=".").model
    if hidden:
        section = section.model_copy(update={"options": {**section.options, "hidden_size": hidden}})
    model = build_configured_model(section)
    w = ckpt.Writer(root, step, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", model.state_dict())
    w.write_json("trainer.json", {"step": step, "epoch": 1, "history": [{"epoch": 0, "accuracy": 0.5}],
                                  "model": section.model_dump(mode="json")})
    return w.commit()


@pytest.mark.integration
def test_a_damaged_best_checkpoint_at_evaluate_fails_the_task_without_retry(tmp_path, cached):
    ctx = run_ctx(cached, RUN_ID)
    best = write_checkpoint(tmp_path / "ckpt", ctx.spec, 10)
    checked = CheckedCheckpoint(path=str(best), step=10, files=3, parameters=1)
    ctx.save_result("verify_checkpoint", VerifyResult(last=checked, best=checked))
    model_file = best / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])  # damaged after verification

    with pytest.raises(errors.BallastError, match=rf"^{model_file}: ") as failed:
        run_stage("evaluate", spec_data=cached[0], spec_file="digits.yaml", context=airflow_context())
    assert "\n" not in str(failed.value)
    assert _retried(failed.value) is False  # the retry policy fails the task at once


@pytest.mark.integration
def test_verify_and_evaluate_rebuild_the_model_the_checkpoint_records(tmp_path, cached):
    ctx = run_ctx(cached, "recorded")
    assert ctx.spec.training.hidden_size != 24
    best = write_checkpoint(tmp_path / "ckpt", ctx.spec, 10, hidden=24)  # the spec was edited since
    ctx.save_result("train", TrainResult(summary="s", checkpoint_dir=str(best.parent), best_checkpoint=str(best),
                                         last_checkpoint=str(best), epochs=1, steps=10, stopped_early=False,
                                         best=None, micro_batch_size=8, uploaded_checkpoints=[]))
    checked = verify_checkpoint.run(ctx)
    assert checked.best == checked.last and checked.best.step == 10
    assert checked.best.parameters == 64 * 24 + 24 + 24 * 24 + 24 + 24 * 10 + 10  # the mlp of width 24
    ctx.save_result("verify_checkpoint", checked)
    gate = r"evaluation\.threshold: test accuracy 0\.\d+ does not reach 0\.9"
    with pytest.raises(errors.QualityGateError, match=gate):
        evaluate.run(ctx)  # an untrained model
    result = ctx.result("evaluate")  # saved before the gate stopped the run
    assert result.passed is False and result.threshold == 0.9
    assert result.test_rows == 273 and result.value == result.accuracy and 0.0 <= result.accuracy <= 1.0
    assert result.checkpoint == str(best) and result.validation_history == [{"epoch": 0, "accuracy": 0.5}]
    assert set(result.per_class_accuracy) <= set(range(10))


@pytest.mark.integration
def test_a_checkpoint_without_its_model_section_fails_verification_without_retry(tmp_path, cached):
    import json

    ctx = run_ctx(cached, "unrecorded")
    best = write_checkpoint(tmp_path / "ckpt", ctx.spec, 10)
    ctx.save_result("train", TrainResult(summary="s", checkpoint_dir=str(best.parent), best_checkpoint=None,
                                         last_checkpoint=str(best), epochs=1, steps=10, stopped_early=False,
                                         best=None, micro_batch_size=8, uploaded_checkpoints=[]))
    # Written by an older trainer: no model section. Re-committed so that only the content is at issue.
    state = json.loads((best / "trainer.json").read_text())
    del state["model"]
    from ballast.training import checkpoint as ckpt

    w = ckpt.Writer(best.parent, 10, rank=0, barrier=lambda: None)
    w.begin()
    (w.tmp / "model.pt").write_bytes((best / "model.pt").read_bytes())
    w.write_json("trainer.json", state)
    w.commit()
    with pytest.raises(errors.BallastError, match=rf"^{best / 'trainer.json'}: records no model") as failed:
        run_stage("verify_checkpoint", spec_data=cached[0], spec_file="digits.yaml",
                  context=airflow_context("unrecorded"))
    assert _retried(failed.value) is False  # the retry policy fails the task at once


@pytest.mark.unit
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
    assert _retried(out) is retried
    if isinstance(out, errors.LaunchError):
        assert out.failure_class == exc.failure_class


@pytest.mark.unit
@pytest.mark.parametrize("cls,retried", [("user_code", False), ("oom", True), ("communication", True),
                                         ("hang", True), ("lost", True), ("unknown", True)])
def test_launch_failures_are_retried_by_class(cls, retried):
    assert _retried(errors.training_error("training failed", cls)) is retried


def _retried(exc: BaseException) -> bool:
    """What the one decision place (the stage's retry policy) answers for a first failure `exc`."""
    from ballast.recovery.policy import StageRetryPolicy

    decision = StageRetryPolicy(RecoverySpec().model_dump(mode="json"), "train").evaluate(exc, 1, 10)
    return decision.action.value == "retry"


@pytest.mark.unit
@pytest.mark.parametrize("failure_class,fails_fast", [("data", True), ("communication", False)])
def test_the_runner_hands_the_error_to_the_retry_policy_which_fails_fast_or_retries(tmp_path, monkeypatch,
                                                                                     failure_class, fails_fast):
    from ballast.stages import publish

    def boom(ctx):
        raise tf.TrainingFailure("/ckpt/step-00000010/model.pt: broken", failure_class=failure_class)

    monkeypatch.setattr(publish, "run", boom)
    d = spec_data(tmp_path, tmp_path / "raw")
    expected = errors.DataError if fails_fast else errors.LaunchError
    with pytest.raises(expected, match=r"/ckpt/step-00000010/model\.pt: broken") as info:
        run_stage("publish", spec_data=d, spec_file="digits.yaml", context=airflow_context())
    assert _retried(info.value) is not fails_fast
