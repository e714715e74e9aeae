"""FSDP2 per block (ballast.training.fsdp): the built-in models name their blocks, each block and the root
become FSDP units, a model without `ballast_blocks()` is wrapped whole with a warning in the log, the
bf16 mixed-precision policy, activation checkpointing that changes no gradient, the spec field reaching
the run config; and the sharded checkpoint's safety in one process (DCP's `.metadata` unpickled with
DCP's own classes only, pickled values and non-finite pieces refused). In one process: a world-1 gloo
group on an in-memory store, or DCP without a process group (no process is started)."""

from __future__ import annotations

import pytest
from ballast.training import fsdp
from ballast.training.failure import CheckpointFailure, ConfigFailure
from ballast.training.models import build_configured_model

pytestmark = pytest.mark.unit

LM = {"task": "causal_lm", "input_shape": [8], "input_dtype": "int64", "seq_len": 8, "vocab_size": 40,
      "inputs": {"tokens": {"shape": [8], "dtype": "int64"}}}
ROWS = {"task": "classification", "input_shape": [6], "input_dtype": "float32", "num_classes": 3,
        "inputs": {"x": {"shape": [6], "dtype": "float32"}}}
IMAGES = {"task": "classification", "input_shape": [8, 8], "input_dtype": "uint8", "num_classes": 3,
          "inputs": {"x": {"shape": [8, 8], "dtype": "uint8"}}}
SEG = {"task": "segmentation", "input_shape": [8, 8], "input_dtype": "float32", "target_shape": [8, 8],
       "num_classes": 2, "inputs": {"x": {"shape": [8, 8], "dtype": "float32"}}}


def _model(name, options, data):
    from ballast.training.config.run import ModelConfig

    return build_configured_model(ModelConfig(name=name, options=options, data=data))


