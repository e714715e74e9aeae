"""Recovery through Airflow (dag.test, real torchrun): each failure class injected in one try shows its
adaptation in the next, budgets end retries with a message naming the class, a corrupted checkpoint is
quarantined and the one before it used. Policy and bad-input checks run in process (unit)."""

from __future__ import annotations

import hashlib
import json
import socket

import pytest
from ballast.errors import SpecError
from ballast.recovery import history
from ballast.records import AttemptHistory, RecoverySummary
from ballast.recovery.policy import decide
from ballast.spec import RecoverySpec, parse_spec
from helpers import bench_in_a_process, example_data, run_spec_dag


def _fast(d: dict, faults: list[dict], **recovery) -> None:
    """A short training (4 epochs, a checkpoint every 10 steps), the faults armed, no retry delays, no
    group restarts inside a try (each fault ends its try, as these tests count tries)."""
    d["training"].update(epochs=4, checkpoint={"every_steps": 10, "keep_last": 5},
                         rehearsal={"faults": faults})
    d["evaluation"].update(threshold=None, patience=10)
    d["recovery"] = {"retry_delay_seconds": 0, "max_restarts": 0, **recovery}
    d["schedule"] = {}


def _task_states(dr) -> dict[str, tuple[str, int]]:
    return {ti.task_id: (str(ti.state), ti.try_number) for ti in dr.get_task_instances()}


@pytest.mark.e2e
def test_each_class_adapts_the_next_try_and_the_report_sums_the_tries(airflow_db, digits_raw, tmp_path):
    faults = [{"kind": "oom", "step": 5, "rank": 0, "on_try": 1},
              {"kind": "sigterm", "step": 25, "rank": 0, "on_try": 2},
              {"kind": "comm", "step": 45, "rank": 0, "on_try": 3},
              {"kind": "nan", "step": 55, "on_try": 4},
              {"kind": "hang", "step": 65, "rank": 1, "on_try": 5},
              {"kind": "ecc", "step": 70, "rank": 0, "on_try": 6}]

    def edit(d):
        _fast(d, faults, on_demand_after_preemptions=1, policy={"hang": 1})
        d["execution"]["hang_timeout_seconds"] = 6

    dr, ctx = run_spec_dag(tmp_path, edit, conf={"rehearsal": True})
    assert str(dr.state) == "success", _task_states(dr)
    tries = history.load(ctx, "train").attempts
    assert [(a.try_number, a.outcome, a.failure_class) for a in tries] == [
        (1, "failed", "oom"), (2, "failed", "preempted"), (3, "failed", "communication"), (4, "failed", "divergence"),
        (5, "failed", "hang"), (6, "failed", "hardware"), (7, "success", None)]
    # Divergence: the next try resumes from the last good state, checkpointed before the poisoned batch.
    assert tries[4].resumed_step == 54 and "offending batches skipped" in tries[4].adaptation[0]
    assert json.loads((ctx.work_dir / "train" / "summary.json").read_text())["skipped_batches"] == [[2, 12]]
    assert tries[5].settings["avoid_hosts"] == [socket.gethostname()]  # the hang's host too (already there)
    assert "uncorrectable ECC error" in tries[5].reason and tries[5].exit_code == 1
    # Out of memory: the micro-batch halves, accumulation doubles, the global batch stays 64.
    assert "micro-batch 32 -> 16" in tries[1].adaptation[0] and "global batch 64 kept" in tries[1].adaptation[0]
    run = json.loads((ctx.work_dir / "train" / "run.json").read_text())
    assert run["batch"]["micro_batch_size"] == 16 and run["batch"]["grad_accum_steps"] == 2
    assert run["batch"]["micro_batch_size"] * run["batch"]["grad_accum_steps"] * 2 == 64
    # A preemption (recovery.on_demand_after_preemptions: 1) asks for the on-demand pool from then on.
    assert tries[2].settings["capacity"] == "on-demand" and "on-demand" in tries[2].adaptation[0]
    # A communication failure puts its host on the avoid list the backend receives.
    assert tries[3].settings["avoid_hosts"] == [socket.gethostname()]
    assert tries[3].settings["capacity"] == "on-demand" and tries[3].settings["micro_batch_size"] == 16
    # Every try after the first resumes from a checkpoint the gate passed, ahead of where it failed.
    assert tries[1].resumed_from is None or tries[1].resumed_step <= 5
    assert tries[2].resumed_step is not None and tries[3].resumed_step >= tries[2].resumed_step
    assert all(a.ended is not None and a.ended >= a.started for a in tries)
    assert tries[0].step_reached is not None and tries[0].exit_code is not None
    report = ctx.report()
    assert report.recovery.failures_by_class == {"oom": 1, "preempted": 1, "communication": 1, "divergence": 1,
                                                 "hang": 1, "hardware": 1}
    assert report.recovery.tries == 7 and 0 < report.recovery.effective_ratio <= 1
    assert report.recovery.mtbf_seconds == pytest.approx(report.recovery.wall_seconds / 6, rel=1e-3)
    assert report.recovery.lost_seconds > 0
    card = json.loads(ctx.storage.read_bytes(report.model_card.split(str(ctx.storage.uri).rstrip("/") + "/")[-1]))
    assert card["lineage"]["dataset_id"] == report.stages.convert.dataset_id
    assert len(card["lineage"]["attempts"][0]["attempts"]) == 7
    weights = ctx.storage.read_bytes(report.model.split(str(ctx.storage.uri).rstrip("/") + "/")[-1])
    assert card["weights_sha256"] == hashlib.sha256(weights).hexdigest()  # what every load checks


