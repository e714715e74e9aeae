"""`ballast bench scale`: data larger than memory through the data stages, measured at two sizes.

The validate, convert and evaluate stages run as a user's pipeline runs them (`module.run(ctx)` on a
RunContext of a digits-like spec: 16x16 float32 images, 1 KiB a row, the example's validation rules),
each in a fresh process of its own per size, on 1x and 10x the rows. Per stage and size: the rows it
handled, the bytes behind them, the seconds of `run` alone (the stage's heavy libraries are imported
before the clock starts) and the process's peak resident set (VmHWM from /proc: the child's own peak;
ru_maxrss of a child carries the forking parent's peak over the exec).

Targets: peak RSS at 10x <= 1.2x the peak at 1x, and rows per second at 10x >= 0.8x those at 1x, for
each of the three stages. Between the measured children an unmeasured one warms the node-local cache
and writes a committed checkpoint of the spec's (untrained) model for evaluate to score.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ballast.bench.measure import target

STAGES = ("validate", "convert", "evaluate")
EVALUATE_RUNS = 3
"""Evaluate is timed this many times at each size, the sizes alternating, and its median run taken: at 1x it
scores ~45k rows in 0.2-0.35 s, where one run's hiccup moved its rows/s ratio from 1.85 to 0.80 (two runs,
the same code). Validate and convert run for seconds even at 1x, and once each."""
SHAPE = (16, 16)
_EXAMPLE = Path(__file__).resolve().parents[3] / "dags" / "specs" / "digits.yaml"
_PRELOAD = {"validate": ("pandas", "pyarrow.parquet", "great_expectations"),
            "convert": ("pandas", "pyarrow.parquet"),
            "evaluate": ("pandas", "pyarrow.parquet", "torch", "jsonschema")}
"""What each stage imports when it runs, imported before its clock starts (import time is not throughput)."""


def scale_spec(root: Path) -> Any:
    """The example spec on root/raw, its storage and cache under root; no publish gate (the model scored
    is untrained); Petastorm shards of 10,000 rows in row groups of 1,000; 45% of the rows held out for
    test (the most a spec allows), so that evaluate's 1x is large beside its fixed costs."""
    import yaml

    from ballast.spec import parse_spec

    d = yaml.safe_load(_EXAMPLE.read_text())
    d["dataset"]["location"] = str(root / "raw")
    d["dataset"]["fields"][0]["shape"] = list(SHAPE)
    d["dataset"]["split"].update(validation=0.05, test=0.45)
    d["conversion"].update(formats=["petastorm"], shard_rows=10_000, row_group_rows=1_000)
    d["storage"]["uri"] = str(root / "storage")
    d["cache"]["directory"] = str(root / "cache")
    d["evaluation"]["threshold"] = None
    return parse_spec(d)


