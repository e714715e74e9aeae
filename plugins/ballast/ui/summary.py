"""What the "Training stability" view shows, read from the records a run already writes.

Everything comes from the run's storage prefix (`runs/<dag>/<run>/`): the stage records, the attempt
history, the trainer's event log (`train/metrics.jsonl`), the heartbeat, the checkpoint markers, the
report. Never from Airflow's metadata database. Each record is read at most `MAX_RECORD_BYTES` (the
event log: its last `MAX_EVENTS_BYTES`), and each is reported with its state: `ok`, `missing` (not
written yet, or never), `partial` (the run is still going, or a line was cut) or `corrupt` (not what the
record's model accepts; `ballast.ui.reader`). A bad record shows as such on the page; it never fails the whole summary.

Pure functions of a `Storage` and a clock: the app (`ballast.ui.app`) caches their results.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

from ballast.pipeline.context import run_key_for_reading
from ballast.records import (
    AttemptHistory,
    ConvertResult,
    EffectiveSpec,
    PublishResult,
    RecoverySummary,
    RunReport,
    StageProgress,
    TrainResult,
    ValidateResult,
    VerifyResult,
    WarmCacheResult,
)
from ballast.storage import Storage
from ballast.ui.curves import MAX_POINTS, curve_history, curves
from ballast.ui.curves import finite as _finite
from ballast.ui.reader import Reader

TRAIN_TASKS = "train"
MAX_LISTED_RUNS = 20_000  # a pipeline page lists its runs' names (one entry each) up to this many


def run_prefix(storage: Storage, dag_id: str, run_id: str) -> str:
    """The run's storage prefix (a run an earlier Ballast wrote: its old one)."""
    return run_key_for_reading(storage, dag_id, run_id)


def run_summary(storage: Storage, dag_id: str, run_id: str, *, now: float | None = None) -> dict[str, Any] | None:
    """The view of one run, or None when storage holds nothing of it (no such run, or not started)."""
    now = time.time() if now is None else now
    prefix = run_prefix(storage, dag_id, run_id)
    if next(storage.list(prefix, limit=1), None) is None:
        return None
    # Small listings only, never a run's checkpoint shards: the stage records, the tries.
    stages = [name for name in storage.list_dir(f"{prefix}/stages/") if not name.endswith("/")]
    attempts = [key[len(prefix) + 1:] for key in storage.list(f"{prefix}/attempts/")]
    r = Reader(storage, prefix)
    report = r.record("report.json", RunReport)
    validate = r.record("stages/validate.json", ValidateResult)
    convert = r.record("stages/convert.json", ConvertResult)
    warm = r.record("stages/warm_cache.json", WarmCacheResult)
    train = r.record(_last_round(stages, "train"), TrainResult)
    verify = r.record(_last_round(stages, "verify_checkpoint"), VerifyResult)
    publish = r.record("stages/publish.json", PublishResult)
    history = _history(r, attempts)
    events = r.jsonl("train/metrics.jsonl")
    stored_curves = curve_history(r)
    heartbeat = _heartbeat(r.raw("train/heartbeat", 256))
    effective = r.record("spec.json", EffectiveSpec)
    spec_data = effective.spec if effective is not None else None
    finished = report is not None
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "status": "finished" if finished else "running or stopped",
        "recovery": _recovery(history, now=None if finished else now),
        "tries": _tries(history),
        "checkpoints": _checkpoints(storage, prefix, verify),
        "curves": curves(events, stored_curves),
        "validation_curve": _validation_curve(events, spec_data),
        "step_time": _step_time(events),
        "progress": _progress(events, heartbeat, history, convert, spec_data, train, now=now, finished=finished),
        "stage_progress": [] if finished else _stage_progress(r, convert, warm, now=now),
        "warm_up": _warm_up(warm, spec_data),
        "validation": _validation(validate, storage, prefix),
        "model": _model(publish, report, train),
        "records": {"states": r.states, "problems": r.problems},
    }