@pytest.fixture
def group():
    """A one-rank gloo process group on an in-memory store."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name,options,data,expected", [
    ("gpt", {"layers": 3, "width": 16, "heads": 2}, LM, lambda m: list(m.blocks)),
    ("unet", {"depth": 2, "base_width": 4}, SEG, lambda m: [*m.down, *m.merge]),
    ("mlp", {"hidden_size": 8}, ROWS, lambda m: [m.net[0], m.net[3], m.net[5]]),
    ("cnn", {"hidden_size": 8}, IMAGES, lambda m: [m[1], m[3], m[8], m[10]]),
    ("embed", {"hidden_size": 8}, IMAGES, lambda m: [m.values, m.positions, m.head]),
], ids=["gpt", "unet", "mlp", "cnn", "embed"])
def test_built_in_models_name_their_blocks(name, options, data, expected):
    model = _model(name, options, data)
    blocks = fsdp.model_blocks(model)
    assert [id(b) for b in blocks] == [id(b) for b in expected(model)]
    # Disjoint units of the model's own parameters (a parameter in two blocks would be sharded twice).
    owned = [id(p) for b in blocks for p in b.parameters()]
    assert owned and len(owned) == len(set(owned)) and set(owned) <= {id(p) for p in model.parameters()}


def test_blocks_that_are_not_submodules_are_refused():
    import torch

    class Stray(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2)

        def ballast_blocks(self):
            return [self.a, torch.nn.Linear(2, 2)]

    with pytest.raises(ConfigFailure, match=r"ballast_blocks\(\)\[1\] \(Linear\) is not a submodule of the model"):
        fsdp.model_blocks(Stray())


def test_each_block_and_the_root_become_fsdp_units(group):
    import torch
    from torch.distributed.fsdp import FSDPModule

    model = _model("gpt", {"layers": 2, "width": 16, "heads": 2}, LM)
    logs: list[str] = []
    fsdp.shard(model, precision="bf16", activation_checkpointing=False, log=logs.append)
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["", "blocks.0", "blocks.1"] and not logs
    # bf16 parameters and compute, fp32 gradient reduction, fp32 sharded parameters (what the optimizer steps)
    policy = model.blocks[0]._get_fsdp_state()._mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    out = model(torch.randint(0, 40, (2, 8)))
    assert out.dtype == torch.bfloat16


def test_a_model_without_blocks_is_wrapped_whole_with_a_warning(group):
    import torch
    from torch.distributed.fsdp import FSDPModule

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    logs: list[str] = []
    fsdp.shard(model, precision="fp32", activation_checkpointing=True, log=logs.append)
    assert [name for name, m in model.named_modules() if isinstance(m, FSDPModule)] == [""]
    assert logs == [("warning: model Sequential has no ballast_blocks() method: FSDP wraps it whole (every parameter"
                     " gathered at once in forward and backward); no activation checkpointing (it is applied per"
                     " block)")]
    assert model(torch.ones(3, 4)).shape == (3, 2)


def test_a_model_naming_no_block_is_wrapped_whole_with_a_warning(group):
    import torch
    from torch.distributed.fsdp import FSDPModule

    class NoBlocks(torch.nn.Sequential):
        def ballast_blocks(self):
            return []

    model = NoBlocks(torch.nn.Linear(4, 2))
    logs: list[str] = []
    fsdp.shard(model, precision="fp32", activation_checkpointing=False, log=logs.append)
    assert [name for name, m in model.named_modules() if isinstance(m, FSDPModule)] == [""]
    assert logs == ["warning: model NoBlocks names no block (ballast_blocks() is empty): FSDP wraps it whole (every"
                    " parameter gathered at once in forward and backward)"]


@pytest.mark.parametrize("name,options,data", [
    ("gpt", {"layers": 2, "width": 16, "heads": 2}, LM),
    ("unet", {"depth": 2, "base_width": 4}, SEG),
    ("mlp", {"hidden_size": 8}, ROWS),
    ("cnn", {"hidden_size": 8}, IMAGES),
    ("embed", {"hidden_size": 8}, IMAGES),
], ids=["gpt", "unet", "mlp", "cnn", "embed"])
def test_built_in_models_initialize_every_parameter_and_buffer_in_place(name, options, data):
    """What the meta-device build relies on: after to_empty (memory holding anything, NaN here), the
    model's ballast_init_weights() leaves no value unset, computes its buffers as its constructor does,
    and draws each weight from its constructor's distribution."""
    import math

    import torch

    torch.manual_seed(0)
    built = _model(name, options, data)
    with torch.device("meta"):
        model = _model(name, options, data)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(math.nan if t.is_floating_point() else -1)
        model.ballast_init_weights()
    params, buffers = dict(built.named_parameters(remove_duplicate=False)), dict(built.named_buffers())
    for key, value in model.named_parameters():
        assert torch.isfinite(value).all(), f"{name}: {key} left uninitialized"
        ref = params[key]
        if ref.numel() > 64:  # a weight drawn at random: the constructor's spread, within sampling error
            assert abs(value.std().item() / ref.std().item() - 1) < 0.35, f"{name}: {key}"
        elif ref.std().item() == 0:  # constants (norms' ones, zero biases)
            assert torch.equal(value, ref), f"{name}: {key}"
    for key, value in model.named_buffers():
        assert torch.equal(value, buffers[key]), f"{name}: buffer {key} not what the constructor makes"


def test_under_fsdp_the_model_is_built_on_the_meta_device_and_each_rank_allocates_its_shards(group):
    import torch
    from torch.distributed.tensor import DTensor

    from ballast.training.config.run import ModelConfig

    section = ModelConfig(name="gpt", options={"layers": 2, "width": 16, "heads": 2}, data=LM)
    logs: list[str] = []
    state = torch.random.get_rng_state()
    model = fsdp.build_sharded(section, device=torch.device("cpu"), seed=3, rank=0, precision="fp32",
                               activation_checkpointing=False, log=logs.append)
    assert not logs and torch.equal(torch.random.get_rng_state(), state)  # the process's random stream untouched
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
    assert model.head.weight is model.embed.weight  # still tied
    assert torch.allclose(model.cos, _model("gpt", {"layers": 2, "width": 16, "heads": 2}, LM).cos)
    again = fsdp.build_sharded(section, device=torch.device("cpu"), seed=3, rank=0, precision="fp32",
                               activation_checkpointing=False, log=logs.append)
    assert torch.equal(again.embed.weight.to_local(), model.embed.weight.to_local())  # the seed decides
    out = model(torch.randint(0, 40, (2, 8)))
    assert out.shape == (2, 8, 40) and torch.isfinite(out).all()


