"""Models from entry points (ballast.training.models): the registry read from metadata only, a package
installed for the test as a dist-info directory on sys.path, options_schema messages, failures of a
package's own code as config failures, and the built-ins' shapes (gpt's causality, unet in 2-D and 3-D)."""

from __future__ import annotations

import sys
import textwrap

import pytest
from helpers import example_data, write_spec

from ballast.errors import SpecError
from ballast.spec import parse_spec
from ballast.training.failure import ConfigFailure
from ballast.training.models import build_configured_model, registry

pytestmark = pytest.mark.unit

LM_DATA = {"task": "causal_lm", "input_shape": [12], "input_dtype": "int64", "seq_len": 12, "vocab_size": 40,
           "inputs": {"tokens": {"shape": [12], "dtype": "int64"}}}


@pytest.fixture
def team_package(tmp_path, monkeypatch):
    """A package `teammodels` installed only for the test: its module, a dist-info directory with its
    entry points, both on sys.path. Importing its module leaves a mark in sys.modules."""
    (tmp_path / "teammodels_mod.py").write_text(textwrap.dedent('''
        import torch

        def tiny(options, data):
            return torch.nn.Linear(int(data["input_shape"][0]), int(data["num_classes"]))

        tiny.options_schema = {"type": "object", "properties": {"width": {"type": "integer", "minimum": 2},
                               "act": {"enum": ["relu", "gelu"]}}, "additionalProperties": False}

        def boom(options, data):
            raise ValueError("the team's bug")

        def not_a_module(options, data):
            return 42

        NOT_CALLABLE = 3
    '''))
    info = tmp_path / "teammodels-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: teammodels\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ballast.models]\n"
                                           "tiny = teammodels_mod:tiny\nboom = teammodels_mod:boom\n"
                                           "not_a_module = teammodels_mod:not_a_module\n"
                                           "not_callable = teammodels_mod:NOT_CALLABLE\n"
                                           "missing = teammodels_nowhere:factory\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "teammodels_mod", raising=False)
    yield tmp_path
    sys.modules.pop("teammodels_mod", None)


def _section(name, options=None, data=None):
    from ballast.training.config.run import ModelConfig

    data = data or {"task": "classification", "input_shape": [6], "input_dtype": "float32", "num_classes": 3,
                    "inputs": {"x": {"shape": [6], "dtype": "float32"}}}
    return ModelConfig(name=name, options=options or {}, data=data)


def test_the_built_ins_are_registered_by_ballasts_own_metadata():
    assert {"mlp", "cnn", "embed", "gpt", "unet", "hf_causal_lm"} <= set(registry.names())
    assert "of distribution ballast" in registry.where("gpt")


def test_a_package_model_is_named_by_its_entry_point_and_built(team_package):
    assert "tiny" in registry.names()
    d = example_data()
    d["training"]["model"] = {"name": "tiny", "options": {"width": 4}}
    spec = parse_spec(d)
    assert spec.training.model.name == "tiny" and "teammodels_mod" not in sys.modules  # parsing imported nothing
    model = build_configured_model(_section("tiny"))
    assert model.out_features == 3 and "teammodels_mod" in sys.modules


def test_an_unknown_model_is_refused_at_parse_time_listing_the_names_without_importing(team_package):
    d = example_data()
    d["training"]["model"] = "resnet9000"
    with pytest.raises(SpecError, match=r"training\.model\.name: unknown model 'resnet9000'; registered: boom, cnn,"
                                        r" embed, gpt, hf_causal_lm, missing, mlp, not_a_module, not_callable, tiny,"
                                        r" unet"):
        parse_spec(d)
    assert "teammodels_mod" not in sys.modules


def test_failures_in_a_package_are_config_failures_naming_it(team_package):
    with pytest.raises(ConfigFailure, match=r"^training\.model: entry point boom = teammodels_mod:boom \(group"
                                            r" ballast\.models\) of distribution teammodels failed to build the model:"
                                            r" ValueError: the team's bug$") as failed:
        build_configured_model(_section("boom"))
    assert failed.value.failure_class == "config"  # never retried: recovery.of('config').retries is 0
    assert parse_spec(example_data()).recovery.of("config").retries == 0
    with pytest.raises(ConfigFailure, match=r"entry point missing = teammodels_nowhere:factory .* of distribution"
                                            r" teammodels cannot be loaded: ModuleNotFoundError: No module named"
                                            r" 'teammodels_nowhere'"):
        build_configured_model(_section("missing"))
    with pytest.raises(ConfigFailure, match=r"not_a_module .* returned a int, not a torch\.nn\.Module"):
        build_configured_model(_section("not_a_module"))
    with pytest.raises(ConfigFailure, match=r"not_callable .* is a int, not a factory"):
        build_configured_model(_section("not_callable"))


def test_options_schema_problems_one_line_each_naming_the_option(team_package, tmp_path):
    from ballast.spec.loading import check_model_options, lint_spec

    problems = registry.check_options("tiny", {"width": 1, "act": "tanh", "depth": 3})
    assert problems == ["training.model.options.act: 'tanh' is not one of ['relu', 'gelu']",
                        "training.model.options.depth: unknown option; allowed: act, width",
                        "training.model.options.width: 1 is less than the minimum of 2"]
    with pytest.raises(ConfigFailure, match=r"training\.model\.options\.width: 1 is less than the minimum of 2"):
        build_configured_model(_section("tiny", {"width": 1}))  # a run checks them too
    path = write_spec(tmp_path / "team.yaml", lambda d: d["training"].update(model={"name": "tiny",
                                                                                    "options": {"width": "wide"}}))
    with pytest.raises(SpecError) as err:
        lint_spec(path)
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "width:" in t)
    assert err.value.problems == [f"{path}:{line}: training.model.options.width: 'wide' is not of type 'integer'"]
    check_model_options(parse_spec(example_data()))  # mlp's defaults pass its own schema
    gpt_bad = registry.check_options("gpt", {"layers": 0, "heads": "4"})
    assert gpt_bad == ["training.model.options.heads: '4' is not of type 'integer'",
                       "training.model.options.layers: 0 is less than the minimum of 1"]