@pytest.mark.e2e
def test_a_budget_that_runs_out_fails_the_task_naming_the_class(airflow_db, digits_raw, tmp_path):
    faults = [{"kind": "oom", "step": 3, "rank": 0, "on_try": 1}, {"kind": "oom", "step": 3, "rank": 0, "on_try": 2}]
    dr, ctx = run_spec_dag(tmp_path, lambda d: _fast(d, faults, policy={"oom": 1}), conf={"rehearsal": True},
                           name="budget")
    assert str(dr.state) == "failed"
    assert _task_states(dr)["train"] == ("failed", 2)
    tries = history.load(ctx, "train").attempts
    assert [a.failure_class for a in tries] == ["oom", "oom"]
    decision = decide(ctx.spec.recovery, "oom", {"1": "oom", "2": "oom"}, try_number=2)
    assert not decision.retry and "out-of-memory failure 2 is over its budget of 1" in decision.reason
    assert "recovery.policy.oom.retries" in decision.reason


@pytest.mark.e2e
def test_a_user_error_fails_at_once_and_a_corrupted_checkpoint_is_quarantined(airflow_db, digits_raw, tmp_path):
    faults = [{"kind": "corrupt", "step": 35, "rank": 0, "on_try": 1}, {"kind": "error", "step": 60, "on_try": 2}]
    dr, ctx = run_spec_dag(tmp_path, lambda d: _fast(d, faults), conf={"rehearsal": True}, name="gate")
    assert str(dr.state) == "failed"
    assert _task_states(dr)["train"] == ("failed", 2)  # the bug is not retried (user_code budget 0)
    tries = history.load(ctx, "train").attempts
    assert [a.failure_class for a in tries] == ["lost", "user_code"]  # a SIGKILL without a record: a lost rank
    # The newest committed checkpoint at step 35, step 30's (the fault waits for the save in flight), was
    # damaged on disk; the next try's gate moved it aside and resumed from the one before (the epoch end).
    quarantined = list((ctx.work_dir / "checkpoints" / "quarantine").iterdir())
    assert len(quarantined) == 1
    reason = json.loads((quarantined[0] / "QUARANTINED.json").read_text())
    assert "sha256 does not match" in reason["reason"] and reason["step"] == 30
    assert (quarantined[0] / "model.pt").exists()  # nothing deleted
    assert tries[1].resumed_step is not None and 20 <= tries[1].resumed_step < 30


# --- the policy and the spec, in process ----------------------------------------------------------------