def pipeline_summary(storage: Storage, dag_id: str, *, limit: int = 50) -> dict[str, Any]:
    """Across a pipeline's newest `limit` runs (by the date in their id; ids without one count as
    oldest): the effective ratio and failures of each, and the mean time between failures over them.
    Only those runs' records are read; `total_runs` says how many there are."""
    names = _children(storage, f"runs/{dag_id}/", limit=MAX_LISTED_RUNS)
    rows, histories = [], []
    for run in sorted(names, key=_run_date)[-limit:]:
        prefix = f"runs/{dag_id}/{run}"
        r = Reader(storage, prefix)
        history = _history(r, [key[len(prefix) + 1:] for key in storage.list(f"{prefix}/attempts/")])
        report = r.raw("report.json", 64)  # only whether it exists
        effective = r.record("spec.json", EffectiveSpec)
        run = (effective.run_id if effective is not None else None) or run  # the exact id, for the run's link
        if history is None:
            state = next((v for k, v in r.states.items() if k.startswith("attempts/")), "missing")
            rows.append({"run": run, "state": state, "finished": report is not None})
            continue
        histories.append(history)
        rec = RecoverySummary.of([history])
        first = min((a.started for a in history.attempts), default=None)
        rows.append({"run": run, "state": "ok", "finished": report is not None, "started": first,
                     "ratio": rec.effective_ratio, "tries": rec.tries, "failures": rec.failures_by_class,
                     "group_restarts": rec.group_restarts, "wall_seconds": rec.wall_seconds})
    rows.sort(key=lambda row: (row.get("started") is None, row.get("started") or 0.0, row["run"]))
    total = RecoverySummary.of(histories)
    by_class: dict[str, int] = {}
    for row in rows:
        for cls, n in (row.get("failures") or {}).items():
            by_class[cls] = by_class.get(cls, 0) + n
    return {"dag_id": dag_id, "runs": rows, "total_runs": len(names), "mtbf_seconds": total.mtbf_seconds,
            "failures_by_class": by_class, "effective_ratio": total.effective_ratio if histories else None}


# --- sections ----------------------------------------------------------------------------------------


def _recovery(history: AttemptHistory | None, *, now: float | None) -> dict[str, Any] | None:
    if history is None:
        return None
    attempts = history.attempts
    if now is not None and attempts and attempts[-1].ended is None:  # a try in progress counts up to now
        last = attempts[-1].model_copy(update={"ended": now})
        history = history.model_copy(update={"attempts": [*attempts[:-1], last]})
    s = RecoverySummary.of([history])
    stepped = [a for a in history.attempts if a.first_step_at is not None]
    never = sum(a.lost_seconds for a in history.attempts if a.first_step_at is None)
    restart = sum(a.restart_seconds for a in stepped)
    group = sum(a.group_restart_lost_seconds for a in stepped)
    work = max(0.0, s.lost_seconds - never - restart - group)
    lost = {"restart of a new try": restart, "tries that never reached a step": never, "in-try group restarts": group,
            "work since the last checkpoint": work, "waiting for the retry": s.retry_wait_seconds}
    by_class: dict[str, float] = {}
    for a in history.attempts:
        if a.outcome == "failed":
            key = a.failure_class or "unknown"
            by_class[key] = by_class.get(key, 0.0) + a.lost_seconds
    return {**s.model_dump(), "lost_by_cause": {k: round(v, 3) for k, v in lost.items()},
            "lost_by_class": {k: round(v, 3) for k, v in by_class.items()}}


def _tries(history: AttemptHistory | None) -> list[dict[str, Any]]:
    if history is None:
        return []
    out = []
    for i, a in enumerate(history.attempts):
        nxt = history.attempts[i + 1] if i + 1 < len(history.attempts) else None
        out.append({"try": a.try_number, "outcome": a.outcome if a.ended is not None else "running",
                    "failure_class": a.failure_class, "reason": a.reason, "host": a.host, "exit_code": a.exit_code,
                    "seconds": round(a.seconds, 3), "step_reached": a.step_reached, "resumed_step": a.resumed_step,
                    "lost_seconds": a.lost_seconds, "group_restarts": a.group_restarts, "settings": a.settings,
                    "adaptation_next": nxt.adaptation if nxt is not None else []})
    return out


def _checkpoints(storage: Storage, prefix: str, verify: VerifyResult | None) -> dict[str, Any]:
    """Checkpoint directories with their COMMITTED marker: one marker lookup each, not a listing of
    every shard."""
    base = f"{prefix}/checkpoints/"
    committed = [d for d in _children(storage, base) if d != "quarantine" and storage.exists(f"{base}{d}/COMMITTED")]
    quarantined = [d for d in _children(storage, f"{base}quarantine/")
                   if storage.exists(f"{base}quarantine/{d}/COMMITTED")]
    verified = []
    if verify is not None:
        verified = sorted({verify.last.path.rstrip("/").rsplit("/", 1)[-1], verify.best.path.rstrip("/").rsplit("/", 1)[-1]})
        quarantined = sorted(set(quarantined) | {q.rstrip("/").rsplit("/", 1)[-1] for q in verify.quarantined})
    return {"committed": sorted(committed), "verified": verified, "quarantined": sorted(quarantined)}


