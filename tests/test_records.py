"""Stage records and the run report: saved as readable, versioned JSON, read back typed, refused clearly."""

from __future__ import annotations

import json

import pytest
from ballast.pipeline.context import RunContext
from ballast.errors import BallastError
from ballast.pipeline.plan import STAGE_MODULES
from ballast.records import (RECORDS, CheckedCheckpoint, ConvertResult, RunReport, StageRecords, TrainResult,
                             ValidateResult, VerifyResult, WarmCacheResult, WarmUpPhase)
from ballast.spec import parse_spec
from helpers import example_data

pytestmark = pytest.mark.unit


def make_ctx(tmp_path) -> RunContext:
    d = example_data()
    d["storage"]["uri"] = str(tmp_path / "storage")
    return RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id="manual__2026-01-01T00:00:00+00:00")


WARM = WarmCacheResult(cache_dir="/c", format="petastorm", pending_phases=1, seconds=0.5,
                       phases=[WarmUpPhase(name="first_steps", files=3, downloaded=2, bytes=10, seconds=0.5)])


def test_every_stage_has_a_versioned_record():
    assert set(RECORDS) == set(STAGE_MODULES)  # every stage, and a round's evaluate
    for model in (*RECORDS.values(), RunReport):
        assert "version" in model.model_fields and model.model_config["frozen"]


def test_a_record_is_saved_as_readable_json_and_read_back_typed(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.save_result("warm_cache", WARM)
    saved = json.loads(ctx.storage.read_bytes(ctx.result_key("warm_cache")))
    assert saved["version"] == 1 and saved["phases"][0]["name"] == "first_steps"
    back = ctx.result("warm_cache")
    assert back == WARM and back.cache_dir == "/c" and back.phases[0].downloaded == 2


def test_a_stage_saves_only_its_own_record(tmp_path):
    with pytest.raises(TypeError, match="stage 'train' records a TrainResult, not WarmCacheResult"):
        make_ctx(tmp_path).save_result("train", WARM)


@pytest.mark.parametrize("content,pattern", [
    (b"{not json", r"stages/warm_cache\.json: not a readable WarmCacheResult record .*; clear task 'warm_cache'"),
    (b'{"cache_dir": "/c"}', r"stages/warm_cache\.json: WarmCacheResult version None, this Ballast reads version 1"
                             r" \(written by another Ballast version\); clear task 'warm_cache' of run"),
    (b'{"version": 2}', r"WarmCacheResult version 2, this Ballast reads version 1"),
    (b'{"version": 1, "cache_dir": "/c"}', r"stages/warm_cache\.json: WarmCacheResult\.format: Field required;"
                                           r" clear task 'warm_cache'"),
])
def test_an_unreadable_or_other_version_record_names_its_key_and_the_fix(tmp_path, content, pattern):
    ctx = make_ctx(tmp_path)
    ctx.storage.write_bytes(ctx.result_key("warm_cache"), content)
    with pytest.raises(BallastError, match=pattern) as err:
        ctx.result("warm_cache")
    assert "\n" not in str(err.value)


def test_a_missing_record_says_what_to_run(tmp_path):
    with pytest.raises(BallastError, match=r"stages/train\.json: stage 'train' has no result for run"):
        make_ctx(tmp_path).result("train")


def test_the_report_keeps_stage_names_as_keys(tmp_path):
    ctx = make_ctx(tmp_path)
    checked = CheckedCheckpoint(path="/ck/step-00000010", step=10, files=4, parameters=123)
    stages = StageRecords(
        validate_=ValidateResult(rows=10, files=["a"], input_fingerprint="f", expectations=3, failures=[], seconds=1),
        convert=ConvertResult(dataset_id="d", prefix="datasets/x/d", reused=True, rows={"train": 8}),
        warm_cache=WARM,
        train=TrainResult(summary="s", checkpoint_dir="/ck", best_checkpoint=None, last_checkpoint="/ck/l", epochs=1,
                          steps=10, stopped_early=False, best=None, micro_batch_size=8, uploaded_checkpoints=[]),
        verify_checkpoint=VerifyResult(last=checked, best=checked))
    report = RunReport(pipeline="digits", dag_id=ctx.dag_id, run_id=ctx.run_id, model="m", model_card="c",
                       checkpoints="/ck", stages=stages,
                       test={"metric": "accuracy", "value": 0.9, "accuracy": 0.9, "loss": 0.3, "test_rows": 5},
                       training={"epochs": 1, "steps": 10, "stopped_early": False})
    ctx.storage.write_bytes(ctx.report_key, report.model_dump_json(indent=2).encode())
    raw = json.loads(ctx.storage.read_bytes(ctx.report_key))
    assert raw["stages"]["validate"]["rows"] == 10 and raw["stages"]["verify_checkpoint"]["best"]["parameters"] == 123
    back = ctx.report()
    assert back == report and back.stages.validate_.rows == 10 and back.test.value == 0.9