@pytest.mark.unit
def test_policy_delays_back_off_per_class_and_preemption_waits_for_nothing():
    rec = RecoverySpec.model_validate({"retry_delay_seconds": 5, "policy": {"communication": {"retries": 4}}})
    delays = [decide(rec, "communication", {str(i): "communication" for i in range(1, n + 1)}, try_number=n)
              .delay_seconds for n in (1, 2, 3)]
    assert delays == [5, 10, 20]
    assert decide(rec, "preempted", {"1": "preempted"}, try_number=1).delay_seconds == 0
    assert not decide(rec, "data", {"1": "data"}, try_number=1).retry
    assert not decide(rec, "unknown", {"1": "unknown", "2": "unknown"}, try_number=2).retry


@pytest.mark.unit
def test_the_policy_is_the_one_writer_of_a_tasks_failures_and_an_unseen_try_counts_once():
    from ballast.errors import LaunchError
    from ballast.recovery.policy import FAILURES_KEY, StageRetryPolicy, decide_unseen

    class Store(dict):
        def set(self, key, value):
            self[key] = value

    def classes(store):
        return {k: v["class"] for k, v in store[FAILURES_KEY].items()}

    store = Store()
    policy = StageRetryPolicy({"policy": {"oom": {"retries": 1}}}, "train")
    exc = LaunchError("x", failure_class="oom")
    exc.step_reached = 17  # what the train stage adds from the try's record
    policy.evaluate(exc, 1, 5, {"task_state_store": store})
    assert classes(store) == {"1": "oom"} and store[FAILURES_KEY]["1"]["step"] == 17
    # The next try finds try 1 unrecorded: the policy's class stands, and the budget is as the policy left it.
    assert decide_unseen(policy.recovery, store, 1, "lost").retry and classes(store) == {"1": "oom"}
    # Try 2's task process was killed: counted now, and over oom's budget of 1.
    assert not decide_unseen(policy.recovery, store, 2, "oom").retry and classes(store) == {"1": "oom", "2": "oom"}
    assert decide_unseen(policy.recovery, None, 1, "preempted").retry  # outside a task: decided, nothing kept
    # A store written before failures carried their time and step (bare classes) still counts.
    old = Store({FAILURES_KEY: {"1": "oom"}})
    assert not decide_unseen(policy.recovery, old, 2, "oom").retry


def _failures(*entries) -> dict:
    """The store's failures from (class, seconds ago, step reached) per try, try 1 first."""
    return {str(i): {"class": c, "at": 1_000_000.0 - ago, "step": step} for i, (c, ago, step) in enumerate(entries, 1)}


@pytest.mark.unit
def test_the_infrastructures_classes_have_no_count_but_a_rate_an_hour():
    rec = RecoverySpec()
    assert rec.of("lost").retries is None and rec.of("lost").per_hour == 30
    # 100 lost ranks over ~4 days, each try training further: every one retried.
    spread = _failures(*[("lost", 3600 * (99 - i), 100 * (i + 1)) for i in range(100)])
    d = decide(rec, "lost", spread, try_number=100, now=1_000_000.0)
    assert d.retry and d.delay_seconds == 0 and "lost rank failure 100 in this task, at most 30 an hour" in d.reason
    # 31 within the last hour (counted by hand: one every 100 s), still training further each time: over.
    fast = _failures(*[("lost", 100.0 * (30 - i), 10 * (i + 1)) for i in range(31)])
    d = decide(rec, "lost", fast, try_number=31, now=1_000_000.0)
    assert not d.retry and "31 lost rank failures within the last hour, over the 30 allowed" in d.reason
    assert "recovery.policy.lost.per_hour" in d.reason
    # Those older than an hour do not count: the same 31, the first 3,700 s ago.
    fast["1"]["at"] = 1_000_000.0 - 3700
    assert decide(rec, "lost", fast, try_number=31, now=1_000_000.0).retry
    # A class with a count keeps it; a user's count on an infrastructure class adds to its rate.
    assert not decide(rec, "user_code", _failures(("user_code", 0, 5)), try_number=1).retry
    counted = RecoverySpec.model_validate({"policy": {"preempted": 2}})
    assert counted.of("preempted").per_hour == 30
    assert not decide(counted, "preempted", _failures(*[("preempted", 9000 * i, 10 * i) for i in (3, 2, 1)]),
                      try_number=3, now=1_000_000.0).retry


