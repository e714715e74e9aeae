"""Scale planner (`ballast plan`): what failures cost a spec's run at N GPUs, and the checkpoint interval to use.

Failure model: the job's MTTF falls as a power law in its GPU count, fitted through two published points:
7.9 h at 1,024 GPUs and 1.8 h at 16,384 GPUs (Meta RSC; Kokolis et al. 2024, "Revisiting Reliability in
Large-Scale Machine Learning Research Clusters"), so MTTF(N) = 7.9 h x (N / 1024)^-alpha with
alpha = ln(7.9 / 1.8) / ln(16) ~ 0.53. These are defaults to replace with your own cluster's measurements,
not facts about it: `--mttf-hours` (at the given GPUs) or `--mttf-reference HOURS@GPUS` (repeatable) set them.

Costs: C, the training time one checkpoint save blocks (with the async saver, the snapshot, not the write);
R, a restart (detection + relaunch, the retry delay included + checkpoint load + first step).

Goodput: Daly's exponential model (Daly 2006, "A higher order estimate of the optimum checkpoint interval
for restart dumps"): with failures at rate 1/M, one segment of tau seconds' work plus a save costs
T(tau) = M e^(R/M) (e^((tau+C)/M) - 1) of wall time on average, so the effective training time ratio is
tau / T(tau), valid for any tau. Its maximum does not depend on R: it is the one root of
tau = M (1 - e^(-(tau+C)/M)) in (0, M), found by bisection and shown beside the closed forms (Young
sqrt(2CM); Daly first order sqrt(2CM) - C; Daly higher order).

No Airflow here: pure functions and frozen dataclasses, and `run` for the command line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ballast.errors import BallastError

REF_HOURS, REF_GPUS = 7.9, 1024  # Meta RSC, Kokolis et al. 2024
ALPHA = math.log(7.9 / 1.8) / math.log(16384 / 1024)
ASSUMED_SAVE_SECONDS, ASSUMED_RESTART_SECONDS = 1.0, 60.0
WARN_EXHAUST = 0.01
# What random failures at scale end a try with: a rank or node lost (no failure record), a GPU or host
# fault, a broken link, a stuck collective, a record-less ending nothing explains.
RANDOM_FAILURE_CLASSES = ("lost", "hardware", "communication", "hang", "unknown")


class PlanError(BallastError):
    """A planner flag or measured-run file is unusable."""


@dataclass(frozen=True)
class FailureModel:
    """Job MTTF(N) = ref_hours x (N / ref_gpus)^-alpha."""

    ref_hours: float = REF_HOURS
    ref_gpus: float = REF_GPUS
    alpha: float = ALPHA

    def mttf_hours(self, gpus: int) -> float:
        return self.ref_hours * (gpus / self.ref_gpus) ** -self.alpha

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> FailureModel:
        """Through one (hours, gpus) point with the default exponent, or a log-log least-squares fit of several."""
        if len({g for _, g in points}) < 2:
            return cls(points[0][0], points[0][1])
        xs, ys = [math.log(g) for _, g in points], [math.log(h) for h, _ in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return cls(math.exp(my), math.exp(mx), -slope)


@dataclass(frozen=True)
class Costs:
    """C and R, in seconds, and where each came from (a flag, a measured run, or assumed)."""

    save_seconds: float
    restart_seconds: float
    save_source: str = "assumed"
    restart_source: str = "assumed"


def parse_reference(text: str) -> tuple[float, float]:
    """`7.9@1024` -> (7.9 hours, 1024 GPUs)."""
    hours, sep, gpus = text.partition("@")
    try:
        pair = float(hours), float(gpus)
    except ValueError:
        pair = ()
    if not sep or not pair or not all(math.isfinite(v) and v > 0 for v in pair):
        raise PlanError(f"--mttf-reference: expected HOURS@GPUS with both > 0, e.g. 7.9@1024 (got {text!r})")
    return pair


def measured_costs(path: str | Path) -> Costs:
    """C and R of a measured run: a JSON file (or a run directory's report.json) with `save_blocked_seconds`
    and `restart_seconds`. The run report's attempt history is to provide them; re-point this reader then."""
    path = Path(path)
    path = path / "report.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        save, restart = float(data["save_blocked_seconds"]), float(data["restart_seconds"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise PlanError(f"--from-run: {path}: need a JSON object with numbers save_blocked_seconds and"
                        f" restart_seconds ({type(exc).__name__}: {exc})") from exc
    where = f"measured, {path}"
    return Costs(_non_negative("--from-run save_blocked_seconds", save),
                 _non_negative("--from-run restart_seconds", restart), where, where)


