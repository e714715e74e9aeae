"""The digits cache tests/test_gpu.py trains on, made where the data stack is, for a GPU machine where it is
not (torch, but no Great Expectations or Spark to validate and convert with):

    python tests/gpu_cache.py FOLDER                                      # here: FOLDER/cache, FOLDER/warm_cache.json
    BALLAST_TEST_DIGITS_CACHE=FOLDER python -m pytest tests/test_gpu.py   # there (tests/conftest.py: digits_cache)
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HOME = Path(tempfile.mkdtemp(prefix="ballast-gpu-cache-"))
os.environ.update({"BALLAST_HOME": str(HOME / "ballast"), "AIRFLOW_HOME": str(HOME / "airflow"),
                   "GX_ANALYTICS_ENABLED": "False", "TQDM_DISABLE": "1"})

from helpers import make_ctx, run_chain, warm_cache_rest  # noqa: E402  (after the homes are set)


def main(folder: Path) -> None:
    from ballast.data.demo import write_digits
    from ballast.stages import convert, validate, warm_cache

    try:
        raw = write_digits(HOME / "raw" / "digits")
        ctx = make_ctx(HOME / "run", raw)
        result = run_chain(ctx, validate, convert, warm_cache, warm_cache_rest)["warm_cache"]
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(result.cache_dir, folder / "cache")
        # the cache's own folder, relative: the folder travels (conftest resolves it where it lands)
        (folder / "warm_cache.json").write_text(result.model_copy(update={"cache_dir": "cache"}).model_dump_json())
    finally:
        shutil.rmtree(HOME, ignore_errors=True)
    print(f"{folder}: the digits cache ({result.format}) and its record")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/gpu_cache.py FOLDER")
    main(Path(sys.argv[1]).resolve())
