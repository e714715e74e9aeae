"""A spec can neither stall its readers nor carry a number its consumers refuse: parsing is bounded in
time and memory (size, aliases, nesting, messages), one spec's failure is that spec's alone, and every
number is finite and within the bounds of what reads it (sbatch, numpy, torch, timers)."""

from __future__ import annotations

import shutil
import time

import pytest
from ballast.dev.cli import main as cli
from ballast.errors import SpecError
from ballast.spec import load_spec, parse_spec
from helpers import EXAMPLE_SPEC, ROOT, example_data, write_spec

LIMIT_S = 2.0
"""A refusal's time bound: ~100x what these inputs take once bounded, ~1/100 of what they took before. In
this thread's CPU seconds (time.thread_time()), which a test beside it on the same cores does not add to."""


def alias_bomb() -> str:
    """Nine nested lists, each nine aliases of the one before: ~300 bytes, 9^9 values once expanded."""
    text, prev = "a: &a [x, x, x, x, x, x, x, x, x]\n", "a"
    for name in "bcdefghi":
        text += f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n"
        prev = name
    return text


def wide_spec_text(n: int = 200_000) -> str:
    """The example with `n` more dataset fields, one name given twice."""
    extra = "".join(f"    - {{name: f{i}, type: float32}}\n" for i in range(n)) + "    - {name: f7, type: float32}\n"
    text = EXAMPLE_SPEC.read_text()
    anchor = "    - {name: label, type: int64}\n"
    assert anchor in text
    return text.replace(anchor, anchor + extra)


def lint(capsys, path) -> tuple[int, list[str], float]:
    """`ballast lint PATH` in this process: (exit code, its output's lines, CPU seconds of this thread)."""
    started = time.thread_time()
    code = cli(["lint", str(path)])
    seconds = time.thread_time() - started
    out = capsys.readouterr()
    return code, (out.out + out.err).splitlines(), seconds


# --- item 3: parsing bounded ---------------------------------------------------------------------------