def test_gpt_shapes_and_causality():
    import torch

    model = build_configured_model(_section("gpt", {"layers": 2, "width": 32, "heads": 4}, LM_DATA)).eval()
    tokens = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (3, 12, 40)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 40  # a future token for positions 0-6
    after = model(changed)
    assert torch.equal(after[:, :7], logits[:, :7])  # the past does not see it
    assert not torch.allclose(after[:, 7:], logits[:, 7:])
    assert model.head.weight is model.embed.weight  # tied
    assert model(tokens[:, :5]).shape == (3, 5, 40)  # shorter sequences too
    with pytest.raises(ConfigFailure, match=r"width 30 must be a multiple of heads 4"):
        build_configured_model(_section("gpt", {"width": 30, "heads": 4}, LM_DATA))
    no_vocab = {k: v for k, v in LM_DATA.items() if k != "vocab_size"}
    with pytest.raises(ConfigFailure, match=r"set training\.model\.options\.vocab_size"):
        build_configured_model(_section("gpt", {}, no_vocab))


@pytest.mark.parametrize("feature,label", [([10, 12], [10, 12]), ([10, 12, 3], [10, 12]), ([6, 8, 8], [6, 8, 8]),
                                           ([6, 8, 8, 2], [6, 8, 8])])
def test_unet_in_2d_and_3d_by_the_label_rank(feature, label):
    import torch

    data = {"task": "segmentation", "input_shape": feature, "input_dtype": "float32", "target_shape": label,
            "num_classes": 3, "inputs": {"image": {"shape": feature, "dtype": "float32"}}}
    model = build_configured_model(_section("unet", {"depth": 2, "base_width": 4}, data)).eval()
    out = model(torch.randn(2, *feature))
    assert out.shape == (2, 3, *label)
    convs = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    assert {type(m).__name__ for m in convs} == {"Conv2d" if len(label) == 2 else "Conv3d"}


def test_mlp_takes_several_features_as_a_dict_and_regresses_a_shape():
    import torch

    data = {"task": "regression", "input_shape": [4], "input_dtype": "float32", "target_shape": [2, 3],
            "inputs": {"a": {"shape": [4], "dtype": "float32"}, "b": {"shape": [], "dtype": "int64"}}}
    model = build_configured_model(_section("mlp", {"hidden_size": 8}, data))
    out = model({"a": torch.randn(5, 4), "b": torch.arange(5)})
    assert out.shape == (5, 2, 3)
    with pytest.raises(ConfigFailure, match=r"model 'cnn' takes one feature field, the data has 2 \(a, b\)"):
        build_configured_model(_section("cnn", {}, {**data, "task": "classification", "num_classes": 2}))


def test_hf_causal_lm_without_transformers_is_a_config_failure_naming_the_extra():
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigFailure, match=r"hf_causal_lm .* failed to build the model: ImportError:"
                                                r" hf_causal_lm needs the transformers package: pip install"
                                                r" 'ballast\[hf\]'"):
            build_configured_model(_section("hf_causal_lm", {"config": {"model_type": "gpt2"}}, LM_DATA))
    else:
        model = build_configured_model(_section("hf_causal_lm", {"config": {"model_type": "gpt2", "n_layer": 1,
                                                                            "n_embd": 16, "n_head": 2,
                                                                            "vocab_size": 40}}, LM_DATA))
        import torch

        assert model(torch.zeros(2, 12, dtype=torch.int64)).shape == (2, 12, 40)
    assert registry.check_options("hf_causal_lm", {}) == [
        "training.model.options: {} is not valid under any of the given schemas"]


def test_a_checkpoint_of_a_tied_model_counts_its_parameters_once(tmp_path):
    from ballast.stages.verify_checkpoint import describe, load_model
    from ballast.training import checkpoint as ckpt

    section = _section("gpt", {"layers": 1, "width": 16, "heads": 2}, LM_DATA)
    model = build_configured_model(section)
    w = ckpt.Writer(tmp_path, 5, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", model.state_dict())
    w.write_json("trainer.json", {"step": 5, "model": section.model_dump(mode="json")})
    path = w.commit()
    unique = sum(p.numel() for p in model.parameters())
    assert describe(path).parameters == unique < sum(t.numel() for t in model.state_dict().values())
    rebuilt = load_model(path)
    assert rebuilt.head.weight is rebuilt.embed.weight  # still tied after loading


def test_a_run_checks_the_options_before_any_data_is_read(monkeypatch):
    from ballast.pipeline.context import RunContext
    from ballast.stages import validate

    d = example_data()
    d["dataset"]["location"] = "raw/nowhere-at-all"  # reading it would fail: the options are checked first
    d["training"]["model"] = {"name": "mlp", "options": {"hidden_size": 0, "depth": 2}}
    ctx = RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id="manual__options")
    monkeypatch.setattr(validate, "raw_files", lambda ctx: pytest.fail("data read before the options were checked"))
    with pytest.raises(SpecError) as err:
        validate.run(ctx)
    assert err.value.problems == ["digits: training.model.options.depth: unknown option; allowed: dropout,"
                                  " hidden_size",
                                  "digits: training.model.options.hidden_size: 0 is less than the minimum of 1"]
