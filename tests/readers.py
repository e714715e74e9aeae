"""The real readers of what Ballast writes, each in an environment of its own (their pins are not ours).

Petastorm 0.13.1 needs pyarrow < 15 and NumPy < 2; TensorFlow brings its own NumPy and protobuf. The
tests build each environment the first time they need it, from the pinned list in
`tests/reader_envs/<name>.txt`, into `$BALLAST_READER_ENVS` (default `~/.cache/ballast/reader-envs`),
under a name that holds the list's hash: a changed list builds a new one, an unchanged one is reused
between runs. Building takes a few minutes (pip from the registry); a lock keeps two test processes
from building the same one. Where it cannot be built (no registry), the test is skipped with pip's own
words, never silently.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LISTS = Path(__file__).resolve().parent / "reader_envs"
REUSE_MAIN = "# reader-env: reuse the main environment"
"""A list holding this line gets the test environment's own packages (torch, Ballast) after its own, through
a .pth file (`site.addsitedir`): a reader that needs torch does not download it again."""
README = Path(__file__).resolve().parents[1] / "README.md"
BUILD_TIMEOUT = 1500


def envs_root() -> Path:
    return Path(os.environ.get("BALLAST_READER_ENVS") or Path.home() / ".cache" / "ballast" / "reader-envs")


def reader_python(name: str) -> Path:
    """The Python of reader environment `name`, built from tests/reader_envs/<name>.txt if missing."""
    pins = (LISTS / f"{name}.txt").read_text()
    digest = hashlib.sha256(pins.encode()).hexdigest()[:12]
    root = envs_root()
    root.mkdir(parents=True, exist_ok=True)
    env = root / f"{name}-{digest}"
    python = env / "bin" / "python"
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (env / ".complete").exists():
            return python
        shutil.rmtree(env, ignore_errors=True)
        steps = [[sys.executable, "-m", "venv", str(env)],
                 [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  "--no-deps", "-r", str(LISTS / f"{name}.txt")]]
        for argv in steps:
            try:
                run = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
            except subprocess.TimeoutExpired:
                shutil.rmtree(env, ignore_errors=True)
                pytest.skip(f"the {name} reader environment did not build within {BUILD_TIMEOUT}s: {' '.join(argv)}")
            if run.returncode != 0:
                shutil.rmtree(env, ignore_errors=True)
                tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
                pytest.skip(f"the {name} reader environment cannot be built here ({' '.join(argv[:4])}...): "
                            + " | ".join(tail))
            if argv[1:3] == ["-m", "venv"] and REUSE_MAIN in pins.splitlines():
                _reuse_main(python)
        (env / ".complete").write_text(pins)
    return python


def _reuse_main(python: Path) -> None:
    """The packages of the environment running the tests, after the reader's own (REUSE_MAIN)."""
    import sysconfig

    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "zz-ballast-main-env.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n"
                                                            for p in sorted(ours)))


def run_reader(name: str, script: str, *args: str, timeout: float = 600) -> str:
    """Run `script` (Python source) with reader environment `name`'s Python; its stdout. A failure is
    the test's failure, with the reader's own error."""
    python = reader_python(name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    run = subprocess.run([str(python), "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                         env=env)
    assert run.returncode == 0, f"{name} reader failed:\n{run.stderr[-3000:]}"
    return run.stdout

def readme_recipe() -> str:
    """The Python block of the README's "Reading the TFRecord shards from TensorFlow" paragraph."""
    text = README.read_text()
    at = text.index("**Reading the TFRecord shards from TensorFlow.**")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, at)
    assert match, "README: the TFRecord paragraph has no ```python block"
    return match.group(1)
