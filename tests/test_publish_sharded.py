"""Published models in the Hugging Face layout for large models (issue 25, item 4): a model larger than
`evaluation.publish_shard_bytes` is published as `model-0000k-of-0000N.safetensors` plus
`model.safetensors.index.json`, written from the checkpoint's shards one output file at a time (never the
whole model in one process), loadable by plain `safetensors` following the index, and giving the same
outputs as the trained model; one that fits a shard is the one `model.safetensors` it always was."""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from pathlib import Path

import pytest
from ballast.errors import BallastError
from ballast.training.checkpoint import export, published
from ballast.training.failure import CheckpointFailure

GPT = {"name": "gpt", "options": {"layers": 2, "width": 32, "heads": 2},
       "data": {"task": "causal_lm", "vocab_size": 256, "seq_len": 32, "input_shape": [32], "input_dtype": "int64",
                "inputs": {"tokens": {"shape": [32], "dtype": "int64"}}}}


def _model(seed: int = 0):
    import torch
    from ballast.training.config.run import ModelConfig
    from ballast.training.models import build_configured_model

    torch.manual_seed(seed)
    return build_configured_model(ModelConfig.model_validate(GPT))


def _dcp_checkpoint(path: Path, state: dict) -> Path:
    """A one-process DCP checkpoint of `state` in the trainer's layout ({model: state}, DCP's files)."""
    import warnings

    import torch.distributed.checkpoint as dcp_api

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp_api.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    return path


def _load_by_index(folder: Path) -> dict:
    """What a user without Ballast does: read the index, safetensors.torch.load_file each file it names."""
    from safetensors.torch import load_file

    index = json.loads((folder / published.INDEX).read_text())
    out = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(folder / name)))
    assert set(out) == set(index["weight_map"])
    return out


def _same_outputs(a, b) -> None:
    import torch

    tokens = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    a.eval()
    b.eval()
    with torch.no_grad():
        assert torch.equal(a(tokens), b(tokens))


@pytest.mark.unit
def test_a_model_over_the_shard_size_is_published_as_shards_that_safetensors_loads(tmp_path):
    model = _model()
    src = _dcp_checkpoint(tmp_path / "ckpt", model.state_dict())
    sizes = export.source(src).sizes
    total = sum(sizes.values())
    limit = total // 5
    done = export.export(src, tmp_path / "pub", max_shard_bytes=limit, metadata={"pipeline": "p"})
    n = len(done.files) - 1
    assert n >= 3 and done.weights_file == published.INDEX and done.files[-1] == published.INDEX
    assert done.files[:-1] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == sorted(done.files)  # no temporary left
    index = json.loads((tmp_path / "pub" / published.INDEX).read_text())
    assert index["metadata"]["total_size"] == total == done.total_size
    assert list(index["weight_map"]) == list(model.state_dict())  # every tensor, tied ones too, in order
    largest = max(sizes.values())
    for name in done.files[:-1]:
        held = sum(sizes[k] for k, f in index["weight_map"].items() if f == name)
        assert held <= limit or held == largest, (name, held)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "pub" / done.files[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "pipeline": "p"}  # "format": transformers requires it
    loaded = _model(seed=7)  # other weights, until the published ones are loaded
    loaded.load_state_dict(_load_by_index(tmp_path / "pub"))
    _same_outputs(model, loaded)
    # Ballast's own loader (warm start, the if_better baseline) reads the index the same way.
    from ballast.training.checkpoint import load_tensors

    again = load_tensors(tmp_path / "pub" / published.INDEX)
    assert list(again) == list(index["weight_map"])


@pytest.mark.unit
def test_a_model_that_fits_one_shard_is_one_model_safetensors_and_a_new_export_replaces_the_old_layout(tmp_path):
    from safetensors.torch import load_file

    model = _model()
    src = _dcp_checkpoint(tmp_path / "ckpt", model.state_dict())
    export.export(src, tmp_path / "pub", max_shard_bytes=10_000)
    done = export.export(src, tmp_path / "pub")
    assert done.files == [published.SINGLE] == [p.name for p in (tmp_path / "pub").iterdir()]
    loaded = _model(seed=7)
    loaded.load_state_dict(load_file(str(tmp_path / "pub" / published.SINGLE)))
    _same_outputs(model, loaded)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["model.pt", "safetensors file"])
