"""Building a model under FSDP (ballast.training.fsdp.build_sharded) with real torchrun processes on gloo:
built on the meta device and sharded there, each rank allocates and initializes only its own shards, so
the memory a rank adds while the model is built is its shard, not the whole model (the whole build, what
a model without `ballast_init_weights()` still gets, adds the whole model and more: the control). The
sharded weights are independent draws from the model's own initialization, and the model trains."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

WORKER = textwrap.dedent('''
    import gc, json, sys
    import torch
    import torch.distributed as dist
    from ballast.training import fsdp, hostmem
    from ballast.training.config.run import ModelConfig
    from ballast.training.models import build_configured_model

    def section(vocab, width, layers):
        data = {"task": "causal_lm", "input_shape": [16], "input_dtype": "int64", "seq_len": 16, "vocab_size": vocab,
                "inputs": {"tokens": {"shape": [16], "dtype": "int64"}}}
        return ModelConfig(name="gpt", options={"layers": layers, "width": width, "heads": 4}, data=data)

    def build(sec, how):
        if how == "meta":
            return fsdp.build_sharded(sec, device=torch.device("cpu"), seed=7, rank=dist.get_rank(), precision="fp32",
                                      activation_checkpointing=False, log=print)
        return fsdp.shard(build_configured_model(sec), precision="fp32", activation_checkpointing=False, log=print)

    def status(key):  # bytes, from /proc/self/status
        line = next(ln for ln in open("/proc/self/status") if ln.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    def measure(how, steps):
        gc.collect()
        open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from the current RSS
        before = status("VmRSS")
        model = build(section(150_000, 256, 2), how)  # ~160 MB of fp32 parameters
        got = {"added": status("VmHWM") - before,
               "whole": sum(p.numel() * p.element_size() for p in model.parameters()),
               "local": sum(p.to_local().numel() * p.element_size() for p in model.parameters())}
        embed = model.embed.weight.full_tensor()
        proj = model.blocks[0].attn.proj.weight.full_tensor()
        norm = model.norm.weight.full_tensor()
        half = embed.shape[0] // 2
        got.update(embed_std=embed.std().item(), halves_differ=not torch.equal(embed[:half], embed[half:2 * half]),
                   proj_std=proj.std().item(), norm_ones=bool((norm == 1).all()))
        tokens = torch.randint(0, 150_000, (2, 16), generator=torch.Generator().manual_seed(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        got["losses"] = []
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            got["losses"].append(loss.item())
        return got

    hostmem.return_freed_memory()  # large blocks mapped and unmapped: the first build's memory is not reused
    dist.init_process_group("gloo")
    out = sys.argv[1]
    build(section(64, 16, 1), "meta")  # the first build's imports and allocator arenas, before measuring
    build(section(64, 16, 1), "whole")
    got = {"meta": measure("meta", steps=3), "whole": measure("whole", steps=1)}
    if dist.get_rank() == 0:
        json.dump(got, open(out, "w"))
    dist.destroy_process_group()
''')


def _build(tmp: Path) -> dict:
    script = tmp / "build_worker.py"
    script.write_text(WORKER)
    out = tmp / "builds.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(script), str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "DTensor random operators" not in run.stderr  # the per-rank seeding is deliberate: no warning
    return json.loads(out.read_text())


def test_each_rank_adds_only_its_own_shards_while_the_model_is_built_and_the_model_trains(tmp_path):
    got = _build(tmp_path)
    meta, whole = got["meta"], got["whole"]
    for r in (meta, whole):
        assert r["local"] == r["whole"] // 2  # two ranks, each holding half of every parameter
    # The meta-device build: what the rank keeps (its half) plus little. The whole build, for contrast:
    # the whole model, then the shards copied out of it.
    assert meta["added"] < 0.7 * meta["whole"], meta
    assert whole["added"] > 1.0 * whole["whole"], whole
    # The model's own initialization, drawn independently for each rank's rows of the embedding.
    assert meta["halves_differ"] and abs(meta["embed_std"] - 0.02) < 0.001
    assert abs(meta["proj_std"] - 0.02 / 4 ** 0.5) < 0.001 and meta["norm_ones"]
    # It trains: the loss starts near ln(vocab) = 11.9 and falls on the batch it sees, as the whole build's does.
    assert 9 < meta["losses"][0] < 12.5 and meta["losses"][-1] < meta["losses"][0] - 1
    assert abs(meta["losses"][0] - whole["losses"][0]) < 0.5
