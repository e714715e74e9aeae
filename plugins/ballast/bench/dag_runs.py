"""The goodput bench's DAG runs: a fresh Airflow and Ballast home (`home`), and one DAG run of a spec
through `dag.test()` in a process of its own while `fault_process.Chaos` kills ranks (`run`); the
child process is this module's `__main__`. Shared by `goodput` and `kill_trial`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ballast.bench.fault_process import Chaos, first_event_time, heartbeat


def home() -> Path:
    """A fresh Airflow and Ballast home for the runs (this process's environment points at it)."""
    root = Path(tempfile.mkdtemp(prefix="ballast-goodput-"))
    os.environ.update({"AIRFLOW_HOME": str(root / "airflow"), "BALLAST_HOME": str(root / "ballast"),
                       "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "GX_ANALYTICS_ENABLED": "False"})
    from ballast.data.demo import write_digits
    from ballast.dev.dag_run import migrate_db
    from ballast.storage import resolve_local

    migrate_db()
    write_digits(resolve_local("raw/digits"))
    return root


def run(root: Path, name: str, spec: dict, *, kill_times: list[float], seed: int,
         budget: float | None = None) -> dict[str, Any]:
    """One DAG run in its own process (killed at `budget` seconds of training, if given)."""
    import yaml

    dags = root / name / "dags"
    (dags / "specs").mkdir(parents=True, exist_ok=True)
    (dags / "specs" / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    repo_dags = Path(__file__).resolve().parents[3] / "dags" / "ballast_pipelines.py"
    (dags / "pipelines.py").write_text(repo_dags.read_text())  # the thin DAG file (Airflow's safe mode reads it)
    runs_dir = Path(os.environ["BALLAST_HOME"]) / "storage" / "runs" / f"ballast_{name}"
    chaos = Chaos(runs_dir, kill_times, seed)
    chaos.start()
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "ballast.bench.dag_runs", str(dags), f"ballast_{name}"],
                            stdout=open(root / f"{name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    stopped = False
    while proc.poll() is None:
        time.sleep(0.5)
        out = chaos.out()
        first = first_event_time(out, "first_step") if out else None
        if budget is not None and first is not None and time.time() - first > budget:
            progress = heartbeat(out)
            os.killpg(proc.pid, signal.SIGKILL)
            _kill_training(out)  # torchrun runs in a session of its own
            stopped = True
            break
    proc.wait()
    chaos.stop.set()
    out = chaos.out()
    result: dict[str, Any] = {"name": name, "seconds": round(time.time() - t0, 1), "kills": chaos.kills,
                              "unhit": chaos.unhit,
                              "stopped_at_budget": stopped, "out": str(out) if out else None}
    if stopped:
        result["progress_steps"] = progress
        return result
    report_file = next(runs_dir.glob("*/report.json"), None)
    if report_file is None:
        raise RuntimeError(f"goodput run {name!r} wrote no report (exit {proc.returncode}); see {root / (name + '.log')}")
    result["report"] = json.loads(report_file.read_text())
    return result


def _kill_training(out: Path) -> None:
    try:
        lease = json.loads((out / "lease.json").read_text())
        os.killpg(int(lease["pgid"]), signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass


def _main(dags: str, dag_id: str) -> int:
    """Child process: parse `dags`, sync to the DB, run `dag_id` with dag.test()."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    bag = DagBag(dags)
    if bag.import_errors:
        print(bag.import_errors, file=sys.stderr)
        return 2
    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(bag, bundle_name="dags-folder", bundle_version=None)
    dr = bag.dags[dag_id].test()
    print(f"DAG run {dr.run_id}: {dr.state}")
    return 0 if str(dr.state) == "success" else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2]))