def peak_rss_bytes() -> int:
    """This process's own peak resident set (VmHWM), in bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


def _context(root: Path) -> Any:
    from ballast.pipeline.context import RunContext

    return RunContext(spec=scale_spec(root), dag_id="bench_scale", run_id="scale")


def _prepare_evaluate(ctx: Any, root: Path) -> None:
    """The node-local cache warmed (every phase) and a committed checkpoint of the spec's model, recorded
    as verify_checkpoint's best: what the evaluate stage reads."""
    from ballast.launch.config import run_config
    from ballast.records import CheckedCheckpoint, VerifyResult
    from ballast.stages import warm_cache
    from ballast.training import checkpoint as ckpt
    from ballast.training.models import build_configured_model

    ctx.save_result("warm_cache", warm_cache.run(ctx))
    warm_cache.warm_rest(ctx)
    cache = ctx.result("warm_cache")
    manifest = json.loads((Path(cache.cache_dir) / "manifest.json").read_text())
    section = run_config(ctx.spec, data_dir=cache.cache_dir, data_format=cache.format, checkpoint_dir=".",
                         output_dir=".", manifest=manifest).model
    w = ckpt.Writer(root / "checkpoints", 1, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", build_configured_model(section).state_dict())
    w.write_json("trainer.json", {"step": 1, "epoch": 1, "history": [], "model": section.model_dump(mode="json")})
    path = w.commit()
    checked = CheckedCheckpoint(path=str(path), step=1, files=3, parameters=1)
    ctx.save_result("verify_checkpoint", VerifyResult(last=checked, best=checked))


def _measured(ctx: Any, stage: str) -> dict[str, Any]:
    """Run one stage and return its figures: rows, bytes, seconds, peak RSS."""
    import importlib

    for name in _PRELOAD[stage]:
        importlib.import_module(name)
    module = importlib.import_module(f"ballast.stages.{stage}")
    t0 = time.perf_counter()
    record = module.run(ctx)
    seconds = time.perf_counter() - t0
    ctx.save_result(stage, record)
    if stage == "evaluate":
        cache = ctx.result("warm_cache")
        manifest = json.loads((Path(cache.cache_dir) / "manifest.json").read_text())
        rows = record.test_rows
        nbytes = sum(e["bytes"] for e in manifest["files"] if e["split"] == "test" and e["format"] == cache.format)
    else:
        rows = ctx.result("validate").rows
        nbytes = sum(p.stat().st_size for p in Path(ctx.spec.dataset.location).glob("*.parquet"))
    return {"rows": rows, "bytes": nbytes, "seconds": seconds, "rows_per_second": rows / max(seconds, 1e-9),
            "peak_rss_bytes": peak_rss_bytes()}


def child(kind: str, root: str) -> dict[str, Any]:
    """One process's work: a stage measured, or `prepare` (the cache and checkpoint, unmeasured)."""
    ctx = _context(Path(root))
    if kind == "prepare":
        _prepare_evaluate(ctx, Path(root))
        return {}
    return _measured(ctx, kind)


def _run_child(kind: str, root: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "ballast.bench.scale", "scale-child", kind, str(root)],
                          check=False, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"scale benchmark child {kind} ({root.name}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(rows: int, figures: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The benchmark's JSON from each stage's figures at "1x" and "10x": the raw figures and six targets
    (peak RSS 10x/1x <= 1.2, rows per second 10x/1x >= 0.8, per stage)."""
    targets: dict[str, Any] = {}
    for stage in STAGES:
        one, ten = figures[stage]["1x"], figures[stage]["10x"]
        targets[f"{stage}_peak_rss_10x_vs_1x"] = target(round(ten["peak_rss_bytes"] / one["peak_rss_bytes"], 3), 1.2)
        targets[f"{stage}_rows_per_second_10x_vs_1x"] = target(
            round(ten["rows_per_second"] / one["rows_per_second"], 3), 0.8, lower_is_better=False)
    stages = {s: {size: {**f, "seconds": round(f["seconds"], 3), "rows_per_second": round(f["rows_per_second"])}
                  for size, f in figures[s].items()} for s in STAGES}
    return {
        "benchmark": "scale", "rows_1x": rows, "rows_10x": rows * 10,
        "feature": f"float32 {SHAPE[0]}x{SHAPE[1]} (1 KiB per row) and an int64 label; the example's validation rules",
        "stages": stages,
        "note": ("each stage and size in a fresh process; seconds are the stage's run() alone (its libraries"
                 " imported first); peak_rss_bytes is the process's VmHWM, imports included; validate and"
                 " convert handle the raw rows, evaluate the test split's rows (from the node-local cache)"),
        "targets": targets,
    }


def bench_scale(*, rows: int = 100_000) -> dict[str, Any]:
    """`rows`: the 1x size (10x is ten times it), written in files of rows/4 rows."""
    from ballast.data.demo import write_synthetic

    figures: dict[str, dict[str, dict[str, Any]]] = {s: {} for s in STAGES}
    with tempfile.TemporaryDirectory(prefix="ballast-bench-scale-") as tmp:
        roots = {"1x": Path(tmp) / "1x", "10x": Path(tmp) / "10x"}
        for (size, root), n in zip(roots.items(), (rows, rows * 10)):
            write_synthetic(root / "raw", rows=n, shape=SHAPE, seed=1, rows_per_file=max(1, rows // 4))
        for stage in STAGES:  # a stage at both sizes, then the next: drift on a shared machine hits both alike
            if stage == "evaluate":
                for root in roots.values():
                    _run_child("prepare", root)
            runs: dict[str, list[dict[str, Any]]] = {size: [] for size in roots}
            for _ in range(EVALUATE_RUNS if stage == "evaluate" else 1):  # the sizes alternating
                for size, root in roots.items():
                    runs[size].append(_run_child(stage, root))
            for size, measured in runs.items():
                figures[stage][size] = median_run(measured)
    return summarize(rows, figures)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median seconds (all its figures, from one process), with every run's seconds beside it."""
    median = sorted(runs, key=lambda f: f["seconds"])[len(runs) // 2]
    return {**median, "runs_seconds": [round(f["seconds"], 3) for f in runs]}


if __name__ == "__main__" and len(sys.argv) > 3 and sys.argv[1] == "scale-child":
    print(json.dumps(child(sys.argv[2], sys.argv[3])))