@pytest.mark.unit
def test_tries_that_stop_advancing_fail_the_task_after_stalled_tries():
    rec = RecoverySpec()  # stalled_tries: 3
    # Steps reached 500, then 480, 500, 300: three tries in a row none past 500.
    stuck = _failures(("lost", 4000, 500), ("hang", 3000, 480), ("lost", 2000, 500), ("communication", 1000, 300))
    d = decide(rec, "communication", stuck, try_number=4, now=1_000_000.0)
    assert not d.retry and "the last 3 tries made no progress (none trained past step 500)" in d.reason
    assert "recovery.stalled_tries" in d.reason
    # One of them past 500 resets the count; a try that died before its first step made none.
    stuck["3"]["step"] = 501
    assert decide(rec, "communication", stuck, try_number=4, now=1_000_000.0).retry
    never = _failures(("lost", 300, None), ("lost", 200, None), ("lost", 100, None))
    d = decide(rec, "lost", never, try_number=3, now=1_000_000.0)
    assert not d.retry and "none trained at all" in d.reason
    assert decide(RecoverySpec(stalled_tries=4), "lost", never, try_number=3, now=1_000_000.0).retry


@pytest.mark.unit
def test_a_class_without_a_count_needs_a_rate():
    d = example_data()
    d["recovery"] = {"policy": {"hang": {"retries": None, "per_hour": None}}}
    with pytest.raises(SpecError, match=r"bad\.yaml: recovery\.policy\.hang\.retries: null needs per_hour \(a class with no count"):
        parse_spec(d, source="bad.yaml")


@pytest.mark.unit
@pytest.mark.parametrize("recovery,pattern", [
    ({"policy": {"gpu_melted": 2}}, r"recovery\.policy\.gpu_melted: unknown key 'gpu_melted'; must be one of 'oom'"),
    ({"policy": {"oom": -1}}, r"recovery\.policy\.oom\.retries: must be >= 0 \(got -1\)"),
    ({"policy": {"oom": {"retries": 1, "delay": 3}}}, r"recovery\.policy\.oom\.delay: unknown key 'delay'"),
])
def test_bad_recovery_policies_are_one_line_errors(recovery, pattern):
    d = example_data()
    d["recovery"] = recovery
    with pytest.raises(SpecError, match=pattern) as err:
        parse_spec(d, source="bad.yaml")
    assert len(err.value.problems) == 1 and "\n" not in err.value.problems[0]


@pytest.mark.unit
@pytest.mark.parametrize("rehearsal,pattern", [
    ({"faults": [{"kind": "crash", "step": 500}], "max_steps": 100},
     r"training\.rehearsal\.faults\[0\]\.step: 500 is past the end of training \(max_steps 100\)"),
    ({"faults": [{"kind": "crash", "step": 5, "on_try": 30}], "recovery": {"retries": 16}},
     r"training\.rehearsal\.faults\[0\]\.on_try: try 30 never comes: the train task has at most 17 tries"),
    ({"faults": [{"kind": "crash"}]}, r"training\.rehearsal\.faults\[0\]\.step: give a fault either a step or seconds"),
    ({"faults": [{"kind": "melt", "step": 3}]}, r"training\.rehearsal\.faults\[0\]\.kind: must be one of"),
])
def test_bad_rehearsal_faults_are_one_line_errors(rehearsal, pattern):
    d = example_data()
    rehearsal = dict(rehearsal)
    if "recovery" in rehearsal:  # a count on every class: the task's tries are bounded
        d["recovery"] = rehearsal.pop("recovery")
    d["training"]["rehearsal"] = rehearsal
    with pytest.raises(SpecError, match=pattern):
        parse_spec(d, source="bad.yaml")