def test_a_ddp_checkpoint_or_a_tensor_file_exports_in_shards_too(tmp_path, kind):
    """model.pt (a DDP checkpoint's, read through mmap) and a safetensors file (read lazily) are sources too;
    tied tensors are each written in full."""
    import torch
    from safetensors.torch import save_file

    model = _model()
    state = model.state_dict()
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()  # tied
    if kind == "model.pt":
        (tmp_path / "ckpt").mkdir()
        torch.save(state, tmp_path / "ckpt" / "model.pt")
        src = tmp_path / "ckpt"
    else:
        src = tmp_path / "w.safetensors"
        save_file({k: v.clone() for k, v in state.items()}, str(src))
    done = export.export(src, tmp_path / "pub", max_shard_bytes=20_000)
    assert len(done.files) >= 4 and done.total_size == sum(v.numel() * v.element_size() for v in state.values())
    loaded = _model(seed=7)
    loaded.load_state_dict(_load_by_index(tmp_path / "pub"))
    _same_outputs(model, loaded)


@pytest.mark.unit
def test_the_plan_keeps_the_order_closes_a_shard_before_it_overflows_and_gives_a_large_tensor_a_file():
    sizes = {"a": 40, "b": 40, "c": 30, "big": 250, "d": 10, "e": 100, "f": 1}
    assert export.plan(sizes, 100) == [["a", "b"], ["c"], ["big"], ["d"], ["e"], ["f"]]
    assert export.plan(sizes, 1000) == [list(sizes)]
    assert export.plan({}, 100) == [[]]
    with pytest.raises(CheckpointFailure, match="max_shard_bytes must be >= 1"):
        export.plan(sizes, 0)


@pytest.mark.unit
def test_export_holds_one_shard_of_tensors_at_a_time(tmp_path, monkeypatch):
    """Every tensor the export reads is tracked until it is freed: the bytes alive at once never exceed
    one shard (max_shard_bytes, or the one larger tensor), where the model is several times that."""
    import torch

    state = {f"layer{i}.weight": torch.randn(64, 64) for i in range(12)}
    state["big"] = torch.randn(256, 64)  # 64 KiB: larger than a shard
    src = _dcp_checkpoint(tmp_path / "ckpt", state)
    limit = 3 * 64 * 64 * 4
    alive, peak, reads = {}, [0], []
    real = export.source

    def tracked(path):
        s = real(path)

        def read(names):
            out = s.read(names)
            for t in out.values():
                alive[id(t)] = t.numel() * t.element_size()
                weakref.finalize(t, alive.pop, id(t), None)
            peak[0] = max(peak[0], sum(alive.values()))
            reads.append(list(names))
            return out

        return export.Source(s.sizes, read)

    monkeypatch.setattr(export, "source", tracked)
    done = export.export(src, tmp_path / "pub", max_shard_bytes=limit)
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert len(reads) == len(done.files) - 1 >= 5 and sorted(k for r in reads for k in r) == sorted(state)
    assert peak[0] == 256 * 64 * 4 and peak[0] < total / 3  # the largest shard (the big tensor), not the model
    assert not alive  # nothing kept after its file was written
    loaded = _load_by_index(tmp_path / "pub")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.unit
def test_the_mean_of_sharded_checkpoints_is_exported_a_shard_at_a_time(tmp_path, monkeypatch):
    """`python -m ballast.training.average ... --out DIR`'s export: each output shard's tensors are read
    from every checkpoint in turn and averaged, never the whole model; the files hold the mean."""
    import torch
    from ballast.training.checkpoint.average import average, averaged

    states = [{f"layer{i}.weight": torch.randn(64, 64) for i in range(6)} for _ in range(3)]
    paths = [_dcp_checkpoint(tmp_path / f"ckpt{k}", st) for k, st in enumerate(states)]
    reads: list[list[str]] = []
    real = export.source

    def tracked(path):
        s = real(path)
        return export.Source(s.sizes, lambda names: (reads.append(list(names)), s.read(names))[1])

    monkeypatch.setattr(export, "source", tracked)
    done = export.export(averaged(paths), tmp_path / "avg", max_shard_bytes=2 * 64 * 64 * 4)
    assert len(done.files) == 4 and len(reads) == 3 * 3  # 3 shards, each read from the 3 checkpoints
    assert all(len(r) == 2 for r in reads)  # a shard's two tensors at a time, not the six
    loaded = _load_by_index(tmp_path / "avg")
    for k in states[0]:
        mean = (states[0][k].double() + states[1][k].double() + states[2][k].double()) / 3
        assert torch.equal(loaded[k], mean.float())
    assert loaded.keys() == average(paths).keys()