def _validation_curve(events: list[dict], spec: dict | None) -> dict[str, Any] | None:
    """The spec's evaluation metric on the validation split, epoch by epoch (the task's metric: accuracy,
    perplexity, mean IoU, RMSE...), from the trainer's epoch events; None before the first epoch."""
    metric = _section(spec, "evaluation").get("metric")
    if not isinstance(metric, str):
        return None
    seen: dict[int, float | None] = {}
    for e in events:
        if e.get("event") == "epoch" and isinstance(e.get("epoch"), int):
            seen[e["epoch"]] = _finite(e.get(metric))  # a resumed epoch logged twice: the last one stands
    if not seen:
        return None
    epochs = sorted(seen)[-MAX_POINTS:]
    return {"metric": metric, "epoch": [k + 1 for k in epochs], "values": [seen[k] for k in epochs]}


def _step_time(events: list[dict]) -> dict[str, Any] | None:
    steps = [e for e in events if e.get("event") == "step" and "compute_s" in e]
    if not steps:
        return None
    split = {k: statistics.median(_finite(e.get(f)) or 0.0 for e in steps)
             for k, f in (("data", "data_s"), ("compute", "compute_s"), ("communication", "comm_opt_s"))}
    total = sum(split.values())
    return {"median_seconds": {k: round(v, 6) for k, v in split.items()},
            "share": {k: round(v / total, 4) if total else None for k, v in split.items()}, "samples": len(steps)}


def _progress(events: list[dict], heartbeat: tuple[int, float] | None, history: AttemptHistory | None,
              convert: ConvertResult | None, spec: dict | None, train: TrainResult | None, *, now: float,
              finished: bool) -> dict[str, Any]:
    total = _planned_steps(convert, spec)
    if train is not None:  # training is over: its record has the last step (the heartbeat is throttled)
        step = train.steps
    elif heartbeat:
        step = heartbeat[0]
    else:
        step = max((e.get("step", 0) for e in events if e.get("event") == "step"), default=0)
    since = max((i for i, e in enumerate(events) if e.get("event") == "resume"), default=-1)
    recent = [e for e in events[since + 1:] if e.get("event") == "step" and e.get("rank", 0) == 0][-20:]
    rate = None
    if len(recent) >= 2 and recent[-1]["time"] > recent[0]["time"] and recent[-1]["step"] > recent[0]["step"]:
        rate = (recent[-1]["step"] - recent[0]["step"]) / (recent[-1]["time"] - recent[0]["time"])
    batch = _section(spec, "training").get("global_batch_size")
    batch = batch if _finite(batch) else None
    current = history.attempts[-1] if history and history.attempts else None
    eta = None
    if not finished and rate and total and step < total:
        eta = round((total - step) / rate, 1)
    return {"step": step, "total": total, "steps_per_second": round(rate, 3) if rate else None,
            "samples_per_second": round(rate * batch, 1) if rate and batch else None, "eta_seconds": eta,
            "current_try": current.try_number if current else None,
            "heartbeat_age_seconds": round(now - heartbeat[1], 1) if heartbeat and not finished else None}


def _stage_progress(r: Reader, convert: ConvertResult | None, warm: WarmCacheResult | None, *,
                    now: float) -> list[dict[str, Any]]:
    """Conversion and warm-up at work: their progress records while no result says they are done (the
    warm-up's later phases: while the result says some are pending)."""
    out = []
    for stage, busy in (("convert", convert is None), ("warm_cache", warm is None or warm.pending_phases > 0)):
        if not busy:
            continue
        name = f"progress/{stage}.json"
        p = r.record(name, StageProgress)
        if r.states.get(name) == "missing":  # not started yet, or an engine that reports none (Spark)
            del r.states[name]
        if p is not None:
            out.append({**p.model_dump(exclude={"version", "started"}), "age_seconds": round(now - p.updated, 1)})
    return out