@pytest.mark.unit
def test_rehearsal_faults_add_a_trigger_parameter_off_by_default():
    from ballast.pipeline.plan import build_plan

    d = example_data()
    d["training"]["rehearsal"] = {"faults": [{"kind": "oom", "step": 5}]}
    params = {p.key: p for p in build_plan(parse_spec(d), spec_file="x").params}
    assert params["rehearsal"].default is False and params["rehearsal"].path == "training.rehearsal.enabled"
    assert "rehearsal" not in {p.key for p in build_plan(parse_spec(example_data()), spec_file="x").params}


@pytest.mark.unit
def test_preflight_refuses_a_disk_without_room_for_two_checkpoints_as_hardware(tmp_path):
    import shutil
    from types import SimpleNamespace

    import torch

    from ballast.training.failure import TrainingFailure
    from ballast.training.preflight import run_checks, state_bytes

    model = torch.nn.Linear(10, 10)
    opt = torch.optim.AdamW(model.parameters())
    assert state_bytes(model, opt) == 3 * 110 * 4  # weights + Adam's two moments (not created yet)
    rank0 = SimpleNamespace(device=torch.device("cpu"), enabled=False, rank=0, local_rank=0, world=1)
    assert run_checks(rank0, checkpoint_dir=tmp_path / "ckpt", need_bytes=1000)["free_bytes"] > 0
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(TrainingFailure, match=rf"preflight failed on host {socket.gethostname()} \(rank 0\):"
                                              r" .*ckpt: .* GB free, 2 checkpoints") as err:
        run_checks(rank0, checkpoint_dir=tmp_path / "ckpt", need_bytes=free)
    assert err.value.failure_class == "hardware"


# --- early stop in rounds ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_rounds_become_task_groups_with_a_test_evaluate_that_outlives_skipped_rounds():
    from ballast.pipeline.plan import build_plan

    d = example_data()
    d["training"].update(epochs=30, rounds=3)
    plan = build_plan(parse_spec(d), spec_file="x")
    ups = {s.name: s.upstream for s in plan.stages}
    assert list(ups) == ["validate", "convert", "warm_cache",
                         "round_1.train", "round_1.verify_checkpoint", "round_1.evaluate",
                         "round_2.train", "round_2.verify_checkpoint", "round_2.evaluate",
                         "round_3.train", "round_3.verify_checkpoint", "round_3.evaluate", "evaluate", "publish"]
    assert ups["round_2.train"] == ("round_1.evaluate",)
    assert ups["evaluate"] == ("round_1.evaluate", "round_2.evaluate", "round_3.evaluate")
    by = {s.name: s for s in plan.stages}
    assert by["evaluate"].trigger_rule == "none_failed_min_one_success" and by["round_2.evaluate"].module == "evaluate_round"
    one = build_plan(parse_spec(example_data()), spec_file="x")
    assert [s.name for s in one.stages] == ["validate", "convert", "warm_cache", "train", "verify_checkpoint",
                                             "evaluate", "publish"]  # rounds: 1 is today's DAG


@pytest.mark.unit
def test_rounds_that_do_not_divide_the_epochs_are_refused():
    d = example_data()
    d["training"].update(epochs=30, rounds=4)
    with pytest.raises(SpecError, match=r"training\.rounds: 4 does not divide epochs 30; every round trains the same"
                                        r" number of epochs: use one of 1, 2, 3, 5, 6, 10, 15, 30"):
        parse_spec(d, source="bad.yaml")


@pytest.mark.e2e
def test_early_stop_skips_the_later_rounds_and_publish_still_runs(airflow_db, digits_raw, tmp_path):
    def edit(d):
        _fast(d, [])
        d["training"].update(epochs=6, rounds=3)
        d["evaluation"].update(patience=1, min_delta=0.5)  # nothing improves by 0.5: stop after epoch 2

    dr, ctx = run_spec_dag(tmp_path, edit, name="rounds")
    states = {k: v[0] for k, v in _task_states(dr).items()}
    assert str(dr.state) == "success", states
    assert states["round_1.train"] == states["round_1.evaluate"] == "success"
    assert {states[f"round_{k}.{t}"] for k in (2, 3) for t in ("train", "verify_checkpoint", "evaluate")} == {"skipped"}
    assert states["evaluate"] == states["publish"] == "success"
    first = ctx.result("evaluate_round")
    assert first.round == 1 and first.stop and "evaluation.patience 1" in first.reason and first.epochs_trained == 2
    report = ctx.report()
    assert report.training.epochs == 2 and report.training.stopped_early