_PEAK = """
import gc, re, sys
from pathlib import Path
from ballast.training.checkpoint import export, model_weights

def status(field):
    return int(re.search(field + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10

src, how = Path(sys.argv[1]), sys.argv[2]
import torch, torch.distributed.checkpoint, safetensors.torch  # imported before the baseline
gc.collect()
before = status("VmRSS")
if how == "whole":
    result = model_weights(src)
else:
    result = export.export(src, Path(sys.argv[3]), max_shard_bytes=int(sys.argv[4]))
print(status("VmHWM") - before)
"""


def _peak_added(*args: str) -> int:
    """The most resident memory the export (or the whole-model read) adds to a fresh process, by the
    kernel's high-water mark: a process of its own, so no memory an earlier test freed is reused."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _PEAK, *args], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return int(run.stdout.split()[-1])


@pytest.mark.integration
def test_the_exports_resident_memory_grows_with_a_shard_not_with_the_model(tmp_path):
    """By the kernel's own count (VmHWM): exporting a 160 MiB checkpoint in 8 MiB shards adds a small
    fraction of the model to the process, where reading the whole model (what publishing did) adds all of it."""
    import torch

    mib = 1 << 20
    src = _dcp_checkpoint(tmp_path / "ckpt", {f"w{i}": torch.randn(mib // 2) for i in range(80)})  # 2 MiB each
    total = 80 * 2 * mib
    whole = _peak_added(str(src), "whole")
    sharded = _peak_added(str(src), "export", str(tmp_path / "pub"), str(8 * mib))
    assert len(list((tmp_path / "pub").glob("model-*-of-00020.safetensors"))) == 20
    assert whole >= 0.95 * total, whole  # the measure sees a gather
    # One shard's tensors, the copy of them safetensors serializes, a piece being read (about 23 MiB here):
    # a quarter of the model at most, where a gather is all of it.
    assert sharded <= 5 * 8 * mib, (sharded / mib, total / mib)


@pytest.mark.unit
def test_a_damaged_shard_or_index_is_a_clear_error_naming_the_file(tmp_path):
    from ballast.training.checkpoint import load_tensors

    src = _dcp_checkpoint(tmp_path / "ckpt", _model().state_dict())
    done = export.export(src, tmp_path / "pub", max_shard_bytes=20_000)
    pub, index = tmp_path / "pub", tmp_path / "pub" / published.INDEX
    second = pub / done.files[1]
    good = second.read_bytes()
    second.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(CheckpointFailure, match=rf"{re.escape(str(second))}: cannot load as a safetensors shard"):
        load_tensors(index)
    second.unlink()
    with pytest.raises(CheckpointFailure, match=rf"{re.escape(str(second))}: cannot load"):
        load_tensors(index)
    second.write_bytes(good)
    first = pub / done.files[0]
    first.rename(tmp_path / "first")
    second.rename(first)  # a shard under another shard's name: other tensors than the index maps to it
    with pytest.raises(CheckpointFailure, match=rf"{re.escape(str(first))}: holds other tensors than"):
        load_tensors(index)
    raw = json.loads(index.read_text())
    for bad, what in [({**raw, "weight_map": {"x": "../../etc/model.safetensors"}}, "not one set of shards"),
                      ({**raw, "weight_map": {"x": "model-00001-of-00002.safetensors"}}, "not one set of shards"),
                      ({"metadata": {}}, "weight_map must map")]:
        index.write_text(json.dumps(bad))
        with pytest.raises(CheckpointFailure, match=rf"{re.escape(str(index))}: .*{what}"):
            load_tensors(index)
    index.write_text("{not json")
    with pytest.raises(CheckpointFailure, match=rf"{re.escape(str(index))}: not a safetensors index"):
        load_tensors(index)


@pytest.mark.unit
def test_a_damaged_rank_file_stops_the_export_the_contents_check_and_the_model_read_naming_it(tmp_path):
    from ballast.training.checkpoint import dcp

    src = _dcp_checkpoint(tmp_path / "ckpt", _model().state_dict())
    rank = src / "__0_0.distcp"
    whole = rank.read_bytes()
    rank.write_bytes(whole[:1000])  # truncated: the metadata's pieces lie past its end, refused before any read
    for read in (lambda: export.export(src, tmp_path / "pub", max_shard_bytes=20_000), lambda: dcp.check(src),
                 lambda: dcp.model_weights(src)):
        with pytest.raises(CheckpointFailure, match=r"ckpt/\.metadata: piece of '.+' lies past the end of __0_0\.distcp"
                                                    r" \(1000 bytes\)"):
            read()
    rank.write_bytes(whole.replace(b"PK", b"XX"))  # the same size, its records' headers damaged
    with pytest.raises(CheckpointFailure, match=r"cannot read the shards __0_0\.distcp through DCP"):
        export.export(src, tmp_path / "pub", max_shard_bytes=20_000)
    assert not list((tmp_path / "pub").glob("*.safetensors"))
    # DCP's CheckpointException derives from BaseException: the gate's check and the stages' read name it too.
    with pytest.raises(CheckpointFailure, match=r"cannot read the shard __0_0\.distcp through DCP"):
        dcp.check(src)
    with pytest.raises(CheckpointFailure, match=r"ckpt: cannot read the model's shards through DCP"):
        dcp.model_weights(src)


# --- the registry: publishing and fetching both layouts -------------------------------------------------------


def _ctx(tmp_path):
    from ballast.pipeline.context import RunContext
    from ballast.spec import parse_spec
    from helpers import example_data

    d = example_data()
    d["storage"]["uri"] = str(tmp_path / "storage")
    return RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id="r1")


def _publish_sharded(ctx, folder: Path, files: list[str], version: str = "20261205T000000Z-r1") -> str:
    """Store `files` of `folder` as publish does: every weights file, the card, PUBLISHED, then LATEST."""
    prefix = f"models/{ctx.spec.name}/{version}"
    sha = {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in files}
    for f in files:
        ctx.storage.upload(folder / f, f"{prefix}/{f}")
    card = {"version": version, "model_section": GPT, "weights_file": files[-1], "weights_sha256": sha[files[-1]],
            "weights_shards": {f: s for f, s in sha.items() if f != files[-1]} or None}
    ctx.storage.write_bytes(f"{prefix}/model_card.json", json.dumps(card).encode())
    ctx.storage.write_bytes(f"{prefix}/PUBLISHED", version.encode())
    ctx.storage.write_bytes(f"models/{ctx.spec.name}/LATEST", f"{version}\n".encode())
    return prefix


@pytest.mark.unit
def test_the_registry_fetches_checks_and_loads_sharded_weights(tmp_path):
    from ballast.storage import models as registry

    ctx = _ctx(tmp_path)
    model = _model()
    done = export.export(_dcp_checkpoint(tmp_path / "ckpt", model.state_dict()), tmp_path / "pub",
                         max_shard_bytes=20_000)
    prefix = _publish_sharded(ctx, tmp_path / "pub", done.files)
    dest = tmp_path / "work"
    path = registry.weights(ctx, registry.latest(ctx), dest)
    assert path == dest / "20261205T000000Z-r1" / published.INDEX
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(done.files)
    _same_outputs(model, registry.load(path, GPT))  # the if_better baseline's load
    # A cached shard changed on disk: checked again and fetched again.
    cached = path.parent / done.files[1]
    cached.write_bytes(b"tampered")
    assert registry.weights(ctx, registry.latest(ctx), dest) == path
    assert cached.read_bytes() == (tmp_path / "pub" / done.files[1]).read_bytes()
    # A stored shard that no longer matches the card: refused naming it, no partial file left.
    ctx.storage.write_bytes(f"{prefix}/{done.files[2]}", b"swapped")
    (path.parent / done.files[2]).unlink()
    with pytest.raises(BallastError, match=rf"{re.escape(done.files[2])}: its sha256 differs from the model card"):
        registry.weights(ctx, registry.latest(ctx), dest)
    assert not list(path.parent.glob(".*.part"))


@pytest.mark.unit
@pytest.mark.parametrize("shards", [None, {}, {"../../x.safetensors": "0" * 64}, {"model-00001-of-00001.safetensors": "z"}])
def test_a_card_with_bad_shard_entries_is_refused_before_any_download(tmp_path, shards):
    from ballast.storage import models as registry

    ctx = _ctx(tmp_path)
    card = {"model_section": GPT, "weights_file": published.INDEX, "weights_sha256": "0" * 64, "weights_shards": shards}
    forged = registry.Published(version="v1", prefix=f"models/{ctx.spec.name}/v1", card=card)
    with pytest.raises(BallastError, match=r"model_card.json: weights_shards must map each shard file"):
        registry.weights(ctx, forged, tmp_path / "work")
    assert not (tmp_path / "x.safetensors").exists()


# --- the pipeline: trained sharded on two ranks, published in shards ---------------------------------------


@pytest.mark.integration
def test_a_model_trained_under_fsdp_on_two_ranks_is_published_in_shards_giving_the_same_outputs(tmp_path, monkeypatch):
    """The stages from raw text to publish (train: torchrun, 2 gloo ranks, FSDP, a DCP checkpoint of one
    file per rank); publish with a small shard size reads the rank files a shard at a time and writes >= 3
    safetensors files and the index, all in storage before PUBLISHED; plain safetensors, following the
    index, loads what gives the trained model's outputs exactly, and so does the registry's load; verify and
    evaluate with the model streamed block by block give the same checkpoints and scores."""
    from ballast.stages import convert, evaluate, publish, train, validate, verify_checkpoint, warm_cache
    from ballast.stages.verify_checkpoint import load_model
    from ballast.storage import FileStorage
    from ballast.storage import models as registry
    from ballast.training.config.run import ModelConfig
    from ballast.training.models import build_configured_model
    from helpers import make_ctx, run_chain, warm_cache_rest
    from workload_data import lm_spec, write_corpus

    raw = write_corpus(tmp_path / "raw", 100_000)

    def edit(d):
        lm_spec(d, raw, epochs=1)
        d["training"].update(parallelism="fsdp", processes_per_node=2)
        d["evaluation"]["publish_shard_bytes"] = 20_000

    ctx = make_ctx(tmp_path, raw, edit)
    stored: list[str] = []
    upload, write_bytes = FileStorage.upload, FileStorage.write_bytes
    monkeypatch.setattr(FileStorage, "upload", lambda self, local, key: (stored.append(key), upload(self, local, key))[1])
    monkeypatch.setattr(FileStorage, "write_bytes", lambda self, key, data: (stored.append(key), write_bytes(self, key, data))[1])
    run_chain(ctx, validate, convert, warm_cache, warm_cache_rest, train, verify_checkpoint, evaluate, publish)
    result = ctx.result("publish")
    assert result.published
    prefix = f"models/{ctx.spec.name}/{result.published_version}"
    card = json.loads(ctx.storage.read_bytes(f"{prefix}/model_card.json"))
    best = Path(card["checkpoint"])
    assert {p.name for p in best.glob("__*_0.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    assert not (best / "model.pt").exists()
    shards = sorted(card["weights_shards"])
    assert card["weights_file"] == published.INDEX and len(shards) >= 3
    assert result.model.endswith(f"{prefix}/{published.INDEX}")
    # Storage received every shard, then the index, the card, PUBLISHED and LATEST, in that order.
    mine = [k.removeprefix(prefix + "/") for k in stored if k.startswith(prefix + "/") or k.endswith("/LATEST")]
    assert sorted(mine[:len(shards)]) == shards
    assert mine[len(shards):] == [published.INDEX, "model_card.json", "PUBLISHED", f"models/{ctx.spec.name}/LATEST"]
    folder = ctx.storage.local_path(prefix)
    assert hashlib.sha256((folder / published.INDEX).read_bytes()).hexdigest() == card["weights_sha256"]
    trained = load_model(best)  # the checkpoint's model, read whole here (the test's reference only)
    model = build_configured_model(ModelConfig.model_validate(card["model"]))
    model.load_state_dict(_load_by_index(folder))
    _same_outputs(trained, model)
    baseline = registry.load(registry.weights(ctx, registry.latest(ctx), tmp_path / "baseline"), card["model_section"])
    _same_outputs(trained, baseline)
    # The probe and evaluate again with no memory to spare for the model's blocks: each block is read from
    # the rank files as it runs (checkpoint.streamed); the same checkpoints pass, with the same scores.
    from ballast.training.checkpoint import streamed

    loaded, load = [], streamed.load
    monkeypatch.setattr(streamed, "memory_budget", lambda: 0)
    monkeypatch.setattr(streamed, "load", lambda *a, **k: (loaded.append(load(*a, **k)), loaded[-1])[1])
    scored = ctx.result("evaluate")
    again = run_chain(ctx, verify_checkpoint, evaluate)
    assert loaded and all(m.ballast_streaming.streamed_blocks == 2 for m in loaded)
    assert again["verify_checkpoint"].best.path == str(best)
    assert again["evaluate"].metrics == scored.metrics and again["evaluate"].metrics


# --- transformers: a hf_causal_lm model published in shards loads with from_pretrained ---------------------

HF = {"name": "hf_causal_lm",
      "options": {"config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 300,
                             "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0}},
      "data": {**GPT["data"], "vocab_size": 257}}

_HF_BUILD = """
import json, sys, warnings
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from ballast.training.config.run import ModelConfig
from ballast.training.models import build_configured_model