@pytest.mark.unit
def test_lint_refuses_the_alias_bomb_in_under_2s_with_one_line(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(EXAMPLE_SPEC.read_text() + alias_bomb())
    code, lines, seconds = lint(capsys, path)
    assert code == 1 and seconds < LIMIT_S, (code, seconds)
    assert len(lines) == 1 and lines[0].startswith(f"{path}:"), lines
    assert "alias" in lines[0] and len(lines[0]) < 300


@pytest.mark.unit
def test_lint_refuses_a_200000_field_spec_in_under_2s_with_one_line(tmp_path, capsys):
    path = tmp_path / "wide.yaml"
    path.write_text(wide_spec_text())
    code, lines, seconds = lint(capsys, path)
    assert code == 1 and seconds < LIMIT_S, (code, seconds)
    assert len(lines) == 1 and lines[0].startswith(f"{path}"), lines
    assert len(lines[0]) < 300


@pytest.mark.unit
def test_duplicate_field_names_are_found_in_linear_time():
    data = example_data()
    data["dataset"]["fields"] += [{"name": f"f{i}", "type": "float32"} for i in range(200_000)]
    data["dataset"]["fields"].append({"name": "f7", "type": "float32"})
    started = time.thread_time()
    with pytest.raises(SpecError, match=r"dataset\.fields: duplicate field name\(s\) f7$") as info:
        parse_spec(data, source="wide.yaml")
    assert time.thread_time() - started < LIMIT_S
    assert len(info.value.problems) == 1


@pytest.mark.unit
def test_an_error_beside_an_alias_bomb_is_placed_without_walking_the_bomb():
    import yaml
    from ballast.spec import Spec
    from ballast.spec.messages import validation_error
    from pydantic import ValidationError

    text = EXAMPLE_SPEC.read_text().replace("epochs: 30", "epochs: 0") + alias_bomb()
    data = yaml.load(text, Loader=yaml.CSafeLoader)  # shared lists: cheap until something walks them
    started = time.thread_time()
    with pytest.raises(ValidationError) as info:
        Spec.model_validate(data)
    problems = validation_error(info.value, Spec, source="bomb.yaml", text=text).problems
    assert time.thread_time() - started < LIMIT_S
    epochs = text.splitlines().index("  epochs: 0") + 1
    assert f"bomb.yaml:{epochs}: training.epochs: must be >= 1 (got 0)" in problems
    assert any(p.startswith(f"bomb.yaml:{len(text.splitlines())}: i: unknown key 'i'") for p in problems), problems


@pytest.mark.unit
def test_values_are_cut_before_their_repr():
    from ballast.training.config.messages import short

    nested: list = ["x"] * 9
    for _ in range(8):
        nested = [nested] * 9  # 9^9 strings when walked: what a YAML alias bomb decodes to
    started = time.thread_time()
    text = short(nested)
    assert time.thread_time() - started < 0.5
    assert len(text) <= 80 and text.startswith("[[[")
    assert short("y" * 10**7).endswith("...") and len(short("y" * 10**7)) <= 80


@pytest.mark.unit
def test_a_huge_bad_value_in_a_dict_spec_is_one_short_line_per_problem():
    nested: list = ["x"] * 9
    for _ in range(8):
        nested = [nested] * 9
    data = example_data()
    data["name"] = nested  # a list where a string belongs: its value is in the message, cut
    started = time.thread_time()
    with pytest.raises(SpecError, match=r"^bomb\.yaml: name: must be a string \(got \[\[\[") as info:
        parse_spec(data, source="bomb.yaml")
    assert time.thread_time() - started < LIMIT_S
    assert all(len(line) < 200 for line in info.value.problems)


@pytest.mark.unit
def test_thousands_of_problems_are_cut_to_a_bounded_report(tmp_path):
    path = write_spec(tmp_path / "many.yaml", lambda d: d.update(tags=list(range(50_000))))
    started = time.thread_time()
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert time.thread_time() - started < LIMIT_S
    problems = info.value.problems
    assert len(problems) <= 21, len(problems)
    assert problems[0].startswith(f"{path}:") and "tags[0]: must be a string (got 0)" in problems[0]
    assert problems[-1] == f"{path}: ... and {50_000 - 20} more problems"


@pytest.mark.unit
def test_deep_nesting_is_one_line_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text(EXAMPLE_SPEC.read_text().replace("tags: [example, vision]", "tags: " + "[" * 990 + "]" * 990))
    code, lines, seconds = lint(capsys, path)
    assert code == 1 and seconds < LIMIT_S
    assert len(lines) == 1 and lines[0].startswith(f"{path}:"), lines[:3]


@pytest.mark.unit
def test_a_few_aliases_still_load(tmp_path):
    path = tmp_path / "anchors.yaml"
    text = EXAMPLE_SPEC.read_text().replace("values: [0, 1,", "values: &labels [0, 1,")
    last_rule = "    - {kind: finite, column: image}\n"
    path.write_text(text.replace(last_rule, last_rule + "    - {kind: in_set, column: label, values: *labels}\n"))
    spec = load_spec(path)
    assert spec.validation.rules[-1].values == tuple(range(10))


@pytest.mark.unit
def test_lint_reports_an_unexpected_error_as_one_line_and_goes_on(tmp_path, capsys, monkeypatch):
    import ballast.spec.loading

    real = ballast.spec.loading.load_spec

    def load(path):
        if path.name == "odd.yaml":
            raise OverflowError("cannot convert float infinity to integer")
        return real(path)

    monkeypatch.setattr(ballast.spec.loading, "load_spec", load)  # what lint_spec reads the spec with
    odd, good = write_spec(tmp_path / "odd.yaml"), write_spec(tmp_path / "good.yaml")
    assert cli(["lint", str(odd), str(good)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{odd}: cannot read spec: OverflowError: cannot convert float infinity to integer",
                     f"{good}: ok (ballast_digits)"]


def _dags_folder(tmp_path):
    dags = tmp_path / "dags"
    (dags / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "ballast_pipelines.py", dags)
    write_spec(dags / "specs" / "digits.yaml")
    return dags


@pytest.mark.integration
def test_a_dagbag_beside_the_alias_bomb_and_a_200000_field_spec_loads_the_good_dag(tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    dags = _dags_folder(tmp_path)
    (dags / "specs" / "bomb.yaml").write_text(EXAMPLE_SPEC.read_text().replace("name: digits", "name: bomb")
                                              + alias_bomb())
    (dags / "specs" / "wide.yaml").write_text(wide_spec_text().replace("name: digits", "name: wide"))
    started = time.perf_counter()
    bag = DagBag(str(dags))
    assert time.perf_counter() - started < 30  # the DAG processor's own import timeout
    assert set(bag.dags) == {"ballast_digits"}
    (path, message), = bag.import_errors.items()
    assert path.endswith("ballast_pipelines.py")
    assert "bomb.yaml:" in message and "YAML aliases" in message and "wide.yaml: more than" in message, message


@pytest.mark.integration
def test_an_unexpected_error_building_one_spec_is_that_spec_s_import_error_alone(tmp_path, monkeypatch):
    import ballast.airflow.dags
    from airflow.dag_processing.dagbag import DagBag

    dags = _dags_folder(tmp_path)
    write_spec(dags / "specs" / "other.yaml", lambda d: d.update(name="other"))
    real = ballast.airflow.dags.build_plan

    def build_plan(spec, **kwargs):
        if spec.name == "other":
            raise KeyError("recovery")  # what a bug in a plan or a renderer raises: no SpecError
        return real(spec, **kwargs)

    monkeypatch.setattr(ballast.airflow.dags, "build_plan", build_plan)
    bag = DagBag(str(dags))
    assert set(bag.dags) == {"ballast_digits"}
    (path, message), = bag.import_errors.items()
    assert path.endswith("ballast_pipelines.py")
    assert f"{dags / 'specs' / 'other.yaml'}: cannot build its DAG: KeyError: 'recovery'" in message, message


# --- item 11: numbers with the bounds their users need ----------------------------------------------------

INF, NAN = float("inf"), float("nan")

BOUNDS = [
    ("grace_inf", lambda d: d["recovery"].update(preempt_grace_seconds=INF),
     r"recovery\.preempt_grace_seconds: must be a finite number \(got inf\)"),
    ("grace_past_sbatch_signal", lambda d: d["recovery"].update(preempt_grace_seconds=65536),
     r"recovery\.preempt_grace_seconds: must be <= 65535 \(got 65536\)"),
    ("seed_negative", lambda d: d["training"].update(seed=-1), r"training\.seed: must be >= 0 \(got -1\)"),
    ("seed_past_32_bits", lambda d: d["training"].update(seed=2**32),
     r"training\.seed: must be <= 4294967295 \(got 4294967296\)"),
    ("split_seed_negative", lambda d: d["dataset"]["split"].update(seed=-1),
     r"dataset\.split\.seed: must be >= 0 \(got -1\)"),
    ("hang_timeout_inf", lambda d: d["execution"].update(hang_timeout_seconds=INF),
     r"execution\.hang_timeout_seconds: must be a finite number \(got inf\)"),
    ("loss_scale_inf", lambda d: d["training"].update(loss_scale={"initial": INF}),
     r"training\.loss_scale\.initial: must be a finite number \(got inf\)"),
    ("loss_scale_past_fp16", lambda d: d["training"].update(loss_scale={"initial": 1e300}),
     r"training\.loss_scale\.initial: must be <= 16777216"),
    ("loss_scale_growth_past_int64", lambda d: d["training"].update(loss_scale={"growth_interval": 2**63}),
     r"training\.loss_scale\.growth_interval: must be <= 1000000"),
    ("loss_scale_minimum_above_initial", lambda d: d["training"].update(loss_scale={"initial": 1024, "minimum": 4096}),
     r"training\.loss_scale\.minimum: 4096 is above initial \(1024\)"),
    ("loss_scale_minimum_zero", lambda d: d["training"].update(loss_scale={"minimum": 0}),
     r"training\.loss_scale\.minimum: must be > 0"),
    ("learning_rate_nan", lambda d: d["training"].update(learning_rate=NAN),
     r"training\.learning_rate: must be a finite number \(got nan\)"),
    ("rule_bound_inf", lambda d: d["validation"]["rules"][3].update(max=INF),
     r"validation\.rules\[3\]\.max: must be a finite number \(got inf\)"),
    ("checkpoint_every_inf", lambda d: d["training"].update(checkpoint={"every_seconds": INF}),
     r"training\.checkpoint\.every_seconds: must be a finite number"),
    ("cache_wait_past_a_year", lambda d: d["cache"].update(wait_seconds=1e12),
     r"cache\.wait_seconds: must be <= 31536000"),
    ("shape_past_int64", lambda d: d["dataset"]["fields"][0].update(shape=[2**32, 2**32]),
     r"dataset\.fields\[0\]\.shape: 18446744073709551616 elements per value \(4294967296 x 4294967296\);"
     r" at most 2147483648"),
    ("shape_of_many_dimensions", lambda d: d["dataset"]["fields"][0].update(shape=[1] * 9),
     r"dataset\.fields\[0\]\.shape: .*at most 8"),
    ("checkpoint_every_steps_past_int64", lambda d: d["training"].update(checkpoint={"every_steps": 2**63}),
     r"training\.checkpoint\.every_steps: must be <= 1099511627776"),
    ("epochs_past_int64", lambda d: d["training"].update(epochs=2**64), r"training\.epochs: must be <= 100000"),
    ("fault_rank_past_any_cluster", lambda d: d["training"].update(rehearsal={"faults": [{"kind": "oom", "step": 3,
                                                                                          "rank": 2**40}]}),
     r"training\.rehearsal\.faults\[0\]\.rank: must be <= 1048576"),
    ("cache_max_bytes_overridable", lambda d: d["overridable"].append("cache.max_bytes"),
     r"overridable: 'cache\.max_bytes' is the spec author's alone"),
]


@pytest.mark.unit
@pytest.mark.parametrize("edit,pattern", [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_numbers_out_of_bounds_get_one_line_naming_the_field(tmp_path, edit, pattern):
    path = write_spec(tmp_path / "bad.yaml", edit)
    with pytest.raises(SpecError, match=pattern) as info:
        load_spec(path)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(f"{path}:"), info.value.problems


@pytest.mark.unit
def test_the_largest_accepted_values_still_load(tmp_path):
    def edit(d):
        d["recovery"]["preempt_grace_seconds"] = 65535
        d["training"].update(seed=2**32 - 1, loss_scale={"initial": 2.0**24})
        d["dataset"]["split"]["seed"] = 2**32 - 1
        d["dataset"]["fields"][0]["shape"] = [2**15, 2**16]

    spec = load_spec(write_spec(tmp_path / "big.yaml", edit))
    assert spec.recovery.preempt_grace_seconds == 65535 and spec.training.seed == 2**32 - 1


@pytest.mark.unit
def test_the_run_config_refuses_what_the_spec_refuses():
    from ballast.launch.config import run_config
    from ballast.training.failure import ConfigFailure

    cfg = run_config(load_spec(EXAMPLE_SPEC), data_dir=".", data_format="petastorm", checkpoint_dir=".",
                     output_dir=".")
    with pytest.raises(ConfigFailure, match=r"execution\.hang_timeout_seconds: must be a finite number \(got inf\)"):
        cfg.updated({"execution.hang_timeout_seconds": INF})
    with pytest.raises(ConfigFailure, match=r"model\.data\.input_shape: 18446744073709551616 elements per value"):
        cfg.updated({"model.data": {**cfg.model.data, "input_shape": [2**32, 2**32]}})
    with pytest.raises(ConfigFailure, match=r"seed: must be >= 0 \(got -1\)"):
        cfg.updated({"seed": -1})


@pytest.mark.unit
def test_a_huge_unknown_key_is_cut_in_its_line(tmp_path):
    key = "k" * 500_000
    path = tmp_path / "key.yaml"
    path.write_text(EXAMPLE_SPEC.read_text() + f"? {key}\n: 1\n")  # an explicit key: YAML's simple ones stop at 1024
    with pytest.raises(SpecError, match=r"key\.yaml:\d+: k+\.\.\.: unknown key 'k+\.\.\.; allowed here:") as info:
        load_spec(path)
    assert len(info.value.problems) == 1 and len(info.value.problems[0]) < 1200