def _warm_up(warm: WarmCacheResult | None, spec: dict | None) -> dict[str, Any] | None:
    if warm is None:
        return None
    stages = _section(spec, "cache").get("phases") or _section(spec, "cache").get("stages")  # older runs: stages
    planned = [s.get("name") for s in stages if isinstance(s, dict)] if isinstance(stages, list) else []
    return {"phases": [p.model_dump() for p in warm.phases], "pending_phases": warm.pending_phases,
            "planned": planned, "seconds": warm.seconds, "format": warm.format}


def _validation(validate: ValidateResult | None, storage: Storage, prefix: str) -> dict[str, Any] | None:
    if validate is None:
        return None
    docs = validate.data_docs
    rel = docs[len(prefix) + 1:] if docs and docs.startswith(prefix + "/") else None
    return {"rows": validate.rows, "expectations": validate.expectations, "failures": validate.failures,
            "passed": not validate.failures, "data_docs": rel, "quarantine": validate.quarantine is not None}


def _model(publish: PublishResult | None, report: RunReport | None, train: TrainResult | None) -> dict[str, Any] | None:
    if publish is None:
        return None
    return {"version": publish.published_version, "published": publish.published, "reason": publish.reason,
            "metric": publish.metric, "value": publish.value, "model": publish.model,
            "warm_started_from": train.warm_started_from if train else None,
            "dataset": report.stages.convert.dataset_id if report else None,
            "input_fingerprint": report.stages.validate_.input_fingerprint if report else None}


# --- helpers -----------------------------------------------------------------------------------------


def _planned_steps(convert: ConvertResult | None, spec: dict | None) -> int | None:
    t = _section(spec, "training")
    epochs, batch, limit = t.get("epochs"), t.get("global_batch_size"), _section(t, "rehearsal").get("max_steps")
    if convert is None or not all(isinstance(v, int) and v > 0 for v in (epochs, batch)):
        return None
    planned = epochs * max(1, convert.rows.get("train", 0) // batch)
    return min(planned, limit) if isinstance(limit, int) and limit > 0 else planned


def _section(data: Any, name: str) -> dict:
    """`data[name]` when both are mappings, else {}: the effective spec is free-form JSON to this view."""
    section = data.get(name) if isinstance(data, dict) else None
    return section if isinstance(section, dict) else {}


def _heartbeat(data: bytes | None) -> tuple[int, float] | None:
    from ballast.training.outputs import parse_heartbeat

    beat = parse_heartbeat(data)
    return (beat.step, beat.time) if beat is not None else None


def _last_round(stages: list[str], stage: str) -> str:
    """`stages/<stage>.json`, or in a pipeline that trains in rounds the last round's record (`stages`:
    the names in the run's stages/ directory)."""
    rounds = []
    for name in stages:
        head, _, rest = name.partition(".")
        if rest == f"{stage}.json" and head.removeprefix("round_").isdigit():
            rounds.append(int(head.removeprefix("round_")))
    return f"stages/round_{max(rounds)}.{stage}.json" if rounds else f"stages/{stage}.json"


def _history(r: Reader, attempts: list[str]) -> AttemptHistory | None:
    """Every training task's tries as one history, oldest first (one task, or one per round; `attempts`:
    the run's attempts/... names)."""
    names = sorted(n for n in attempts if n.endswith(".json"))
    names = [n for n in names if n.rsplit("/", 1)[-1].removesuffix(".json").split(".")[-1] == TRAIN_TASKS]
    if not names:
        r.states[f"attempts/{TRAIN_TASKS}.json"] = "missing"
        return None
    histories = [h for h in (r.record(n, AttemptHistory) for n in names) if h is not None]
    if not histories:
        return None
    attempts = sorted((a for h in histories for a in h.attempts), key=lambda a: a.started)
    return AttemptHistory(task_id=histories[0].task_id if len(histories) == 1 else TRAIN_TASKS, attempts=attempts)


def _children(storage: Storage, directory: str, *, limit: int | None = None) -> list[str]:
    """The names of a directory's subdirectories: one level (a page per 1000 on S3), not every file below."""
    return [name[:-1] for name in storage.list_dir(directory, limit=limit) if name.endswith("/")]


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}[_:]\d{2}[_:]\d{2}")


def _run_date(name: str) -> tuple[str, str]:
    """A run directory's order: the date in its id (manual__2026-12-04T10_00_00_00_00), then its name."""
    found = _DATE.search(name)
    return (found.group(0).replace(":", "_") if found else "", name)
