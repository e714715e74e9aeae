"""The embedded default: run a pipeline end to end on this machine through Airflow's dag.test().

Airflow's metadata lives in SQLite under a project-local AIRFLOW_HOME; data, checkpoints and models
under BALLAST_HOME. Environment defaults are set before Airflow is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def configure_env(root: Path | None = None) -> Path:
    """Project-local defaults for Airflow and Ballast; values already in the environment win."""
    root = (root or Path.cwd()).resolve()
    defaults = {
        "BALLAST_HOME": root / ".ballast",
        "AIRFLOW_HOME": root / ".airflow",
        "AIRFLOW__CORE__DAGS_FOLDER": root / "dags",
        "AIRFLOW__CORE__PLUGINS_FOLDER": root / "plugins",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "GX_ANALYTICS_ENABLED": "False",
        "TQDM_DISABLE": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, str(value))
    return root


def migrate_db() -> None:
    proc = subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"airflow db migrate failed (exit {proc.returncode}); AIRFLOW_HOME={os.environ['AIRFLOW_HOME']}")


def load_dag(dag_id: str):
    """Parse dags/, fail on import errors, serialize the DAGs to the DB and return the one asked for."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    bag = DagBag(os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    if bag.import_errors:
        for path, err in bag.import_errors.items():
            print(f"import error in {path}:\n{err}", file=sys.stderr)
        raise SystemExit(1)
    if dag_id not in bag.dags:
        raise SystemExit(f"no DAG {dag_id!r}; found: {', '.join(sorted(bag.dags))}")
    DagBundlesManager().sync_bundles_to_db()  # the dags-folder bundle row the DAG rows point at
    sync_bag_to_db(bag, bundle_name="dags-folder", bundle_version=None)
    return bag.dags[dag_id]


def run_dag(dag_id: str, conf: dict[str, Any] | None = None):
    """dag.test() with run parameters. A conf that breaks a parameter's bounds is refused by Airflow's
    Params before any task runs; its multi-line jsonschema message becomes the spec's one line."""
    from airflow.sdk.exceptions import ParamValidationError

    dag = load_dag(dag_id)
    try:
        return dag.test(run_conf=conf or {})
    except ParamValidationError as exc:
        from ballast.errors import SpecError
        from ballast.pipeline.runner import effective_spec

        spec_file = next((t.spec_file for t in dag.tasks if hasattr(t, "spec_file")), dag_id)
        spec_data = next(t.spec_data for t in dag.tasks if hasattr(t, "spec_data"))
        effective_spec(spec_data, spec_file, conf or {})  # raises the one-line SpecError
        raise SpecError(f"{spec_file}: run parameters refused: {str(exc).splitlines()[0]}") from None


def _coerce(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def write_example_data(spec_name: str, dest: Path) -> Path:
    """The raw data an example spec of dags/specs reads, written where it expects it."""
    from ballast.data import demo

    writers = {"digits": demo.write_digits,
               "lm": lambda dest: demo.write_corpus(dest, max_mb=4),
               "segmentation": lambda dest: demo.write_segmentation(dest, rows=512, size=32)}
    if spec_name not in writers:
        raise SystemExit(f"{dest}: no raw data for the {spec_name} spec; write it first (ballast data --help)")
    return writers[spec_name](dest)


def run_demo(spec_name: str = "digits", conf: dict[str, str] | None = None, *, verbose: bool = False) -> int:
    root = configure_env()
    from ballast.spec import apply_overrides, load_spec
    from ballast.storage import open_storage, resolve_local

    spec_path = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"]) / "specs" / f"{spec_name}.yaml"
    if not spec_path.is_file():
        names = sorted(p.stem for p in spec_path.parent.glob("*.yaml"))
        raise SystemExit(f"ballast demo --spec {spec_name}: no {spec_path}; the example specs are {', '.join(names)}")
    spec = load_spec(spec_path)
    params = {k: _coerce(v) for k, v in (conf or {}).items()}
    # Refused here, before Airflow creates a run: an unknown name (a typo would train with the default)
    # or a value outside a field's bounds, each as one line (SpecError; the CLI prints it, exit 2).
    apply_overrides(spec, params, source=f"{spec_path} (--conf)")
    raw = resolve_local(spec.dataset.location)
    if not raw.exists():
        print(f"writing the {spec_name} example data to {write_example_data(spec_name, raw)}")
    t0 = time.monotonic()
    storage = open_storage(spec.storage.uri, spec.storage.conn_id)
    log_path = Path(os.environ["AIRFLOW_HOME"]) / "logs" / f"demo-{spec.name}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    if verbose:
        migrate_db()
        dr = run_dag(spec.dag_id, params)
    else:
        from ballast.dev.demo_console import StageWatcher, output_to

        print(f"running {spec.dag_id} through Airflow (dag.test); Airflow's full log: {log_path}")
        runs = storage.local_path(f"runs/{spec.dag_id}")
        with output_to(log_path) as console:
            watcher = StageWatcher(runs, console, started=time.time()) if runs is not None else None
            if watcher is not None:
                watcher.start()
            try:
                migrate_db()
                dr = run_dag(spec.dag_id, params)
            finally:
                if watcher is not None:
                    watcher.stop()
    from ballast.pipeline.context import RunContext

    ctx = RunContext(spec=spec, dag_id=spec.dag_id, run_id=dr.run_id)
    print()
    print(f"DAG run {dr.run_id}: {dr.state} in {time.monotonic() - t0:.0f}s (AIRFLOW_HOME={os.environ['AIRFLOW_HOME']})")
    if str(dr.state) != "success" or not storage.exists(ctx.report_key):
        where = os.environ["AIRFLOW_HOME"] + "/logs" if verbose else log_path
        print(f"the run did not succeed; see {where}", file=sys.stderr)
        return 1
    report = ctx.report()
    print(f"model:       {report.model}")
    print(f"model card:  {report.model_card}")
    print(f"checkpoints: {report.checkpoints}")
    print(f"report:      {storage.describe(ctx.report_key)}")
    t, tr = report.test, report.training
    print(f"final metric: test {t.metric} = {t.value:.4f} on {t.test_rows} held-out rows "
          f"({tr.epochs} epochs{', stopped early' if tr.stopped_early else ''})")
    if not verbose:
        print(f"Airflow's log: {log_path}")
    del root
    return 0