def test_a_model_that_cannot_initialize_itself_is_built_whole_with_a_line_in_the_log(group, monkeypatch):
    import torch

    from ballast.training.config.run import ModelConfig
    from ballast.training.models import registry

    def plain(options, data):
        return torch.nn.Sequential(torch.nn.Linear(6, 3))

    def reads_values(options, data):  # fine on the CPU, impossible on the meta device
        layer = torch.nn.Linear(6, 3)
        layer.scale = float(layer.weight.abs().max().item())
        return layer

    class Orthogonal(torch.nn.Sequential):
        def ballast_blocks(self):
            return [self[0]]

        def ballast_init_weights(self):
            torch.nn.init.orthogonal_(self[0].weight)  # a QR decomposition: not of a sharded parameter

    def orthogonal(options, data):
        return Orthogonal(torch.nn.Linear(6, 3))

    def reads_weights(options, data):
        raise AssertionError("never called on the meta device")

    reads_weights.meta_build = False
    factories = {"plain": plain, "reads_values": reads_values, "orthogonal": orthogonal,
                 "reads_weights": reads_weights}
    monkeypatch.setattr(registry, "load_factory", factories.__getitem__)
    logs: list[str] = []
    for name in factories:
        section = ModelConfig(name=name, options={}, data=ROWS)
        assert fsdp.build_sharded(section, device=torch.device("cpu"), seed=0, rank=0, precision="fp32",
                                  activation_checkpointing=False, log=logs.append) is None, name
    whole = ": each rank builds it whole before sharding (the whole model in every process while it is built)"
    assert logs[0] == "warning: model plain has no ballast_init_weights() method" + whole
    assert logs[1].startswith("warning: model reads_values cannot be built on the meta device (") and \
        "item() cannot be called on meta tensors" in logs[1] and logs[1].endswith(whole)
    assert logs[2].startswith("warning: model orthogonal ballast_init_weights() fails on sharded parameters (")
    assert logs[3] == ("model reads_weights is built whole on each rank, then sharded (its factory reads weights as"
                       " it builds: no meta-device build)")
    from ballast.training.models import hf

    assert hf.hf_causal_lm.meta_build is False


def test_a_snapshot_of_a_shard_is_a_host_dtensor_over_the_snapshot_buffer(group):
    """The snapshot's DTensor wraps the host buffer itself under the shard's spec: DTensor.from_local
    would move it to the mesh's device (a second device copy of each shard per save on GPUs)."""
    import torch
    from torch.distributed.tensor import DTensor

    from ballast.training.checkpoint.snapshot import Snapshot

    model = _model("gpt", {"layers": 1, "width": 16, "heads": 2}, LM)
    fsdp.shard(model, precision="fp32", activation_checkpointing=False, log=lambda _: None)
    snap = Snapshot(pin=False)
    state = {k: v for k, v in model.state_dict().items()}
    copied = snap.copy(state, ("dcp",))
    for name, live in state.items():
        got = copied[name]
        assert isinstance(got, DTensor) and got._spec == live._spec and got.device.type == "cpu"
        assert got.to_local().data_ptr() == snap.buffers[("dcp", name)].data_ptr() != live.to_local().data_ptr()
        assert torch.equal(got.to_local(), live.to_local()) and got.shape == live.shape