def _non_negative(flag: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise PlanError(f"{flag}: must be a finite number >= 0 (got {value})")
    return value


# --- checkpoint interval and goodput ---------------------------------------------------------------------


def closed_forms(save: float, mttf: float) -> dict[str, float]:
    """The closed-form intervals: Young (1974), Daly (2006) first order (C < M/2) and higher order (C < 2M), else M."""
    root = math.sqrt(2 * save * mttf)
    return {"young": root, "daly_first_order": root - save if save < mttf / 2 else mttf,
            "daly_higher_order": root * (1 + math.sqrt(save / (2 * mttf)) / 3 + save / (18 * mttf)) - save
            if save < 2 * mttf else mttf}


def predict_ratio(mttf_seconds: float, interval_seconds: float, save_seconds: float, restart_seconds: float) -> float:
    """Expected effective training time ratio (useful training time / wall time) under Daly's exponential model."""
    m, tau, c, r = mttf_seconds, interval_seconds, save_seconds, restart_seconds
    if tau + c == 0:
        return math.exp(-r / m)  # the limit of free, continuous saves
    try:
        return tau / (m * math.exp(r / m) * math.expm1((tau + c) / m))
    except OverflowError:
        return 0.0


def optimal_interval(mttf_seconds: float, save_seconds: float) -> float:
    """The interval maximising `predict_ratio` (independent of R): the root of h(tau) = M(1 - e^-(tau+C)/M) - tau,
    which falls strictly from h(0) >= 0 to h(M) < 0."""
    m, c = mttf_seconds, save_seconds
    lo, hi = 0.0, m
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if -m * math.expm1(-(mid + c) / m) - mid > 0 else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


# --- retries ---------------------------------------------------------------------------------------------


def retry_ceiling(recovery: Any) -> int | None:
    """Random failures a run survives: its tries (1 + the budgets of the classes a lost node, a crashed
    rank or a bad link end with, capped by the task's retry ceiling) times (1 + torchrun restarts per
    try), less one. None where those classes have no count (`retries: null`: bounded per hour,
    `hourly_ceiling`) and the task's `recovery.retries` sets none."""
    counts = [recovery.of(c).retries for c in RANDOM_FAILURE_CLASSES]
    if None in counts and recovery.retries is None:
        return None
    budget = sum(n if n is not None else recovery.ceiling for n in counts)
    tries = 1 + min(budget, recovery.ceiling)
    return tries * (1 + recovery.max_restarts) - 1


def hourly_ceiling(recovery: Any) -> int | None:
    """Random failures within one hour a run survives where their classes are bounded per hour: the
    tightest class's tries an hour (per_hour, plus the try that goes on), each absorbing torchrun's
    restarts, less one (a conservative figure: every failure counted against the tightest class)."""
    rates = [recovery.of(c).per_hour for c in RANDOM_FAILURE_CLASSES if recovery.of(c).retries is None]
    if not rates:
        return None
    return (int(min(rates)) + 1) * (1 + recovery.max_restarts) - 1


def p_exhaust(recovery: Any, failures_per_hour: float, hours: float) -> float:
    """The chance that random failures (Poisson, `failures_per_hour`) end a run of `hours` through its
    recovery budgets: more than `retry_ceiling` in the run, or more than `hourly_ceiling` in one of its
    hours (the hours taken as independent windows)."""
    p = 0.0
    ceiling = retry_ceiling(recovery)
    if ceiling is not None:
        p = p_more_than(failures_per_hour * hours, ceiling)
    hourly = hourly_ceiling(recovery)
    if hourly is not None:
        p_hour = p_more_than(failures_per_hour, hourly)
        p = 1.0 - (1.0 - p) * (1.0 - p_hour) ** max(1.0, hours)
    return p


def p_more_than(mean: float, k: int) -> float:
    """P(N > k) for N ~ Poisson(mean)."""
    term = total = math.exp(-mean)
    for i in range(1, k + 1):
        term *= mean / i
        total += term
    return max(0.0, 1.0 - total)


# --- the plan --------------------------------------------------------------------------------------------


def make_plan(spec: Any, gpus: int, mttf_hours: float, model: str, costs: Costs, hours: float,
              step_seconds: float | None = None) -> dict[str, Any]:
    """Every figure `ballast plan` prints, as plain data (what `--json` writes)."""
    m, c, r = mttf_hours * 3600, costs.save_seconds, costs.restart_seconds
    ckpt = spec.training.checkpoint
    spec_tau, how = ckpt.every_seconds, "every_seconds"
    if ckpt.every_steps is not None and step_seconds is not None:
        spec_tau, how = min(spec_tau, ckpt.every_steps * step_seconds), f"every_steps x {step_seconds:g} s"
    elif ckpt.every_steps is not None:
        how = f"every_seconds; every_steps {ckpt.every_steps} not counted: give --step-seconds"
    best = optimal_interval(m, c)
    ceiling, hourly, mean = retry_ceiling(spec.recovery), hourly_ceiling(spec.recovery), hours * 3600 / m
    exhaust = p_exhaust(spec.recovery, 3600 / m, hours)
    closed = closed_forms(c, m)
    return {
        "spec": spec.name, "gpus": gpus, "mttf_hours": mttf_hours, "failure_model": model,
        "failures_per_day": 86400 / m, "save_seconds": c, "restart_seconds": r,
        "save_source": costs.save_source, "restart_source": costs.restart_source,
        "asynchronous_saves": ckpt.asynchronous,
        "optimal_interval_seconds": best, "optimal_ratio": predict_ratio(m, best, c, r),
        "closed_form_intervals_seconds": closed,
        "closed_form_ratios": {k: predict_ratio(m, v, c, r) for k, v in closed.items()},
        "spec_interval_seconds": spec_tau, "spec_interval_from": how, "spec_ratio": predict_ratio(m, spec_tau, c, r),
        "run_hours": hours, "expected_failures_in_run": mean, "retry_ceiling": ceiling,
        "hourly_retry_ceiling": hourly, "p_exhaust_retries": exhaust, "warn": exhaust > WARN_EXHAUST,
    }


def format_plan(p: dict[str, Any]) -> str:
    cf = p["closed_form_intervals_seconds"]
    rows = [
        ("failure model", f"MTTF {p['mttf_hours']:.3g} h at {p['gpus']:,} GPUs ({p['failure_model']})"),
        ("failures per day", f"{p['failures_per_day']:.3g}"),
        ("save cost C", f"{p['save_seconds']:g} s blocked per save ({p['save_source']})"),
        ("restart cost R", f"{p['restart_seconds']:g} s ({p['restart_source']})"),
        ("best interval", f"{p['optimal_interval_seconds']:.0f} s, ratio {p['optimal_ratio']:.4f}"
                          f" (Young {cf['young']:.0f} s, Daly {cf['daly_first_order']:.0f} s,"
                          f" Daly higher order {cf['daly_higher_order']:.0f} s)"),
        ("spec interval", f"{p['spec_interval_seconds']:.0f} s, ratio {p['spec_ratio']:.4f}"
                          f" ({p['spec_interval_from']})"),
        ("retry ceiling", ", ".join(
            [*([f"{p['retry_ceiling']} failures"] if p["retry_ceiling"] is not None else []),
             *([f"{p['hourly_retry_ceiling']} failures an hour"] if p["hourly_retry_ceiling"] is not None else [])])
         + f"; a {p['run_hours']:g} h run expects {p['expected_failures_in_run']:.3g},"
           f" P(over) = {p['p_exhaust_retries']:.2%}"),
    ]
    lines = [f"ballast plan: {p['spec']}"] + [f"  {k:<17} {v}" for k, v in rows]
    if p["warn"]:
        lines.append(f"  WARNING: {p['p_exhaust_retries']:.2%} chance the run exhausts its retries"
                     f" (> {WARN_EXHAUST:.0%}); raise the recovery.policy budgets (per_hour, retries) of lost, hardware,"
                     f" communication, hang and unknown, or shorten the run")
    return "\n".join(lines)


def run(args: Any) -> int:
    """`ballast plan`: check the flags (one line naming the bad one), plan, print, write `--json`."""
    from ballast.spec import load_spec

    if args.gpus < 1:
        raise PlanError(f"--gpus: must be >= 1 (got {args.gpus})")
    for flag in ("mttf_hours", "hours", "step_seconds"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise PlanError(f"--{flag.replace('_', '-')}: must be a number > 0 (got {value})")
    if args.mttf_hours is not None and args.mttf_reference:
        raise PlanError("--mttf-hours: give it or --mttf-reference, not both")
    refs = [parse_reference(text) for text in args.mttf_reference]
    fm = FailureModel.fit(refs) if refs else FailureModel()
    mttf = args.mttf_hours or fm.mttf_hours(args.gpus)
    model = ("--mttf-hours" if args.mttf_hours else "fit of --mttf-reference" if refs else "Meta RSC power law")
    model += "" if args.mttf_hours else f": {fm.ref_hours:.3g} h x (N / {fm.ref_gpus:g})^-{fm.alpha:.3f}"
    costs = measured_costs(args.from_run) if args.from_run else Costs(ASSUMED_SAVE_SECONDS, ASSUMED_RESTART_SECONDS)
    if args.save_seconds is not None:
        costs = replace(costs, save_seconds=_non_negative("--save-seconds", args.save_seconds), save_source="flag")
    if args.restart_seconds is not None:
        costs = replace(costs, restart_seconds=_non_negative("--restart-seconds", args.restart_seconds),
                        restart_source="flag")
    plan = make_plan(load_spec(args.spec), args.gpus, mttf, model, costs, args.hours, args.step_seconds)
    print(format_plan(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan, indent=2) + "\n")
    return 0