# --- publish if better, warm start ------------------------------------------------------------------------


@pytest.mark.e2e
def test_publish_if_better_both_ways_and_a_warm_start_from_the_published_model(airflow_db, digits_raw, tmp_path):
    def run(tag: str, *, lr: float, epochs: int, warm: bool = False):
        def edit(d):
            _fast(d, [])
            d["training"].update(epochs=epochs, learning_rate=lr)
            d["evaluation"].update(publish="if_better", warm_start=warm)
        dr, ctx = run_spec_dag(tmp_path / tag, edit, name="registry")
        assert str(dr.state) == "success", _task_states(dr)
        return ctx.result("publish"), ctx

    barely, _ = run("a", lr=1e-6, epochs=1)  # the first model of the pipeline is published, however weak
    assert barely.published and barely.reason == "the first published model of the pipeline"
    good, ctx = run("b", lr=0.003, epochs=4)
    assert good.published and "beats the published model " + barely.published_version in good.reason
    assert good.value > barely.value
    worse, ctx = run("c", lr=1e-6, epochs=1)
    assert not worse.published and worse.published_version == good.published_version
    assert f"does not beat the published model {good.published_version}" in worse.reason
    assert ctx.storage.read_bytes("models/registry/LATEST").decode().strip() == good.published_version
    assert not ctx.report().published and ctx.result("evaluate").baseline.value == pytest.approx(good.value)
    # A warm start begins at the published model: one epoch at a learning rate that changes nothing keeps
    # its accuracy, where the same epoch from a random start (run c) stays near chance.
    warm, ctx = run("d", lr=1e-6, epochs=1, warm=True)
    assert ctx.result("train").warm_started_from == good.published_version
    assert warm.value == pytest.approx(good.value, abs=0.02) and warm.value > worse.value + 0.3
    card = json.loads(ctx.storage.read_bytes(f"models/registry/{good.published_version}/model_card.json"))
    assert card["lineage"]["warm_started_from"] is None and card["lineage"]["dataset_id"]


# --- the verification gate ----------------------------------------------------------------------------------


def _checkpoint(root, step: int, weights):
    from ballast.training import checkpoint as ckpt

    w = ckpt.Writer(root, step, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", weights)
    w.write_json("trainer.json", {"step": step})
    return w.commit()


@pytest.mark.unit
def test_the_gate_quarantines_what_fails_and_the_one_before_takes_its_place(tmp_path):
    import torch

    from ballast.training import checkpoint as ckpt
    from ballast.training.checkpoint import gate

    good = _checkpoint(tmp_path, 10, {"w": torch.ones(3)})
    nan = _checkpoint(tmp_path, 20, {"w": torch.tensor([1.0, float("nan"), 2.0])})
    probed = _checkpoint(tmp_path, 30, {"w": torch.ones(3)})
    logged = []
    # A forward pass that diverges on step 30's weights; step 20 holds a NaN; step 10 passes.
    probe = lambda path: float("inf") if path.name == probed.name else 0.5  # noqa: E731
    assert gate.latest_passing(tmp_path, probe=probe, log=logged.append) == good
    reasons = {q["checkpoint"]: q["reason"] for q in gate.quarantined(tmp_path)}
    assert set(reasons) == {"step-00000020", "step-00000030"}
    assert "non-finite values in w" in reasons["step-00000020"]
    assert "a forward pass on a held-out batch gives loss inf" in reasons["step-00000030"]
    assert (tmp_path / "quarantine" / "step-00000020" / "model.pt").exists()  # moved, not deleted
    assert [p.name for p in ckpt.committed(tmp_path)] == ["step-00000010"] and len(logged) == 2
    # The step must not go back behind what an earlier stage verified: older checkpoints stay put.
    assert gate.latest_passing(tmp_path, min_step=15, log=logged.append) is None
    assert good.exists()
    w = ckpt.Writer(tmp_path, 40, rank=0, barrier=lambda: None)  # committed with another step inside
    w.begin()
    w.write_tensors("model.pt", {"w": torch.ones(3)})
    w.write_json("trainer.json", {"step": 12})
    with pytest.raises(ckpt.CheckpointFailure, match="trainer.json records step 12, the directory says 40"):
        gate.check(w.commit())


@pytest.mark.unit
def test_a_save_that_failed_because_a_peer_went_away_is_communication_not_bad_data(tmp_path):
    from ballast.training.checkpoint.saver import AsyncSaver
    from ballast.training.failure import CheckpointFailure, TrainingFailure

    saver = AsyncSaver.__new__(AsyncSaver)
    saver._thread, saver.idle, saver.root = None, False, tmp_path
    saver._error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error"
                                " [127.0.0.1]:32678: Connection reset by peer")
    with pytest.raises(TrainingFailure, match="checkpoint save failed") as err:
        saver.wait()
    assert err.value.failure_class == "communication" and not isinstance(err.value, CheckpointFailure)
    saver._error = OSError(28, "No space left on device")
    with pytest.raises(CheckpointFailure):
        saver.wait()