section, out = json.loads(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = build_configured_model(ModelConfig.model_validate(section)).eval()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.save({"model": model.state_dict()}, checkpoint_id=out + "/ckpt", no_dist=True)  # the trainer's layout
tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    save_file({"tokens": tokens, "logits": model(tokens)}, out + "/expected.safetensors")
"""

_HF_LOAD = """
import json, sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from ballast.training import checkpoint as ckpt
from ballast.training.config.run import ModelConfig
from ballast.training.models import build_configured_model

section, folder, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
expected = load_file(out + "/expected.safetensors")
hf, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
hf.eval()
ours = build_configured_model(ModelConfig.model_validate(section)).eval()
ours.load_state_dict(ckpt.load_tensors(folder + "/model.safetensors.index.json"))  # Ballast's load (if_better)
with torch.no_grad():
    theirs = hf(input_ids=expected["tokens"], use_cache=False).logits
    again = ours(expected["tokens"])
blocks = [name for name, m in ours.named_modules() if any(m is b for b in ours.ballast_blocks())]
# The same weights saved in fp16 (their config says so, and transformers loads them so): Ballast trains fp32 weights
hf.half().save_pretrained(out + "/fp16")
half = build_configured_model(ModelConfig.model_validate({**section, "options": {"path": out + "/fp16"}}))
print(json.dumps({"class": type(hf).__name__, "info": {k: sorted(map(str, v)) for k, v in info.items()},
                  "blocks": blocks, "fp16_saved_dtypes": sorted({str(p.dtype) for p in half.parameters()}),
                  "transformers": torch.equal(theirs, expected["logits"]), "ballast": torch.equal(again, expected["logits"]),
                  "max_diff": float((theirs - expected["logits"]).abs().max())}))
"""


@pytest.mark.integration
def test_a_hf_causal_lm_published_in_shards_loads_with_transformers_from_pretrained(tmp_path):
    """In a reader environment with transformers (tests/reader_envs/transformers.txt): a hf_causal_lm model
    names its Transformer layers as its FSDP blocks; saved as a DCP checkpoint, it is published (here, in
    the test's environment, without transformers) as
    >= 3 shards in transformers' names with its config.json; `AutoModelForCausalLM.from_pretrained(dir)`
    loads every weight and gives the model's logits exactly, and so does Ballast's own load."""
    from ballast.stages.publish import to_safetensors
    from readers import run_reader

    run_reader("transformers", _HF_BUILD, json.dumps(HF), str(tmp_path))
    folder = tmp_path / "pub"
    files = to_safetensors(tmp_path / "ckpt", folder, metadata={"pipeline": "p"}, max_shard_bytes=20_000,
                           model_section=HF)
    order = list(files)
    assert order[0] == "config.json" and order[-1] == published.INDEX and len(order) >= 5
    assert json.loads((folder / "config.json").read_text()) == HF["options"]["config"]
    names = json.loads((folder / published.INDEX).read_text())["weight_map"]
    assert "transformer.wte.weight" in names and not any(k.startswith("model.") for k in names)
    got = json.loads(run_reader("transformers", _HF_LOAD, json.dumps(HF), str(folder), str(tmp_path)).splitlines()[-1])
    assert got["class"] == "GPT2LMHeadModel"
    assert not any(got["info"].values()), got["info"]  # no missing, unexpected or mismatched weight
    assert got["transformers"] and got["ballast"], got
    # FSDP shards it per Transformer layer: its blocks are transformers' _no_split_modules (GPT2Block)
    assert got["blocks"] == ["model.transformer.h.0", "model.transformer.h.1"], got["blocks"]
    # weights saved in fp16 are trained as fp32 (fp16's loss scaler refuses fp16 gradients; the precision
    # policy casts the compute)
    assert got["fp16_saved_dtypes"] == ["torch.float32"], got
