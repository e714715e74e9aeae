"""`ballast bench scale`'s JSON: six targets (peak RSS and throughput of validate, convert and evaluate at
10x against 1x) beside the raw figures, from the figures its children report (the children themselves
run in `ballast bench scale`, minutes long, not here)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def _fig(rows: int, seconds: float, rss: int) -> dict:
    return {"rows": rows, "bytes": rows * 1100, "seconds": seconds, "rows_per_second": rows / seconds,
            "peak_rss_bytes": rss}


def test_the_json_holds_six_targets_and_the_raw_figures():
    from ballast.bench.scale import STAGES, summarize

    figures = {
        "validate": {"1x": _fig(100, 1.0, 1000), "10x": _fig(1000, 10.0, 1300)},   # RSS 1.3x: missed
        "convert": {"1x": _fig(100, 1.0, 1000), "10x": _fig(1000, 20.0, 1100)},    # half the rate: missed
        "evaluate": {"1x": _fig(15, 0.5, 2000), "10x": _fig(150, 4.0, 2000)},      # both met
    }
    out = summarize(100, figures)
    assert out["benchmark"] == "scale" and (out["rows_1x"], out["rows_10x"]) == (100, 1000)
    assert sorted(out["targets"]) == sorted(f"{s}_{m}_10x_vs_1x" for s in STAGES
                                             for m in ("peak_rss", "rows_per_second"))
    t = out["targets"]
    assert t["validate_peak_rss_10x_vs_1x"] == {"value": 1.3, "target": "<= 1.2", "met": False}
    assert t["validate_rows_per_second_10x_vs_1x"] == {"value": 1.0, "target": ">= 0.8", "met": True}
    assert t["convert_peak_rss_10x_vs_1x"]["met"] is True
    assert t["convert_rows_per_second_10x_vs_1x"] == {"value": 0.5, "target": ">= 0.8", "met": False}
    assert t["evaluate_rows_per_second_10x_vs_1x"] == {"value": 1.25, "target": ">= 0.8", "met": True}
    assert t["evaluate_peak_rss_10x_vs_1x"]["value"] == 1.0
    ev = out["stages"]["evaluate"]["10x"]
    assert ev == {"rows": 150, "bytes": 165000, "seconds": 4.0, "rows_per_second": 38, "peak_rss_bytes": 2000}


def test_evaluate_takes_its_median_run_whole():
    from ballast.bench.scale import median_run

    runs = [_fig(15, 0.5, 2000), _fig(15, 0.2, 2100), _fig(15, 0.3, 1900)]
    assert median_run(runs) == {**_fig(15, 0.3, 1900), "runs_seconds": [0.5, 0.2, 0.3]}
    assert median_run(runs[:1]) == {**runs[0], "runs_seconds": [0.5]}