@pytest.mark.unit
def test_a_group_restart_inside_a_try_counts_its_work_lost_and_restart(tmp_path):
    """torchrun's restart after a rank killed outright is no new Airflow try, but it costs the work since
    the checkpoint it resumed from and its restart: the attempt and the run's summary count both."""

    out, ckpt_dir = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir(), ckpt_dir.mkdir()
    t = 1000.0
    evs = [("preflight", 0, t + 1), ("first_step", 1, t + 2), ("checkpoint", 50, t + 3), ("step", 60, t + 3.5),
           # rank 1 SIGKILLed at ~t+4; the group restarts and resumes from step 50
           ("preflight", 0, t + 5), ("resume", 50, t + 5.2), ("first_step", 51, t + 5.5), ("step", 100, t + 9)]
    (out / "metrics.jsonl").write_text("".join(
        json.dumps({"event": e, "step": s, "time": at, "rank": 0}) + "\n" for e, s, at in evs))
    attempt = history.begin(1, settings={}, adaptation=[]).model_copy(update={"started": t})
    done = history.finish(attempt, out, ckpt_dir, outcome="success", ended=t + 10)
    assert done.group_restarts == 1 and done.group_restart_lost_seconds == 2.5  # t+3 (the state) to t+5.5
    assert done.lost_seconds == 2.5
    summary = RecoverySummary.of([AttemptHistory(task_id="train", attempts=[done])])
    assert summary.group_restarts == 1 and summary.lost_seconds == 2.5 and summary.effective_ratio == 0.75
    failed = history.finish(attempt, out, ckpt_dir, outcome="failed", failure_class="oom", ended=t + 10)
    # Failed at t+10 with no commit since the restart: the work since the last group's first step is lost too.
    assert failed.lost_seconds == 2.5 + 4.5


@pytest.mark.unit
def test_a_group_restart_counts_from_the_save_it_resumed_not_a_later_save_of_the_same_step(tmp_path):
    """CI's planner run: the group resumed from an anomaly checkpoint at step 209 and at once saved step 209
    again; the later save made its restart look free (0.5 s lost where the wall clock lost ~1.3 s). And a
    group that restarted before any checkpoint lost everything since the try's first step."""
    out, ckpt_dir = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir(), ckpt_dir.mkdir()
    t = 1000.0
    evs = [("first_step", 1, t + 1), ("step", 5, t + 1.5),
           # killed at ~t+2 before any checkpoint: the new group starts from scratch
           ("first_step", 1, t + 3), ("checkpoint", 209, t + 4), ("step", 210, t + 4.2),
           # killed at ~t+4.3: the group resumes from step 209 and re-saves it (an anomaly checkpoint)
           ("resume", 209, t + 5), ("checkpoint", 209, t + 5.4), ("first_step", 210, t + 5.5), ("step", 300, t + 9)]
    (out / "metrics.jsonl").write_text("".join(
        json.dumps({"event": e, "step": s, "time": at, "rank": 0}) + "\n" for e, s, at in evs))
    attempt = history.begin(1, settings={}, adaptation=[]).model_copy(update={"started": t})
    done = history.finish(attempt, out, ckpt_dir, outcome="success", ended=t + 10)
    assert done.group_restarts == 2 and done.group_restart_lost_seconds == 2.0 + 1.5  # t+1 to t+3; t+4 to t+5.5