def test_activation_checkpointing_recomputes_blocks_and_keeps_gradients_and_names():
    import torch

    torch.manual_seed(0)
    plain = _model("gpt", {"layers": 2, "width": 16, "heads": 2, "dropout": 0.1}, LM)
    again = _model("gpt", {"layers": 2, "width": 16, "heads": 2, "dropout": 0.1}, LM)
    again.load_state_dict(plain.state_dict())
    names = list(again.state_dict())
    blocks = fsdp.prepare_blocks(again, sharded=False, activation_checkpointing=True, log=print)
    calls = []
    for block in blocks:  # count the forwards of a block's inner module: twice with recomputation
        block.mlp.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 40, (2, 8))
    for model in (plain, again):
        torch.manual_seed(1)  # the same dropout masks
        model(tokens).float().pow(2).mean().backward()
    assert len(calls) == 2 * len(blocks)  # each block's forward ran again in backward
    assert list(again.state_dict()) == names
    for (name, a), b in zip(plain.named_parameters(), again.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_recomputed_blocks_leave_batch_norm_statistics_as_without_recomputation():
    import torch

    torch.manual_seed(0)
    plain = _model("unet", {"depth": 2, "base_width": 4}, SEG)
    again = _model("unet", {"depth": 2, "base_width": 4}, SEG)
    again.load_state_dict(plain.state_dict())
    fsdp.prepare_blocks(again, sharded=False, activation_checkpointing=True, log=print)
    norms = [n for n, m in again.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 2 * 5
    for step in range(3):
        x = torch.randn(4, 8, 8)
        for model in (plain, again):
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
        for (name, a), b in zip(plain.named_parameters(), again.parameters()):
            assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    stats = again.state_dict()
    for name, value in plain.state_dict().items():
        if name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            assert torch.allclose(stats[name].float(), value.float(), atol=1e-6), name  # once per batch, not twice
    assert all(stats[f"{n}.num_batches_tracked"].item() == 3 for n in norms)
    assert all(m.momentum == 0.1 for m in again.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_activation_checkpointing_travels_from_the_spec_to_the_run_config():
    from ballast.errors import SpecError
    from ballast.launch.config import run_config
    from ballast.spec import json_schema, parse_spec
    from helpers import example_data

    field = json_schema()["$defs"]["TrainingSpec"]["properties"]["activation_checkpointing"]
    assert (field["type"], field["default"]) == ("boolean", False)
    d = example_data()
    d["training"].update(parallelism="fsdp", activation_checkpointing=True)
    cfg = run_config(parse_spec(d), data_dir="/d", data_format="tfrecord", checkpoint_dir="/c", output_dir="/o")
    assert cfg.distributed.activation_checkpointing is True
    assert run_config(parse_spec(example_data()), data_dir="/d", data_format="tfrecord", checkpoint_dir="/c",
                      output_dir="/o").distributed.activation_checkpointing is False
    d["training"]["activation_checkpointing"] = "sometimes"
    with pytest.raises(SpecError, match=r"training\.activation_checkpointing"):
        parse_spec(d)


def test_a_dcp_checkpoints_metadata_is_unpickled_with_dcps_own_classes_only(tmp_path):
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp_api
    from ballast.training.checkpoint import dcp

    dcp_api.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    assert "model.w" in dcp.metadata(tmp_path / "ok").state_dict_metadata
    dcp.check(tmp_path / "ok")  # finite tensors only: passes

    class Payload:
        def __reduce__(self):
            return (print, ("unpickled!",))

    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointFailure, match=r"evil/\.metadata: not a DCP checkpoint's metadata \(UnpicklingError:"
                                                r" builtins\.print is not part of a DCP checkpoint's metadata\)"):
        dcp.metadata(tmp_path / "evil")

    class Inside:  # a function of DCP's own modules (one that unpickles a file itself)
        def __reduce__(self):
            from torch.distributed.checkpoint import format_utils

            return (format_utils.torch_save_to_dcp, (str(tmp_path / "x.pt"), str(tmp_path / "y")))

    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(Inside()))
    with pytest.raises(CheckpointFailure, match=r"format_utils\.torch_save_to_dcp is not part of a DCP checkpoint's"):
        dcp.metadata(tmp_path / "evil")
    assert not (tmp_path / "y").exists()


def test_the_gate_refuses_a_dcp_checkpoint_holding_pickled_values(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp_api
    from ballast.training.checkpoint import dcp

    dcp_api.save({"model": {"w": torch.ones(3)}, "extra": {"note": "a string DCP pickles"}},
                 checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(CheckpointFailure, match=r"\.metadata: holds pickled values \(extra\.note\); a Ballast"
                                                r" checkpoint holds tensors only, refusing to unpickle"):
        dcp.check(tmp_path)
    dcp_api.save({"model": {"w": torch.tensor([1.0, float("inf")])}}, checkpoint_id=str(tmp_path / "inf"),
                 no_dist=True)
    with pytest.raises(CheckpointFailure, match=r"inf/__0_0\.distcp: non-finite values in model\.w"):
        dcp.check(tmp_path / "inf")


def test_the_contents_check_reads_whole_files_of_its_share_a_bounded_batch_of_pieces_at_a_time(tmp_path, monkeypatch):
    import torch
    import torch.distributed.checkpoint as dcp_api
    from ballast.training.checkpoint import dcp

    state = {"model": {f"w{i}": torch.full((64,), float(i)) for i in range(6)}}
    state["model"]["w4"][7] = float("nan")
    writer = dcp_api.FileSystemWriter(str(tmp_path), thread_count=2)  # one process, two shard files
    dcp_api.save(state, storage_writer=writer, no_dist=True)
    meta = dcp.metadata(tmp_path)
    where = {i.fqn: s.relative_path for i, s in meta.storage_data.items()}
    files = sorted(set(where.values()))
    assert len(files) == 2
    bad = where["model.w4"]
    from ballast.training.checkpoint.direct_read import reader_class

    reads: list[list[str]] = []
    direct = reader_class(dcp_api.FileSystemReader)  # the read path of dcp.reader's readers
    read_data = direct.read_data
    monkeypatch.setattr(direct, "read_data", lambda self, plan, planner: (
        reads.append([self.storage_data[i.storage_index].relative_path for i in plan.items]),
        read_data(self, plan, planner))[1])
    monkeypatch.setattr(dcp, "_CHECK_BYTES", 2 * 64 * 4)  # two pieces a batch
    for part in range(2):
        reads.clear()
        if files[part] == bad:
            with pytest.raises(CheckpointFailure, match=rf"{bad}: non-finite values in model\.w4"):
                dcp.check(tmp_path, share=(part, 2))
        else:
            dcp.check(tmp_path, share=(part, 2))
            assert {f for batch in reads for f in batch} == {files[part]}, "its own share's file only"
            assert max(map(len, reads)) == 2, "pieces a bounded batch at a time"


def test_dcp_shards_are_hashed_as_they_are_written(tmp_path, group):
    """The digests dcp.write returns (hashed beside the write, large pieces from the tensors' own memory)
    are the sha256 and size of the files on disk, for small, large, strided and integer tensors."""
    import torch

    from ballast.training.checkpoint import dcp
    from ballast.training.checkpoint.commit import DCP_METADATA, sha256_file

    gen = torch.Generator().manual_seed(0)
    big = torch.randn(700, 1500, generator=gen)  # ~4 MB: written from its own memory
    state = {"model": {"scalar": torch.tensor(3.0), "small": torch.arange(10.0), "big": big,
                       "strided": big[::3, ::2], "ids": torch.randint(0, 1 << 40, (300_000,), generator=gen)},
             "optim": {"step": torch.tensor(7), "m": torch.randn(257, 1031, generator=gen)}}
    written = dcp.write(state, tmp_path, rank=0, group=None)
    shards = [n for n in written if n != DCP_METADATA]
    assert shards and written[DCP_METADATA] is None
    for name in shards:
        f = tmp_path / name
        assert written[name] == (sha256_file(f), f.stat().st_size), name
