"""Plain functions the test modules share: the example spec, stage chains on real files, raw tables,
run configs and training launches. Fixtures live in conftest.py; no test module imports another.

Imported after conftest.py has set the private Airflow and Ballast homes (pytest loads conftest.py
first), so nothing here may be imported outside a pytest session that loaded it."""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from ballast.pipeline.context import RunContext
from ballast.launch.config import run_config
from ballast.records import Record, WarmCacheResult
from ballast.spec import parse_spec
from ballast.stages import warm_cache

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_SPEC = ROOT / "dags" / "specs" / "digits.yaml"
RUN_ID = "manual__2026-01-01T00:00:00+00:00"
# For a LocalStack whose runs a test triggers. No cron runs: unpausing the example DAG would otherwise
# create its latest scheduled run (catchup off still runs the last interval), a whole 30-epoch run the
# test's own runs queue behind (max_active_runs=1). A task checks its heartbeat every second, so a run
# marked failed reaches its task within a second rather than five.
STACK_TEST_ENV = {"AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False", "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1"}

Edit = Callable[[dict], Any]


def example_data() -> dict:
    """The example spec as a fresh dict (each caller may edit its own copy)."""
    return yaml.safe_load(EXAMPLE_SPEC.read_text())


def write_spec(path: Path, edit: Edit | None = None, *, data: dict | None = None) -> Path:
    """Write the example spec to `path`, after `edit(d)` changes the dict in place."""
    d = copy.deepcopy(data or example_data())
    if edit is not None:
        edit(d)
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


# --- the data-side stages on real files, without Airflow ---------------------------------------------

def make_ctx(tmp_path: Path, raw: Path, edit: Edit | None = None, run_id: str = RUN_ID) -> RunContext:
    """A run of the example spec reading `raw`, its storage and cache under `tmp_path`."""
    d = example_data()
    d["dataset"]["location"] = str(raw)
    d["storage"]["uri"] = str(tmp_path / "storage")
    d["cache"]["directory"] = str(tmp_path / "cache")
    if edit:
        edit(d)
    return RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id=run_id)


def raw_table(n: int = 1200, seed: int = 0) -> dict:
    """`n` random 8x8 float images with labels 0-9: enough rows for the example's validation rules."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(0, 16, size=(n, 64)).astype(np.float32)
    labels = rng.integers(0, 10, size=n).astype(np.int64)
    return {"images": images, "labels": labels}


def damaged_rows(n: int = 1200) -> tuple[list[list[float]], list[int], list[int]]:
    """`raw_table(n)`'s images and labels with five bad rows: 3 and 5 (NaN), 9 (out of range), 4 (short)
    and 1 (a label outside 0-9); and those row numbers."""
    t = raw_table(n)
    rows = [list(r) for r in t["images"]]
    labels = t["labels"]
    rows[3][10] = rows[5][0] = float("nan")
    rows[9][0] = 99.0
    rows[4] = rows[4][:60]
    labels[1] = 42
    return rows, labels, [1, 3, 4, 5, 9]


def write_raw(path: Path, images, labels, *, image_type=None) -> Path:
    """One raw Parquet file with the example's columns (image as a list column, label)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    col = pa.array([row.tolist() for row in images], type=image_type or pa.list_(pa.float32()))
    pq.write_table(pa.table({"image": col, "label": pa.array(labels)}), path)
    return path


class warm_cache_rest:  # noqa: N801  (used like a stage module in run_chain)
    """The later warm-up phases, which the train task warms in the background."""

    __name__ = "ballast.stages.warm_cache_rest"

    @staticmethod
    def run(ctx: RunContext) -> WarmCacheResult:
        return warm_cache.warm_rest(ctx)


def run_chain(ctx: RunContext, *stages) -> dict[str, Record]:
    """Run stage modules in order, saving each record as the runner would; {stage name: record}."""
    out = {}
    for module in stages:
        name = module.__name__.rsplit(".", 1)[-1]
        out[name] = module.run(ctx)
        ctx.save_result(name, out[name])
    return out


# --- training processes ------------------------------------------------------------------------------

