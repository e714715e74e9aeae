"""The scale planner (`ballast plan`): the failure model, Young/Daly intervals, Daly's goodput model, the CLI."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from ballast.dev import scale_plan as planner
from ballast.dev.cli import main
from ballast.dev.scale_plan import FailureModel, PlanError, closed_forms, optimal_interval, predict_ratio

pytestmark = pytest.mark.unit

SPEC = str(Path(__file__).resolve().parents[1] / "dags" / "specs" / "digits.yaml")


def test_power_law_hits_both_published_points():
    model = FailureModel()
    assert model.mttf_hours(1024) == pytest.approx(7.9, rel=1e-12)
    assert model.mttf_hours(16384) == pytest.approx(1.8, rel=1e-12)
    assert model.alpha == pytest.approx(math.log(7.9 / 1.8) / math.log(16))
    assert model.mttf_hours(4096) < model.mttf_hours(1024)


def test_fit_through_references_recovers_the_default_and_one_point_keeps_the_exponent():
    fitted = FailureModel.fit([(7.9, 1024), (1.8, 16384)])
    assert fitted.mttf_hours(2048) == pytest.approx(FailureModel().mttf_hours(2048), rel=1e-9)
    one = FailureModel.fit([(10.0, 512)])
    assert one.mttf_hours(512) == 10.0 and one.alpha == planner.ALPHA


@pytest.mark.parametrize("save, mttf", [(1.0, 7.9 * 3600), (10.0, 1.8 * 3600), (30.0, 24 * 3600)])
def test_numeric_optimum_matches_the_closed_forms_where_saves_are_cheap(save, mttf):
    best = optimal_interval(mttf, save)
    closed = closed_forms(save, mttf)
    assert best == pytest.approx(closed["daly_higher_order"], rel=0.05)
    assert best == pytest.approx(closed["daly_first_order"], rel=0.05)
    assert best == pytest.approx(math.sqrt(2 * save * mttf), rel=0.05)  # Young


@pytest.mark.parametrize("mttf, save, restart", [(3600, 5, 60), (600, 60, 120), (7.9 * 3600, 1, 60), (100, 150, 10)])
def test_numeric_optimum_beats_half_and_double_the_interval(mttf, save, restart):
    best = optimal_interval(mttf, save)
    ratio = predict_ratio(mttf, best, save, restart)
    for other in (best / 2, best * 2, best * 0.9, best * 1.1):
        assert ratio >= predict_ratio(mttf, other, save, restart)


def test_ratio_falls_with_mttf_and_with_restart_cost():
    ratios = [predict_ratio(hours * 3600, 600, 2, 60) for hours in (24, 8, 2, 0.5)]
    assert ratios == sorted(ratios, reverse=True) and 0 < ratios[-1] < ratios[0] < 1
    assert predict_ratio(3600, 600, 2, 300) < predict_ratio(3600, 600, 2, 30)
    assert predict_ratio(60, 1e6, 1, 1) == 0.0  # overflow is no goodput, not an error


def test_ratio_matches_a_simulated_run():
    """Daly's model, simulated: work tau then save C; a failure (exponential, mean M) loses the segment and
    costs a restart R (which a failure can interrupt too)."""
    rng, (m, tau, c, r), segments, wall = random.Random(0), (1000.0, 300.0, 20.0, 90.0), 20_000, 0.0
    for _ in range(segments):
        while (t := rng.expovariate(1 / m)) < tau + c:
            wall += t
            while (t := rng.expovariate(1 / m)) < r:
                wall += t
            wall += r
        wall += tau + c
    assert segments * tau / wall == pytest.approx(predict_ratio(m, tau, c, r), rel=0.02)


def test_retry_ceiling_and_poisson_odds():
    from ballast.spec import RecoverySpec

    # The default budgets of the random failures' classes have no count: bounded an hour, the tightest
    # (hardware, hang: 6 tries an hour) taken for all, each try absorbing torchrun's 3 restarts.
    assert planner.retry_ceiling(RecoverySpec()) is None
    assert planner.hourly_ceiling(RecoverySpec()) == (6 + 1) * (1 + 3) - 1
    assert planner.hourly_ceiling(RecoverySpec(max_restarts=0)) == 6
    assert planner.retry_ceiling(RecoverySpec(retries=2)) == 3 * 4 - 1  # the task's ceiling caps the tries
    counted = RecoverySpec.model_validate({"max_restarts": 0, "policy": {
        "lost": 2, "hardware": 1, "communication": 1, "hang": 1, "unknown": 4}})
    assert planner.retry_ceiling(counted) == 9 and planner.hourly_ceiling(counted) is None
    mean = 3.0
    assert planner.p_more_than(mean, 2) == pytest.approx(1 - math.exp(-mean) * (1 + mean + mean**2 / 2))
    assert planner.p_more_than(0.0, 0) == 0.0
    # Over a run: more than the count in the whole run, or more than the hourly bound in one of its hours.
    assert planner.p_exhaust(counted, 0.5, 10) == pytest.approx(planner.p_more_than(5.0, 9))
    p_hour = planner.p_more_than(2.0, 27)
    assert planner.p_exhaust(RecoverySpec(), 2.0, 720) == pytest.approx(1 - (1 - p_hour) ** 720)


def test_measured_costs_reads_a_report_or_its_directory(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"save_blocked_seconds": 0.4, "restart_seconds": 42}))
    for where in (tmp_path, tmp_path / "report.json"):
        costs = planner.measured_costs(where)
        assert (costs.save_seconds, costs.restart_seconds) == (0.4, 42.0) and "measured" in costs.save_source
    (tmp_path / "bad.json").write_text(json.dumps({"save_blocked_seconds": 1}))
    with pytest.raises(PlanError, match="--from-run: .*restart_seconds"):
        planner.measured_costs(tmp_path / "bad.json")


@pytest.mark.parametrize("gpus, mttf", [(1024, 7.9), (16384, 1.8)])
def test_cli_prints_the_figures_and_writes_json(gpus, mttf, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", SPEC, "--gpus", str(gpus), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"MTTF {mttf:g} h at {gpus:,} GPUs" in text and "(assumed)" in text
    figures = json.loads(out.read_text())
    assert figures["mttf_hours"] == pytest.approx(mttf)
    assert figures["failures_per_day"] == pytest.approx(24 / mttf)
    # digits: no count on the random failures' classes; hardware and hang 6 tries an hour, 3 restarts each
    assert figures["retry_ceiling"] is None and figures["hourly_retry_ceiling"] == 27
    assert figures["spec_interval_seconds"] == 3600.0
    assert figures["optimal_ratio"] > figures["spec_ratio"]
    p_hour = planner.p_more_than(1 / mttf, 27)
    expected = 1 - (1 - p_hour) ** figures["run_hours"]
    assert figures["p_exhaust_retries"] == pytest.approx(expected) and not figures["warn"] and "WARNING" not in text


def test_cli_warns_when_the_budgets_would_end_the_run(tmp_path, capsys):
    import yaml

    spec = yaml.safe_load(Path(SPEC).read_text())
    spec["recovery"] = {"max_restarts": 0, "policy": {c: 1 for c in ("lost", "hardware", "communication", "hang")}}
    f = tmp_path / "counted.yaml"
    f.write_text(yaml.safe_dump(spec))
    assert main(["plan", str(f), "--gpus", "16384"]) == 0
    text = capsys.readouterr().out
    assert "retry ceiling     5 failures;" in text and "WARNING" in text and "per_hour" in text


def test_cli_flags_and_measured_run_set_the_costs(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"save_blocked_seconds": 0.5, "restart_seconds": 45}))
    out = tmp_path / "plan.json"
    argv = ["plan", SPEC, "--gpus", "8", "--mttf-hours", "100", "--from-run", str(report), "--restart-seconds",
            "30", "--step-seconds", "0.5", "--hours", "2", "--json", str(out)]
    assert main(argv) == 0
    figures = json.loads(out.read_text())
    assert (figures["save_seconds"], figures["restart_seconds"]) == (0.5, 30.0)
    assert figures["restart_source"] == "flag" and "measured" in figures["save_source"]
    assert figures["spec_interval_seconds"] == 20.0  # every_steps 40 x 0.5 s
    assert figures["warn"] is False and "WARNING" not in capsys.readouterr().out


@pytest.mark.parametrize("flags, named", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "8", "--save-seconds", "-1"], "--save-seconds"),
    (["--gpus", "8", "--restart-seconds", "nan"], "--restart-seconds"),
    (["--gpus", "8", "--mttf-hours", "0"], "--mttf-hours"),
    (["--gpus", "8", "--mttf-reference", "7.9"], "--mttf-reference"),
    (["--gpus", "8", "--mttf-reference", "x@1024"], "--mttf-reference"),
    (["--gpus", "8", "--mttf-reference", "7.9@-2"], "--mttf-reference"),
    (["--gpus", "8", "--mttf-hours", "3", "--mttf-reference", "7.9@1024"], "--mttf-hours"),
    (["--gpus", "8", "--from-run", "/nonexistent/report.json"], "--from-run"),
])
def test_cli_bad_flags_give_one_line_and_exit_2(flags, named, capsys):
    assert main(["plan", SPEC, *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ballast plan: {named}") and captured.out == ""


def test_the_goodput_check_counts_a_kill_after_the_last_step_as_no_failure(monkeypatch):
    """The planner check's inputs from a run with three kills: two that training came back from (2 s each
    to the next step) and one after the last step, while the ranks were finishing. The failure rate is the
    run's two failures, not three. (A kill that finds no rank is sent again, never missed: fault_process.)"""
    from ballast.bench import goodput

    evs = [{"event": "checkpoint", "time": t / 2, "blocked_seconds": 0.01} for t in range(41)]  # 0 to 20 s
    evs += [{"event": "first_step", "time": t, "step": s} for t, s in ((0.0, 1), (7.0, 11), (14.0, 21))]
    monkeypatch.setattr(goodput, "events", lambda out: sorted(evs, key=lambda e: e["time"]))
    run = {"out": "unused", "kills": [{"time": 5.0, "step": 10}, {"time": 12.0, "step": 20},
                                      {"time": 20.5, "step": 30}],
           "report": {"attempts": [{"attempts": [{"try_number": 1}]}], "recovery": {"failures_by_class": {}}}}
    got = goodput._planner_prediction(run, wall=21.0)
    assert got["mttf_seconds"] == 10.5 and got["restart_seconds"] == 2.0
    assert (got["checkpoint_interval_seconds"], got["save_blocked_seconds"]) == (0.5, 0.01)
    assert got["predicted_ratio"] == round(predict_ratio(10.5, 0.5, 0.01, 2.0), 4)
