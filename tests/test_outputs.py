"""The trainer's outputs, declared once in ballast.training.outputs: each file written and read through
its model, with the JSON keys the stability view, the attempt history and stored runs read, and files
from before the version field still read."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from ballast.training import outputs as o

pytestmark = pytest.mark.unit

SUMMARY = dict(steps=12, epochs=2, stopped_early=False, best={"step": 12, "epoch": 1, "value": 0.9},
               history=[{"epoch": 0, "step": 6, "lr": 0.1, "accuracy": 0.8}], best_checkpoint="/c/step-00000012",
               last_checkpoint="/c/step-00000012", world_size=2, skipped_batches=[(0, 3)], train_seconds=1.5,
               samples=96, samples_per_second=64.0)


def test_the_summary_keeps_its_keys_and_gains_a_version(tmp_path):
    o.write_summary(tmp_path, o.Summary(**SUMMARY))
    data = json.loads((tmp_path / "summary.json").read_text())
    assert set(data) == {*SUMMARY, "version"} and data["version"] == o.VERSION
    assert data["skipped_batches"] == [[0, 3]]
    assert o.read_summary(tmp_path) == o.Summary(**SUMMARY)
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_summary_from_before_versions_reads_and_a_wrong_one_does_not(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({**SUMMARY, "skipped_batches": [[0, 3]]}))
    assert o.read_summary(tmp_path).version == 1
    (tmp_path / "summary.json").write_text(json.dumps({**SUMMARY, "stepz": 1}))
    with pytest.raises(ValidationError, match="stepz"):
        o.read_summary(tmp_path)


def test_the_first_failure_record_is_failure_json_and_the_next_ranks_go_beside_it(tmp_path):
    first = o.FailureRecord(failure_class="oom", exit_code=73, exception="OutOfMemoryError: x", rank=1, time=5.0)
    assert o.write_failure(tmp_path, first) == tmp_path / "failure.json"
    later = first.model_copy(update={"failure_class": "communication", "rank": 0})
    assert o.write_failure(tmp_path, later) == tmp_path / "failure-rank0.json"
    data = json.loads((tmp_path / "failure.json").read_text())
    assert data["class"] == "oom" and data["rank"] == 1 and data["version"] == o.VERSION
    assert o.read_failure(tmp_path) == first
    assert o.read_failure(tmp_path, "failure-rank0.json").failure_class == "communication"


def test_a_failure_record_from_before_versions_reads_and_a_broken_one_is_none(tmp_path):
    old = {"class": "data", "exit_code": 65, "retryable": False, "exception": "DataFailure: x", "traceback": [],
           "step": 3, "rank": 0, "host": "n1", "pid": 7, "time": 1.0}
    (tmp_path / "failure.json").write_text(json.dumps(old))
    assert o.read_failure(tmp_path).as_dict() == {**old, "version": 1}
    (tmp_path / "failure.json").write_text('{"class": "da')
    assert o.read_failure(tmp_path) is None
    assert o.read_failure(tmp_path / "nowhere") is None


def test_an_event_line_has_its_keys_first_and_its_kinds_fields_beside_them(tmp_path):
    path = tmp_path / "metrics.jsonl"
    o.write_event(path, o.Event(event="step", time=2.0, step=5, rank=0, loss=float("nan"), lr=0.1))
    o.write_event(path, o.Event(event="resume", time=3.0, step=4, path="/c/step-4"))
    line = path.read_text().splitlines()[0]
    assert list(json.loads(line)) == ["event", "time", "step", "rank", "loss", "lr", "version"]
    assert "NaN" in line  # as json.dumps writes it; readers map it to None
    evs = o.read_events(tmp_path, since=2.5)
    assert [(e.event, e.step, e.model_dump()["path"]) for e in evs] == [("resume", 4, "/c/step-4")]


@pytest.mark.parametrize("line", [b'{"event": "st', b'[1, 2]', b'{"event": "step", "time": 1.0}',
                                  b'{"event": "step", "step": true, "time": 1.0}',
                                  b'{"event": "step", "step": 1, "time": Infinity}'])
def test_a_cut_or_damaged_event_line_is_none(line):
    assert o.parse_event(line) is None


def test_an_event_line_from_before_versions_reads():
    e = o.parse_event(b'{"event": "step", "step": 10, "time": 1.0, "loss": 1.5}')
    assert (e.event, e.step, e.rank, e.version, e.model_dump()["loss"]) == ("step", 10, 0, 1, 1.5)


def test_the_heartbeat_is_step_time_and_version_and_reads_without_a_version(tmp_path):
    o.write_heartbeat(tmp_path, o.Heartbeat(step=7, time=1200.5))
    assert (tmp_path / "heartbeat").read_text() == f"7 1200.5 {o.VERSION}\n"
    assert o.read_heartbeat(tmp_path) == o.Heartbeat(step=7, time=1200.5)
    assert o.parse_heartbeat(b"100 1200.0\n") == o.Heartbeat(step=100, time=1200.0)
    assert o.parse_heartbeat(b"100 inf") is None and o.parse_heartbeat(b"") is None and o.parse_heartbeat(None) is None
    assert o.read_heartbeat(tmp_path / "nowhere") is None


def test_the_trainer_state_names_early_stopping_and_passes_the_parts_states_through():
    state = o.trainer_state(step=6, epoch=1, pos=0, history=[], best=None, bad_epochs=2, skip=[(0, 1)],
                            world_size=1, optim_parts=1, reason="epoch", lr_schedule={"last_epoch": 1},
                            model="mlp")
    assert state["bad_epochs"] == 2 and state["lr_schedule"] == {"last_epoch": 1} and state["version"] == o.VERSION
    assert state["skip"] == [[0, 1]]
    with pytest.raises(ValidationError, match="bad_epochs"):
        o.trainer_state(step=6, epoch=1, pos=0, history=[], best=None, skip=[], world_size=1, optim_parts=1,
                        reason="epoch")


def test_the_failure_module_names_the_record_as_the_outputs_do():
    from ballast.training.failure import RECORD_NAME

    assert RECORD_NAME == o.FAILURE_RECORD
