"""Test environment: private Airflow and Ballast homes for the whole session, set before Airflow is
imported anywhere, so tests never touch the demo's .airflow/ and .ballast/."""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SESSION_HOME = Path(tempfile.mkdtemp(prefix="ballast-tests-"))

os.environ.update({
    "AIRFLOW_HOME": str(SESSION_HOME / "airflow"),
    "BALLAST_HOME": str(SESSION_HOME / "ballast"),
    "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
    "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
    "GX_ANALYTICS_ENABLED": "False",
    "TQDM_DISABLE": "1",
})

EXAMPLE_SPEC = ROOT / "dags" / "specs" / "digits.yaml"


def example_data() -> dict:
    return yaml.safe_load(EXAMPLE_SPEC.read_text())


def write_spec(path: Path, edit=None, *, data: dict | None = None) -> Path:
    """Write the example spec to `path`, after `edit(d)` changes the dict in place."""
    d = copy.deepcopy(data or example_data())
    if edit is not None:
        edit(d)
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def airflow_db():
    """A migrated SQLite metadata DB under the session's AIRFLOW_HOME."""
    from ballast.localrun import migrate_db

    migrate_db()
    return Path(os.environ["AIRFLOW_HOME"])


@pytest.fixture(scope="session")
def digits_raw() -> Path:
    """The digits demo data where the example spec expects it (BALLAST_HOME/raw/digits)."""
    from ballast.demo import write_digits
    from ballast.storage import resolve_local

    dest = resolve_local("raw/digits")
    if not dest.exists():
        write_digits(dest)
    return dest


@pytest.fixture
def python() -> str:
    return sys.executable
