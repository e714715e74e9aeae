"""Run ids map to storage keys one-to-one (issue 21, item 4): two runs never share a run directory."""

from __future__ import annotations

import json

import pytest
from ballast.pipeline.context import RunContext, legacy_run_id, run_key_for_reading, safe_run_id
from ballast.errors import BallastError
from ballast.records import EffectiveSpec
from ballast.spec import parse_spec
from ballast.storage import FileStorage
from helpers import example_data

pytestmark = pytest.mark.unit

COLON = "manual__2026-01-01T00:00:00+00:00"
UNDERSCORE = "manual__2026-01-01T00_00_00_00_00"


def ctx_for(tmp_path, run_id: str) -> RunContext:
    d = example_data()
    d["storage"]["uri"] = str(tmp_path / "storage")
    return RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id=run_id)


def test_ids_that_read_alike_get_different_directories(tmp_path):
    a, b = ctx_for(tmp_path, COLON), ctx_for(tmp_path, UNDERSCORE)
    assert a.run_key != b.run_key and a.work_dir != b.work_dir
    assert safe_run_id(UNDERSCORE) == UNDERSCORE  # a key-safe id is its own key, readable as before
    assert safe_run_id(COLON).startswith("manual__2026-01-01T00_00_00_00_00~")


@pytest.mark.parametrize("run_id", [COLON, UNDERSCORE, ".", "..", "a/b", "a\\b", "r1", "r10", "x" * 250, "é~"])
def test_a_key_is_one_path_segment_of_safe_characters(run_id):
    key = safe_run_id(run_id)
    assert key not in (".", "..", "") and "/" not in key and "\\" not in key and len(key) <= 255
    assert all(c.isascii() and (c.isalnum() or c in "._-~") for c in key)


def test_no_two_ids_of_a_crowd_share_a_key():
    ids = [f"manual__2026-01-01T00{sep}00{sep}00+00{sep}00" for sep in ":_-.+ ~"] + [COLON, UNDERSCORE, "a~b", "a_b"]
    ids += [legacy_run_id(i) for i in ids]
    unique = set(ids)
    assert len({safe_run_id(i) for i in unique}) == len(unique)


def test_the_second_run_does_not_take_over_the_first_ones_directory(tmp_path):
    """The first stage claims the directory (spec.json records the exact run id); a run whose key holds
    another run's records is refused naming the directory, never resumes from them."""
    from ballast.pipeline.runner import claim_run_directory

    first = ctx_for(tmp_path, UNDERSCORE)
    claim_run_directory(first)  # nothing there yet
    record = EffectiveSpec(spec_file="s.yaml", run_id=UNDERSCORE, parameters_given={}, parameters_applied={}, spec={})
    first.storage.write_bytes(f"{first.run_key}/spec.json", record.model_dump_json().encode())
    claim_run_directory(ctx_for(tmp_path, UNDERSCORE))  # the same run's first stage, retried: its own directory
    # A directory an earlier Ballast wrote for COLON (the old mapping gave both ids this key):
    legacy = first.storage.local_path(first.run_key) / "spec.json"
    legacy.write_text(json.dumps({**json.loads(legacy.read_text()), "run_id": None}))
    with pytest.raises(BallastError, match=r"spec.json.*another run"):
        claim_run_directory(ctx_for(tmp_path, UNDERSCORE))
    legacy.write_text(json.dumps({**json.loads(legacy.read_text()), "run_id": COLON}))
    with pytest.raises(BallastError, match=r"run 'manual__2026-01-01T00:00:00\+00:00'"):
        claim_run_directory(ctx_for(tmp_path, UNDERSCORE))


def test_a_run_written_under_the_old_key_is_still_readable(tmp_path):
    store = FileStorage(tmp_path / "storage")
    old = f"runs/ballast_digits/{legacy_run_id(COLON)}"
    spec = EffectiveSpec(spec_file="s.yaml", parameters_given={}, parameters_applied={}, spec={})
    store.write_bytes(f"{old}/spec.json", spec.model_dump_json().encode())
    assert run_key_for_reading(store, "ballast_digits", COLON) == old
    # ... unless its records name another run, or the run has records under its own key.
    other = spec.model_copy(update={"run_id": UNDERSCORE})
    store.write_bytes(f"{old}/spec.json", other.model_dump_json().encode())
    assert run_key_for_reading(store, "ballast_digits", COLON) == f"runs/ballast_digits/{safe_run_id(COLON)}"
    store.write_bytes(f"{old}/spec.json", spec.model_dump_json().encode())
    store.write_bytes(f"runs/ballast_digits/{safe_run_id(COLON)}/spec.json", spec.model_dump_json().encode())
    assert run_key_for_reading(store, "ballast_digits", COLON) == f"runs/ballast_digits/{safe_run_id(COLON)}"
