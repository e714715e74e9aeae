"""The stability view's training curves: the event log's tail at its exact steps, after the trainer's
bounded history of the whole run (`ballast.training.curves`) for the steps before the tail, with the
anomaly and resume marks of both (the history keeps those the log's lost head had)."""

from __future__ import annotations

import math
from typing import Any

from ballast.ui.reader import Reader

MAX_POINTS = 2000  # per curve: a longer tail is thinned evenly (spikes are always kept)


def steps_of(events: list[dict]) -> list[dict]:
    """Rank 0's step events, the last one of each step (a resumed try logs the steps after its
    checkpoint again), in step order."""
    last: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "step" and e.get("rank", 0) == 0:
            last[e["step"]] = e
    return [last[k] for k in sorted(last)]


def curve_history(r: Reader) -> Any:
    """The trainer's bounded history of the whole run's curves (`training.curves`), or None (a run from
    before it, or one not training yet: no notice for a history that is not there)."""
    from ballast.training.curves import CURVES, parse_history

    name = f"train/{CURVES}"
    data = r.raw(name)
    if data is None:
        if r.states.get(name) == "missing":
            del r.states[name]
        return None
    history = parse_history(data)
    if history is None:
        r.states[name], r.problems[name] = "corrupt", "not a curve history"
    return history


SERIES = (("loss", "loss"), ("grad_norm", "grad_norm"), ("learning_rate", "lr"), ("loss_scale", "loss_scale"))
BANDS = ("loss", "grad_norm")  # drawn with their per-bucket min and max around the mean


def curves(events: list[dict], history: Any = None) -> dict[str, Any]:
    """The curves: the log's tail at its exact steps (thinned evenly to MAX_POINTS), after the history's
    buckets for the steps before the tail (their mean, with min and max as a band); the anomalies and
    resumes of both, one mark per step and kind."""
    steps = steps_of(events)
    spikes: dict[tuple, dict] = {}  # every rank logs an anomaly it sees: one mark per step and kind
    for e in events:
        if e.get("event") == "anomaly":
            kind = e.get("kind") if isinstance(e.get("kind"), str) else None  # a damaged line draws a mark of no kind
            mark = {"step": e["step"], "kind": kind, "loss": finite(e.get("loss")), "zscore": finite(e.get("zscore"))}
            spikes.setdefault((e["step"], kind), mark)
    resumes = [e["step"] for e in events if e.get("event") == "resume"]
    keep = thin(len(steps), MAX_POINTS)
    pts = [steps[i] for i in keep]
    tail_from = steps[0]["step"] if steps else None
    # The buckets that start before the tail (the last one may reach into it: drawn before the tail's first step).
    buckets = history.buckets(before=tail_from) if history is not None else []
    xs = [(b["first"] + min(b["last"], tail_from - 1 if tail_from is not None else b["last"])) // 2 for b in buckets]
    out: dict[str, Any] = {"step": xs + [p["step"] for p in pts],
                           "time": [b["time"] for b in buckets] + [p.get("time") for p in pts]}
    for key, field in SERIES:
        out[key] = [finite((b.get(field) or {}).get("mean")) for b in buckets] + [finite(p.get(field)) for p in pts]
    out["band"] = {key: {"min": [finite((b.get(key) or {}).get("min")) for b in buckets] + out[key][len(buckets):],
                         "max": [finite((b.get(key) or {}).get("max")) for b in buckets] + out[key][len(buckets):]}
                   for key in BANDS}
    if history is not None:
        for m in history.anomalies.items:
            mark = {"step": m.get("step"), "kind": m.get("kind"), "loss": finite(m.get("loss")),
                    "zscore": finite(m.get("zscore"))}
            spikes.setdefault((mark["step"], mark["kind"]), mark)
        resumes = sorted({*resumes, *(m["step"] for m in history.resumes.items if isinstance(m.get("step"), int))})
    logged = len(steps)
    if history is not None:  # the history's steps, and the tail's past them
        logged = history.steps + sum(1 for p in steps if p["step"] > history.last_step)
    out.update({"spikes": sorted(spikes.values(), key=lambda m: m["step"]), "points": logged,
                "shown": len(pts) + len(buckets), "resumes": resumes,
                "history": {"buckets": len(buckets), "span": history.span, "steps": history.steps,
                            "tail_from": tail_from} if buckets else None})
    return out


def finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def thin(n: int, most: int) -> list[int]:
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})