@pytest.mark.unit
def test_a_restarted_groups_warm_up_counts_as_lost_once_its_work_is_kept(tmp_path):
    """After a restart the first steps are slow (the writer process, loader workers and page cache start
    again: 0.5-1 s a group on this machine), which a report that stopped counting at the first step left
    out: ~10 s of a two-minute run under kills every 10 s. Computed by hand: steady pace 0.05 s a step
    (six of the seven gaps between step events), the group's first 59 steps took 3.5 s, 2.95 at that pace."""
    out, ckpt_dir = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir(), ckpt_dir.mkdir()
    t = 1000.0
    evs = [("resume", 100, t + 0.5), ("first_step", 101, t + 1.0), ("step", 110, t + 2.0), ("step", 120, t + 2.5),
           ("step", 130, t + 3.0), ("step", 140, t + 3.5), ("step", 150, t + 4.0), ("step", 160, t + 4.5),
           ("checkpoint", 160, t + 4.55), ("checkpoint_written", 160, t + 4.7), ("step", 170, t + 5.0)]
    (out / "metrics.jsonl").write_text("".join(
        json.dumps({"event": e, "step": s, "time": at, "rank": 0}) + "\n" for e, s, at in evs))
    second = history.begin(2, settings={}, adaptation=[]).model_copy(update={"started": t})
    done = history.finish(second, out, ckpt_dir, outcome="success", ended=t + 6)
    assert done.warmup_lost_seconds == pytest.approx(3.5 - 59 * 0.05)
    assert done.lost_seconds == pytest.approx(1.0 + 0.55)  # the restart to the first step, then the warm-up
    # The run's own start is no fault's cost: a first try's first group is not counted.
    first = history.finish(second.model_copy(update={"try_number": 1}), out, ckpt_dir, outcome="success", ended=t + 6)
    assert first.warmup_lost_seconds == 0 and first.lost_seconds == 0
    # No commit after the warm-up (a save began, never committed): the group's work was not kept, and the
    # next restart counts it as lost.
    (out / "metrics.jsonl").write_text("".join(json.dumps({"event": e, "step": s, "time": at, "rank": 0}) + "\n"
                                               for e, s, at in evs if e != "checkpoint_written"))
    assert history.finish(second, out, ckpt_dir, outcome="success", ended=t + 6).warmup_lost_seconds == 0


@pytest.mark.e2e
@pytest.mark.alone  # the lost time it predicts is measured: a test beside it takes half the cores
def test_the_planner_predicts_what_a_run_with_random_kills_loses(tmp_path):
    """`ballast plan`'s model (Daly's, fed with the run's own failure rate, checkpoint interval, save and
    restart costs) against the ratio a run through Airflow measured with rank kills at random times (the
    time each kill lost, from the attempt history). No clean run: a wall-time ratio against one is within
    the machine's noise on a run this short; the kills are spread over the first 18 s of training (one in
    each 6 s), those after its end missed."""
    r = bench_in_a_process(tmp_path, "goodput", "planner_check(mtbf=6, epochs=60, horizon=18)", timeout=600)
    print(json.dumps({k: r[k] for k in ("measured_ratio", "planner", "kills")}), r["report"]["effective_ratio"])
    assert r["kills"] >= 1 and r["report"]["group_restarts"] >= 1, r
    assert r["planner"]["predicted_ratio"] == pytest.approx(r["report"]["effective_ratio"], abs=0.05), r
