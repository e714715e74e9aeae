"""Test environment: private Airflow and Ballast homes for the whole session, set before Airflow is
imported anywhere, so tests never touch the demo's .airflow/ and .ballast/; the shared fixtures; and
the test tiers (unit, integration, e2e), of which every test has exactly one; and, under pytest-xdist
(`make test` runs two workers), the tests marked `alone` run with no other test beside them."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SESSION_HOME = Path(tempfile.mkdtemp(prefix="ballast-tests-"))
ROOT = Path(__file__).resolve().parents[1]

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

from helpers import make_ctx, run_chain, warm_cache_rest  # noqa: E402  (after the homes are set)

if os.environ.get("PYTEST_XDIST_WORKER") and not hasattr(sys.modules["__main__"], "__file__") \
        and sys.modules["__main__"].__spec__ is None:
    # A pytest-xdist worker's __main__ is execnet's `python -c` bootstrap, which pyspark.sql.connect (imported
    # by Great Expectations) takes for a doctest run and answers with sys.exit(0). An empty main module
    # instead: what multiprocessing's spawned children then run as their __mp_main__ too.
    sys.modules["__main__"].__file__ = str(ROOT / "tests" / "xdist_main.py")

TIERS = ("unit", "integration", "e2e")

LOCKS_ENV = "BALLAST_TEST_LOCKS"
"""The folder of the workers' two lock files, made by the pytest-xdist controller before it starts them."""


def pytest_unconfigure(config):
    """The session's homes go with it (~190 MB each run: the Airflow database, logs, runs' storage)."""
    shutil.rmtree(SESSION_HOME, ignore_errors=True)
    if not os.environ.get("PYTEST_XDIST_WORKER") and LOCKS_ENV in os.environ:
        shutil.rmtree(os.environ.pop(LOCKS_ENV), ignore_errors=True)


def pytest_configure(config):
    if config.getoption("numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[LOCKS_ENV] = tempfile.mkdtemp(prefix="ballast-test-locks-")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked `alone` (it measures time or a share of the CPU, which a test beside
    it would take) runs, from its setup to its teardown, with no other worker's test running: a
    readers-writer lock on two files, the writer first. Every test passes the turnstile to take the
    running lock, shared or (alone) exclusive; an alone test holds the turnstile until it ends, so the other
    worker's next test waits behind it rather than starving it."""
    folder = os.environ.get(LOCKS_ENV)
    if not folder or not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    alone = item.get_closest_marker("alone") is not None
    with open(Path(folder) / "turnstile", "a") as turnstile, open(Path(folder) / "running", "a") as running:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        return (yield)  # both locks end with their files


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: a test without a tier must not silently vanish
def pytest_collection_modifyitems(config, items):
    """Every test has exactly one tier, or the session stops before running anything, naming them."""
    wrong = []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {'tiers ' + ', '.join(tiers) if tiers else 'no tier'}")
    if wrong:
        raise pytest.UsageError("each test needs exactly one of the markers unit, integration, e2e (pytestmark for a"
                                " whole module, @pytest.mark.<tier> per test otherwise): " + "; ".join(wrong))


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request, monkeypatch):
    """A unit test that starts a process or asks for the Airflow database fails, naming itself: such a
    test belongs to the integration tier, and the unit tier stays fast."""
    if request.node.get_closest_marker("unit") is None:
        return
    if "airflow_db" in request.fixturenames:
        pytest.fail(f"{request.node.nodeid}: a unit test uses the Airflow database; mark it integration or e2e")

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid}: a unit test started a process; mark it integration")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)  # what every subprocess call goes through
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse, raising=False)


@pytest.fixture(scope="session")
def airflow_db():
    """A migrated SQLite metadata DB under the session's AIRFLOW_HOME."""
    from ballast.dev.dag_run import migrate_db

    migrate_db()
    return Path(os.environ["AIRFLOW_HOME"])


@pytest.fixture(scope="session")
def digits_raw() -> Path:
    """The digits demo data where the example spec expects it (BALLAST_HOME/raw/digits)."""
    from ballast.data.demo import write_digits
    from ballast.storage import resolve_local

    dest = resolve_local("raw/digits")
    if not dest.exists():
        write_digits(dest)
    return dest


@pytest.fixture(scope="session")
def digits_cache(tmp_path_factory, request):
    """The digits data validated, converted and warmed (every phase) once for the session: the
    WarmCacheResult whose cache_dir training runs read. Read-only: a test that damages or rewrites a
    cache builds its own (make_ctx + run_chain). With BALLAST_TEST_DIGITS_CACHE, the one tests/gpu_cache.py
    made in that folder (for a GPU machine, which has torch but not the data stack)."""
    prepared = os.environ.get("BALLAST_TEST_DIGITS_CACHE")
    if prepared:
        from ballast.records import WarmCacheResult

        folder = Path(prepared).resolve()
        result = WarmCacheResult.model_validate_json((folder / "warm_cache.json").read_text())
        return result.model_copy(update={"cache_dir": str(folder / result.cache_dir)})
    from ballast.stages import convert, validate, warm_cache

    ctx = make_ctx(tmp_path_factory.mktemp("digits-cache"), request.getfixturevalue("digits_raw"))
    return run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)["warm_cache"]


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def lm_cache(tmp_path_factory):
    """A small text corpus (byte tokens, workload_data.lm_spec) validated, converted and warmed once for
    the session: (its RunContext, the WarmCacheResult). Read-only."""
    from ballast.stages import convert, validate, warm_cache
    from workload_data import lm_spec, write_corpus

    tmp = tmp_path_factory.mktemp("lm")
    raw = write_corpus(tmp / "raw")
    ctx = make_ctx(tmp, raw, lambda d: lm_spec(d, raw))
    return ctx, run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)["warm_cache"]
