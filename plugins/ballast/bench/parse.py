"""`ballast bench parse`: DAG-parse time of N generated specs, and the heavy modules parsing imports.

Each repetition runs in a fresh interpreter (a cold parse, as the DAG processor sees it): it first
imports Airflow and its DagBag (reported apart), then times DagBag over a folder holding the thin DAG
file and N specs derived from the example. Target: 50 specs in < 1.5 s beyond importing Airflow,
and none of torch, great_expectations, petastorm, pyspark, boto3, kubernetes imported.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ballast.bench.measure import target

HEAVY = ("torch", "great_expectations", "petastorm", "pyspark", "boto3", "kubernetes")

_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import airflow, airflow.sdk
from airflow.dag_processing.dagbag import DagBag
t1 = time.perf_counter()
bag = DagBag(sys.argv[1])
t2 = time.perf_counter()
heavy = sorted(m for m in %r if m in sys.modules)
print(json.dumps({"airflow_import_s": t1 - t0, "parse_s": t2 - t1, "dags": len(bag.dags),
                  "import_errors": {k: v[:300] for k, v in bag.import_errors.items()}, "heavy": heavy}))
""" % (HEAVY,)


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def make_specs(dest: Path, n: int) -> None:
    """The thin DAG file plus n specs: the example with a new name and varied settings."""
    import yaml

    root = _repo_root()
    shutil.copy(root / "dags" / "ballast_pipelines.py", dest / "ballast_pipelines.py")
    (dest / "specs").mkdir()
    base = yaml.safe_load((root / "dags" / "specs" / "digits.yaml").read_text())
    for i in range(n):
        spec = json.loads(json.dumps(base))
        spec["name"] = f"bench_{i:04d}"
        spec["training"]["learning_rate"] = 0.001 * (1 + i % 7)
        spec["training"]["model"] = "mlp" if i % 2 else "cnn"
        spec["schedule"] = {"cron": f"{i % 60} {i % 24} * * *"} if i % 3 else {"asset": f"s3://bench-bucket/raw/{i}"}
        (dest / "specs" / f"bench_{i:04d}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def bench_parse(*, specs: int = 50, repeat: int = 3) -> dict:
    runs = []
    with tempfile.TemporaryDirectory(prefix="ballast-bench-parse-") as tmp:
        dags = Path(tmp) / "dags"
        dags.mkdir()
        make_specs(dags, specs)
        env = dict(os.environ, AIRFLOW__CORE__LOAD_EXAMPLES="False",
                   AIRFLOW_HOME=os.environ.get("AIRFLOW_HOME", str(Path(tmp) / "airflow")))
        for _ in range(repeat):
            out = subprocess.run([sys.executable, "-c", _PROBE, str(dags)], capture_output=True, text=True, env=env,
                                 check=False)
            if out.returncode != 0:
                raise RuntimeError(f"parse probe failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    parse = statistics.median(r["parse_s"] for r in runs)
    heavy = sorted({m for r in runs for m in r["heavy"]})
    return {
        "benchmark": "parse",
        "specs": specs,
        "repeat": repeat,
        "dags_loaded": runs[0]["dags"],
        "import_errors": runs[0]["import_errors"],
        "airflow_import_s": {"median": statistics.median(r["airflow_import_s"] for r in runs),
                             "all": [round(r["airflow_import_s"], 4) for r in runs]},
        "parse_s": {"median": parse, "all": [round(r["parse_s"], 4) for r in runs]},
        "per_spec_ms": round(parse / max(specs, 1) * 1000, 3),
        "heavy_modules_imported": heavy,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "targets": {
            "parse_seconds_beyond_airflow_import": target(round(parse, 4), 1.5),
            "heavy_modules_imported": {"value": heavy, "target": "none", "met": not heavy},
            "all_specs_loaded": {"value": runs[0]["dags"], "target": f"== {specs}", "met": runs[0]["dags"] == specs},
        },
    }
