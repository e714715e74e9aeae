"""What publishing and its baseline take from storage, and what the view and a Hugging Face model let run.

A stored model card is storage, not a spec: `evaluation.publish: if_better` builds no baseline from a card
whose model section is out of the spec's bounds or names another model than the spec's (one warning,
nothing fetched or built). The tokenizer published beside a language model is the file the data was
tokenized with: its sha256 is checked against the dataset's manifest before anything is uploaded.
`hf_causal_lm` never runs a model folder's own code nor downloads; the stability view's pages take
script from the app's static folder only, not from the whole origin (which serves Data Docs pages too).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from ballast.errors import DataError

# train imports Airflow (ballast.recovery.policy), whose logging setup replaces the root logger's handlers,
# caplog's among them: imported here, before any test captures a log.
from ballast.stages import evaluate, publish, train  # noqa: F401
from datasets import text_edit
from helpers import make_ctx

pytestmark = pytest.mark.unit

VERSION = "20261205T000000Z-r1"
# The spec's model as text_edit writes it (gpt, 1 layer of width 32, 2 heads; seq_len 16) on the byte
# vocabulary's 257 ids: what its checkpoints record and what a card of the same model holds.
SPEC_MODEL = {"name": "gpt", "options": {"layers": 1, "width": 32, "heads": 2},
              "data": {"task": "causal_lm", "input_shape": [16], "input_dtype": "int64", "seq_len": 16,
                       "vocab_size": 257, "inputs": {"tokens": {"shape": [16], "dtype": "int64"}}}}


def _lm_ctx(tmp_path: Path, *, tokenizer: dict | None = None, policy: str = "if_better"):
    def edit(d):
        text_edit(tmp_path / "raw.parquet", tokenizer=tokenizer)(d)
        d["evaluation"]["publish"] = policy

    return make_ctx(tmp_path, tmp_path / "raw.parquet", edit)


# --- item 7: the if_better baseline from a stored card -------------------------------------------------------


def _with_card(tmp_path: Path, section: dict):
    """A run whose warm cache holds the byte vocabulary's manifest, and a published version whose card
    holds `section` as its model."""
    from ballast.records import WarmCacheResult
    from ballast.training.dataset.format import FORMAT_VERSION

    ctx = _lm_ctx(tmp_path)
    cache = tmp_path / "cache" / "lm"
    cache.mkdir(parents=True)
    (cache / "manifest.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION, "columns": {"tokens": {"shape": [17], "dtype": "int32"}},
        "tokenizer": {"kind": "bytes", "sha256": None, "vocab_size": 257, "eot_id": 256}}))
    ctx.save_result("warm_cache", WarmCacheResult(cache_dir=str(cache), format="petastorm", phases=[],
                                                  pending_phases=0, seconds=0.0))
    prefix = f"models/{ctx.spec.name}/{VERSION}"
    card = {"version": VERSION, "model_section": section, "weights_file": "model.safetensors",
            "weights_sha256": "0" * 64}
    ctx.storage.write_bytes(f"{prefix}/model_card.json", json.dumps(card).encode())
    ctx.storage.write_bytes(f"{prefix}/PUBLISHED", VERSION.encode())
    ctx.storage.write_bytes(f"models/{ctx.spec.name}/LATEST", f"{VERSION}\n".encode())
    return ctx


def _no_fetch_or_build(monkeypatch):
    from ballast.storage import models as registry

    def refuse(*args, **kwargs):
        raise AssertionError("the published weights were fetched or a model was built")

    monkeypatch.setattr(registry, "weights", refuse)
    monkeypatch.setattr(registry, "load", refuse)
    monkeypatch.setattr("ballast.training.models.build_configured_model", refuse)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ballast" and r.levelno == logging.WARNING]


def _data(**changes) -> dict:
    return {**SPEC_MODEL, "data": {**SPEC_MODEL["data"], **changes}}


@pytest.mark.parametrize("section,field,bound", [
    (_data(seq_len=2**40, input_shape=[2**40], inputs={"tokens": {"shape": [2**40], "dtype": "int64"}}),
     "model_section.data.seq_len", "must be <= 1048576"),
    (_data(seq_len=2**40), "model_section.data.seq_len", "must be <= 1048576"),
    (_data(vocab_size=2**40), "model_section.data.vocab_size", "must be <= 2147483647"),
    (_data(num_classes=2**40), "model_section.data.num_classes", "must be <= 100000"),
], ids=["seq_len-and-shapes", "seq_len", "vocab_size", "num_classes"])
def test_a_card_whose_model_sizes_are_out_of_bounds_is_no_baseline_and_nothing_is_built(
        tmp_path, monkeypatch, caplog, section, field, bound):
    ctx = _with_card(tmp_path, section)
    _no_fetch_or_build(monkeypatch)
    with caplog.at_level(logging.INFO, logger="ballast"):
        assert evaluate._published(ctx, budget=1 << 30) == (None, None)
    [line] = _warnings(caplog)
    assert f"{VERSION}/model_card.json: {field}: {bound} (got {2**40})" in line, line
    assert f"the published model {VERSION} is no baseline" in line


@pytest.mark.parametrize("section,differs", [
    ({**SPEC_MODEL, "options": {**SPEC_MODEL["options"], "width": 64}}, "options.width 64 vs 32"),
    ({**SPEC_MODEL, "options": {"layers": 1, "width": 32, "heads": 2, "ffn": 4096}}, "options.ffn 4096 vs (none)"),
    (_data(seq_len=32, input_shape=[32], inputs={"tokens": {"shape": [32], "dtype": "int64"}}),
     "data.seq_len 32 vs 16"),
    (_data(vocab_size=50_000), "data.vocab_size 50000 vs 257"),
], ids=["width", "extra-option", "seq_len", "vocab_size"])
def test_a_card_of_another_model_than_the_specs_is_no_baseline(tmp_path, monkeypatch, caplog, section, differs):
    ctx = _with_card(tmp_path, section)
    _no_fetch_or_build(monkeypatch)
    with caplog.at_level(logging.INFO, logger="ballast"):
        assert evaluate._published(ctx, budget=1 << 30) == (None, None)
    [line] = _warnings(caplog)
    assert "another model than this spec trains" in line and differs in line, line


def test_a_card_that_is_not_a_model_section_is_no_baseline(tmp_path, monkeypatch, caplog):
    ctx = _with_card(tmp_path, {"name": "gpt", "options": {}, "data": "huge"})
    _no_fetch_or_build(monkeypatch)
    with caplog.at_level(logging.INFO, logger="ballast"):
        assert evaluate._published(ctx, budget=1 << 30) == (None, None)
    [line] = _warnings(caplog)
    assert "model_section must be a mapping of name, options and data" in line, line


def test_a_card_of_the_specs_model_is_the_baseline(tmp_path, monkeypatch, caplog):
    from ballast.storage import models as registry

    ctx = _with_card(tmp_path, SPEC_MODEL)
    calls = []
    monkeypatch.setattr(registry, "weights", lambda ctx, published, dest: calls.append(published.version) or "w")
    monkeypatch.setattr(registry, "load", lambda path, section, **kw: calls.append((path, section)) or "baseline")
    with caplog.at_level(logging.INFO, logger="ballast"):
        model, published = evaluate._published(ctx, budget=1 << 30)
    assert model == "baseline" and published.version == VERSION
    assert calls == [VERSION, ("w", SPEC_MODEL)] and not _warnings(caplog)


# --- item 9: the published tokenizer is the one the data was tokenized with ----------------------------------


TOKENIZER = b'{"version": "1.0", "model": {"type": "BPE", "vocab": {"<|endoftext|>": 0}}}'


def _checkpoint(root: Path) -> Path:
    """A committed checkpoint of a tiny tensor that records the spec's model (publish exports it as is)."""
    import torch
    from ballast.training import checkpoint as ckpt

    w = ckpt.Writer(root, 1, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", {"w": torch.ones(3)})
    w.write_json("trainer.json", {"step": 1, "model": SPEC_MODEL, "history": []})
    return w.commit()


def _converted(ctx, tmp_path: Path, recorded: bytes, monkeypatch):
    """The stages' records publish reads, the dataset's manifest recording the tokenizer file `recorded`
    was tokenized with."""
    prefix = "datasets/lm/d1"
    ctx.storage.write_bytes(f"{prefix}/manifest.json", json.dumps({"tokenizer": {
        "kind": "file", "sha256": hashlib.sha256(recorded).hexdigest(), "vocab_size": 1, "eot_id": 0,
        "token_bytes": [0]}}).encode())
    best = _checkpoint(tmp_path / "ckpt")
    scores = SimpleNamespace(model_dump=lambda **kw: {"metric": "loss", "value": 1.0})
    records = {
        "convert": SimpleNamespace(prefix=prefix, dataset_id="d1"),
        "evaluate": SimpleNamespace(checkpoint=str(best), scores=lambda: scores, metric="loss", value=1.0,
                                    baseline=None, baseline_version=None),
        "train": SimpleNamespace(epochs=1, steps=1, stopped_early=False, checkpoint_dir=str(tmp_path / "ckpt"),
                                 warm_started_from=None),
        "verify_checkpoint": SimpleNamespace(best=SimpleNamespace(step=1), quarantined=[]),
        "validate": SimpleNamespace(input_fingerprint="f1"),
        "warm_cache": SimpleNamespace(),
    }
    monkeypatch.setattr(ctx, "result", lambda stage: records[stage])


@pytest.mark.parametrize("stored", [b'{"version": "1.0", "changed": true}', None], ids=["changed", "missing"])
def test_a_tokenizer_that_is_not_the_one_the_data_was_tokenized_with_fails_before_anything_is_uploaded(
        tmp_path, monkeypatch, stored):
    ctx = _lm_ctx(tmp_path, tokenizer={"file": "tokenizers/lm.json"}, policy="always")
    _converted(ctx, tmp_path, TOKENIZER, monkeypatch)
    if stored is not None:  # the file in storage replaced after conversion
        ctx.storage.write_bytes("tokenizers/lm.json", stored)
    want = hashlib.sha256(TOKENIZER).hexdigest()
    if stored is None:
        message = rf"'tokenizers/lm.json' cannot be read .* restore the tokenizer file .* \(sha256 {want}\)"
    else:
        message = (rf"tokenizers/lm.json has sha256 {hashlib.sha256(stored).hexdigest()}, but the data was"
                   rf" tokenized with a file of sha256 {want} \(.*datasets/lm/d1/manifest.json\).*restore the file")
    with pytest.raises(DataError, match=message):
        publish.run(ctx)
    assert not list(ctx.storage.list(f"models/{ctx.spec.name}/")), "something of the model was published"


def test_the_tokenizer_published_is_the_bytes_checked_from_storage_or_a_local_path(tmp_path, monkeypatch):
    local = tmp_path / "tok.json"
    local.write_bytes(TOKENIZER)
    for name in ("tokenizers/lm.json", str(local)):
        ctx = _lm_ctx(tmp_path, tokenizer={"file": name}, policy="always")
        ctx.storage.write_bytes("tokenizers/lm.json", TOKENIZER)
        _converted(ctx, tmp_path, TOKENIZER, monkeypatch)
        info, data = publish._tokenizer(ctx, ctx.result("convert"))
        assert data == TOKENIZER and info["file"] == "tokenizer.json" and info["source_key"] == name
        assert info["sha256"] == hashlib.sha256(TOKENIZER).hexdigest() and "token_bytes" not in info


# --- item 10a: hf_causal_lm runs no model folder's code and downloads nothing -----------------------------------


def _fake_transformers(monkeypatch) -> list[tuple[str, dict]]:
    """A `transformers` that records how each loader was called and builds a tiny module."""
    from torch import nn

    calls: list[tuple[str, dict]] = []

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(300, 4)

        def get_input_embeddings(self):
            return self.emb

    class AutoModelForCausalLM:
        @staticmethod
        def from_pretrained(path, **kwargs):
            calls.append(("from_pretrained", kwargs))
            return Tiny()

        @staticmethod
        def from_config(config, **kwargs):
            calls.append(("from_config", kwargs))
            return Tiny()

    class AutoConfig:
        @staticmethod
        def for_model(kind, **kwargs):
            calls.append(("for_model", kwargs))
            return SimpleNamespace(model_type=kind, **kwargs)

    fake = types.ModuleType("transformers")
    fake.AutoModelForCausalLM, fake.AutoConfig = AutoModelForCausalLM, AutoConfig
    monkeypatch.setitem(sys.modules, "transformers", fake)
    return calls


def _model_dir(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    return path


LM_DATA = {"task": "causal_lm", "vocab_size": 257}


def test_hf_causal_lm_loads_without_remote_code_or_downloads(tmp_path, monkeypatch):
    from ballast.training.models.hf import hf_causal_lm

    calls = _fake_transformers(monkeypatch)
    hf_causal_lm({"path": str(_model_dir(tmp_path, {"model_type": "gpt2"}))}, LM_DATA)
    hf_causal_lm({"config": {"model_type": "gpt2", "n_layer": 1}}, LM_DATA)
    [(_, pretrained), (_, for_model), (_, from_config)] = calls
    assert pretrained["trust_remote_code"] is False and pretrained["local_files_only"] is True
    assert pretrained["use_safetensors"] is True
    assert from_config["trust_remote_code"] is False and for_model == {"n_layer": 1}


@pytest.mark.parametrize("where", ["path", "config"])
def test_hf_causal_lm_refuses_a_config_that_names_code_of_its_own(tmp_path, monkeypatch, where):
    from ballast.training.models.hf import hf_causal_lm

    calls = _fake_transformers(monkeypatch)
    config = {"model_type": "gpt2", "auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilLM"}}
    options = {"path": str(_model_dir(tmp_path, config))} if where == "path" else {"config": config}
    with pytest.raises(ValueError, match=r"names code of its own \(auto_map .*modeling_evil.*remove auto_map"):
        hf_causal_lm(options, LM_DATA)
    assert calls == []


# --- item 10b: the view's scripts come from its static folder only --------------------------------------------


def _request(host: str | None, root_path: str = "/ballast", scheme: str = "http"):
    from ballast.ui import app as ui
    from starlette.requests import Request

    headers = [(b"host", host.encode())] if host is not None else []
    return Request({"type": "http", "app": ui.create_app(SimpleNamespace()), "path": "/", "root_path": root_path,
                    "scheme": scheme, "headers": headers, "query_string": b""})


def _policy(resp) -> dict[str, list[str]]:
    return {d.split()[0]: d.split()[1:] for d in resp.headers["content-security-policy"].split("; ")}


@pytest.mark.parametrize("host,scheme,source", [
    ("airflow.example:8080", "http", "http://airflow.example:8080/ballast/static/"),
    ("airflow.example", "https", "https://airflow.example/ballast/static/"),
    ("[::1]:8080", "http", "http://[::1]:8080/ballast/static/"),
    ("evil; script-src *", "http", "'none'"),
    (None, "http", "'none'"),
])
def test_the_page_policy_allows_script_from_the_static_folder_only(host, scheme, source):
    from ballast.ui import app as ui

    resp = ui._page(_request(host, scheme=scheme), "overview", "Ballast pipelines", api="/x", pipeline="/y")
    csp = _policy(resp)
    assert csp["script-src"] == [source], csp
    assert "'self'" not in csp["script-src"] and "*" not in csp["script-src"]
    assert 'src="/ballast/static/uplot/uPlot.iife.min.js"' in resp.body.decode()  # the page's scripts: under it