def config(tmp: Path, cache: WarmCacheResult, *, epochs: int = 2, edit: Edit | None = None,
           changes: dict | None = None) -> Path:
    """A run config from the example spec (after `edit(d)`), with `{"section.field": value}` changes
    written as given, unvalidated: a bad value reaches the trainer's own check."""
    d = example_data()
    d["training"].update(epochs=epochs, processes_per_node=1, global_batch_size=32)
    d["evaluation"]["patience"] = 50
    if edit:
        edit(d)
    cfg = run_config(parse_spec(d), data_dir=cache.cache_dir, data_format=cache.format,
                     checkpoint_dir=str(tmp / "ckpt"), output_dir=str(tmp / "out"))
    data = cfg.model_dump(mode="json")
    for dotted, value in (changes or {}).items():
        *head, last = dotted.split(".")
        node = data
        for part in head:
            node = node[part]
        assert last in node, f"{dotted}: not a run config field"
        node[last] = value
    path = tmp / "run.json"
    path.write_text(json.dumps(data))
    return path


def run_single(cfg: Path, **kw) -> subprocess.CompletedProcess:
    """One training process (no torchrun) on the run config `cfg`."""
    return subprocess.run([sys.executable, "-m", "ballast.training", "--config", str(cfg)], capture_output=True, text=True,
                          timeout=180, **kw)


def record(tmp: Path) -> dict:
    """The failure record a training process under `tmp` (run by `config`) wrote."""
    return json.loads((tmp / "out" / "failure.json").read_text())


def free_port() -> int:
    """A loopback port free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(cfg: Path, *extra: str) -> list[str]:
    """The launcher's argv for the training module on `cfg`, with torchrun arguments `extra`: Ballast's
    torchrun (training.torchrun), as every backend runs it, whose workers fork from a warm forkserver (a
    plain torchrun's import torch again, and tear the interpreter down at the end: ~4 s more a launch)."""
    return [sys.executable, "-m", "ballast.training.torchrun", *extra, "--module", "ballast.training",
            "--config", str(cfg)]


# --- a spec's DAG through Airflow (dag.test) ---------------------------------------------------------

@contextlib.contextmanager
def quick_dag_test_loop(seconds: float = 0.05) -> Iterator[None]:
    """dag.test()'s scheduling loop waits `seconds`, not 1 s, after a pass that found no task to run.

    That loop moves a skip or an upstream failure one level down the DAG per pass and sleeps a second
    after each: a run whose training stops early, or whose first stage fails, waited a second per level
    below it (5 of a 23 s test). Only a sleep called from DAG.test itself is shortened; the tasks, which
    run in this process, sleep as they ask."""
    import time

    from airflow.sdk.definitions.dag import DAG

    loop, real = inspect.unwrap(DAG.test).__code__, time.sleep

    def sleep(s: float) -> None:
        real(min(s, seconds) if sys._getframe(1).f_code is loop else s)

    time.sleep = sleep
    try:
        yield
    finally:
        time.sleep = real


def run_spec_dag(tmp_path: Path, edit: Edit, *, conf: dict | None = None, name: str = "recovery"):
    """The example spec, renamed `name` and changed by `edit(d)`, rendered into its DAG in a DAGs folder
    of its own and run with dag.test(): (the DAG run, a RunContext of that run)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    def rename(d: dict) -> None:
        d["name"] = name
        edit(d)

    dags = tmp_path / "dags"
    (dags / "specs").mkdir(parents=True, exist_ok=True)
    spec_path = write_spec(dags / "specs" / f"{name}.yaml", rename)
    (dags / "pipelines.py").write_text((ROOT / "dags" / "ballast_pipelines.py").read_text())
    bag = DagBag(str(dags))
    assert not bag.import_errors, bag.import_errors
    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(bag, bundle_name="dags-folder", bundle_version=None)
    dag = bag.dags[f"ballast_{name}"]
    with quick_dag_test_loop():
        dr = dag.test(run_conf=conf or {})
    from ballast.spec import load_spec

    return dr, RunContext(spec=load_spec(spec_path), dag_id=dag.dag_id, run_id=dr.run_id)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample `name` in a Prometheus exposition whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def headless_chromium():
    """Debian's headless Chromium under chromedriver, its console logged (CSP violations appear there)."""
    import shutil

    import pytest

    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.fail("Debian's chromium and chromium-driver are not installed: `make browser` installs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,2200"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: CSP violations are logged there
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def bench_in_a_process(tmp_path: Path, module: str, call: str, *, timeout: float) -> dict:
    """`from ballast.bench.<module> import ...; <call>` run in a fresh interpreter (its own Airflow and
    Ballast homes, under `tmp_path`), its JSON result returned; a failed run fails the test with its output."""
    name = call.split("(", 1)[0]
    script, out = tmp_path / f"{name}.py", tmp_path / f"{name}.json"
    script.write_text(f"import json, sys\nfrom ballast.bench.{module} import {name}\n"
                      f"json.dump({call}, open(sys.argv[1], 'w'))\n")
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())
