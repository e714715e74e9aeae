"""Run parameters: a typo or a bad value gets one clear line, never a silent default or a traceback.

Three paths: `ballast demo --conf` (refused before any run exists), `dag.test()` with a conf (through
ballast.dev.dag_run.run_dag), and the REST trigger (tests/test_e2e.py, with the real API server)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from ballast.errors import SpecError
from ballast.spec import apply_overrides, load_spec
from helpers import EXAMPLE_SPEC

ALLOWED = "allowed: epochs, learning_rate, micro_batch_size, patience"


def _demo(*conf: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ballast.dev.cli", "demo", "--conf", *conf], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.unit
def test_unknown_parameter_names_the_closest_and_the_allowed_list():
    spec = load_spec(EXAMPLE_SPEC)
    with pytest.raises(SpecError, match=rf"unknown parameter\(s\) lr; {ALLOWED}; closest: lr -> learning_rate\?$"):
        apply_overrides(spec, {"lr": 0.1})
    with pytest.raises(SpecError, match=r"unknown parameter\(s\) epoch; .*; closest: epoch -> epochs\?$"):
        apply_overrides(spec, {"epoch": 3})
    with pytest.raises(SpecError, match=rf"unknown parameter\(s\) nosuch; {ALLOWED}$"):
        apply_overrides(spec, {"nosuch": 1})


@pytest.mark.integration
@pytest.mark.parametrize("conf,pattern", [
    ("nosuch=1", rf"digits\.yaml \(--conf\): unknown parameter\(s\) nosuch; {ALLOWED}"),
    ("lr=0.1", r"unknown parameter\(s\) lr; .*; closest: lr -> learning_rate\?"),
    ("epochs=0", r"digits\.yaml \(--conf\): training\.epochs: must be >= 1 \(got 0\)"),
    ("epochs=ten", r"training\.epochs: must be an integer \(got 'ten'\)"),
], ids=["unknown", "typo", "below-minimum", "wrong-type"])
def test_demo_refuses_bad_parameters_in_one_line_before_any_run(conf, pattern):
    proc = _demo(conf)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert lines[0].startswith("ballast demo: ")
    import re

    assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.e2e
def test_dag_test_refuses_an_unknown_key_at_the_first_task_and_a_bad_value_before_the_run(airflow_db, digits_raw,
                                                                                            capfd):
    from ballast.dev.dag_run import run_dag

    with pytest.raises(SpecError, match=r"digits\.yaml \(with run parameters\): training\.epochs: must be >= 1"
                                        r" \(got 0\)$"):
        run_dag("ballast_digits", {"epochs": 0})
    dr = run_dag("ballast_digits", {"lr": 0.1})
    assert str(dr.state) == "failed"
    states = {ti.task_id: (str(ti.state), ti.try_number) for ti in dr.get_task_instances()}
    assert states["validate"] == ("failed", 1)  # at once, no retry, before any data is read
    assert all(state != "success" for task, (state, _) in states.items() if task != "validate")
    out = "".join(capfd.readouterr())  # dag.test runs the tasks in this process; their log comes out here
    assert "unknown parameter(s) lr" in out and "closest: lr -> learning_rate?" in out, out[-3000:]


AUTHOR_ONLY = ["name", "version", "owner", "storage.uri", "storage.conn_id", "dataset.location", "cache.directory",
               "execution.env", "execution.backend", "execution.kubernetes.image", "execution.slurm.python",
               "conversion.spark_master", "notifications.webhook.conn_id", "training.rehearsal.scheduled",
               "dataset.tokenizer", "dataset.tokenizer.file", "training.model", "training.model.name",
               "training.model.options"]


@pytest.mark.unit
@pytest.mark.parametrize("path", AUTHOR_ONLY)
def test_overridable_refuses_what_only_the_spec_s_author_may_set(tmp_path, path):
    """Identity, storage, locations, directories, the environment, where and how training runs, who is
    notified, and the rehearsal safeguards: a person who can trigger a run must not change them."""
    from helpers import write_spec

    spec = write_spec(tmp_path / "spec.yaml", lambda d: d["overridable"].append(path))
    with pytest.raises(SpecError, match=rf"spec\.yaml:\d+: overridable: '{re.escape(path)}' is the spec author's"
                                        rf" alone \(.+\); a run parameter cannot change it$") as info:
        load_spec(spec)
    assert len(info.value.problems) == 1


@pytest.mark.unit
def test_a_language_models_tokenizer_file_and_model_size_are_never_run_parameters(tmp_path, capsys):
    """The input of the second security pass: an LM spec that lists the tokenizer file and the model's
    options, through which a trigger set the file to /etc/ssl/certs/../../passwd and the options to
    {layers: 256, width: 65536, heads: 1}. Lint refuses the spec, one line each; the trigger has nothing
    to set."""
    import yaml
    from ballast.dev.cli import main as cli
    from helpers import ROOT

    d = yaml.safe_load((ROOT / "dags" / "specs" / "lm.yaml").read_text())
    d["dataset"]["tokenizer"] = {"file": "tokenizers/team.json"}
    for path in ("dataset.tokenizer.file", "training.model.options"):
        spec = tmp_path / f"{path}.yaml"
        spec.write_text(yaml.safe_dump({**d, "overridable": [*d.get("overridable", []), path]}, sort_keys=False))
        assert cli(["lint", str(spec)]) == 1
        lines = [line for line in "".join(capsys.readouterr()).splitlines() if path in line]
        assert len(lines) == 1 and re.search(rf"overridable: '{re.escape(path)}' is the spec author's alone", lines[0])
    spec = load_spec(ROOT / "dags" / "specs" / "lm.yaml")
    for conf in ({"file": "/etc/ssl/certs/../../passwd"}, {"options": {"layers": 256, "width": 65536, "heads": 1}}):
        with pytest.raises(SpecError, match=r"unknown parameter"):
            apply_overrides(spec, conf)


@pytest.mark.unit
@pytest.mark.parametrize(("path", "why"), [("recovery.policy", "is a map"), ("tags", "is a list")])
def test_maps_and_lists_are_not_single_values(tmp_path, path, why):
    """A field whose annotation is a mapping or a list is no single value, whatever wraps it (Optional,
    Annotated): only scalars are run parameters (optional sections: the next test)."""
    from helpers import write_spec

    spec = write_spec(tmp_path / "spec.yaml", lambda d: d["overridable"].append(path))
    with pytest.raises(SpecError, match=rf"overridable: '{re.escape(path)}' {why}"):
        load_spec(spec)


@pytest.mark.unit
def test_the_shape_of_an_annotation_sees_through_optional_and_annotated():
    from typing import Annotated, Any, Literal, Optional

    from ballast.spec.overrides import _shape
    from pydantic import BaseModel, Field

    class Section(BaseModel):
        x: int = 0

    assert [_shape(a) for a in (Section | None, Optional[Section], Annotated[Section | None, Field()],
                                dict[str, int] | None, Annotated[dict[str, Any], Field()], tuple[int, ...] | None,
                                list[str], Any, int | None, Annotated[float, Field(gt=0)], Literal["a", "b"], str)] \
        == ["section"] * 3 + ["mapping"] * 2 + ["list"] * 2 + ["any"] + ["scalar"] * 4


@pytest.mark.unit
def test_fields_a_run_may_change_stay_overridable(tmp_path):
    from helpers import write_spec

    fine = ["training.seed", "training.rehearsal.max_steps", "execution.hang_timeout_seconds", "cache.concurrency",
            "storage.max_attempts"]
    spec = load_spec(write_spec(tmp_path / "spec.yaml", lambda d: d["overridable"].extend(fine)))
    assert apply_overrides(spec, {"seed": 3, "max_steps": 5}).training.seed == 3


@pytest.mark.unit
def test_a_flood_of_unknown_parameters_is_one_short_line():
    spec = load_spec(EXAMPLE_SPEC)
    with pytest.raises(SpecError, match=r"unknown parameter\(s\) p0, p1, .*, \.\.\. \(9991 more\); allowed") as info:
        apply_overrides(spec, {f"p{i}": 1 for i in range(10_000)} | {"x" * 100_000: 1})
    assert len(str(info.value)) < 1000
