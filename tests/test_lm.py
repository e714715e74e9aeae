"""The language-model workload: raw text from the Python standard library, tokenized by the pipeline
(the built-in byte vocabulary), the built-in `gpt`, end to end through Airflow; a killed rank resumes
to identical weights; an out-of-memory try halves the micro-batch and keeps the global batch in tokens."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest
from ballast.training import checkpoint as ckpt
from helpers import run_spec_dag, torchrun
from workload_data import lm_config, lm_spec, write_corpus

@pytest.mark.integration
def test_a_killed_rank_resumes_the_language_model_to_identical_weights(tmp_path, lm_cache):
    import torch

    ctx, cache = lm_cache
    ref = subprocess.run(torchrun(lm_config(tmp_path / "ref", ctx, cache), "--standalone", "--nproc-per-node=2"),
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    steps = json.loads((tmp_path / "ref" / "out" / "summary.json").read_text())["steps"]
    # Past the second save (steps 10, 20): the first is committed by then even on two busy cores, where the
    # background write of the newest may still be running when the rank dies.
    step = random.Random(os.getpid()).randint(25, max(26, steps - 3))
    cfg = lm_config(tmp_path / "killed", ctx, cache, changes={"rehearsal.faults": [{"kind": "crash", "step": step,
                                                                                    "rank": 1}]})
    run = subprocess.run(torchrun(cfg, "--standalone", "--nproc-per-node=2", "--max-restarts=3"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"killed at step {step}\n" + run.stderr[-3000:]
    assert "resumed from" in run.stdout, f"killed at step {step}\n" + run.stdout[-3000:]
    wa = ckpt.load_tensors(ckpt.committed(tmp_path / "ref" / "ckpt")[-1] / "model.pt")
    wb = ckpt.load_tensors(ckpt.committed(tmp_path / "killed" / "ckpt")[-1] / "model.pt")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f"weights differ (kill at {step})"


def untrained_perplexity(card: dict, cache_dir: str, fmt: str) -> float:
    """The test split's perplexity under the published model's architecture, freshly initialised."""
    import torch
    import torch.nn.functional as F

    from ballast.training.dataset.reader import load_split
    from ballast.training.config.run import ModelConfig
    from ballast.training.models import build_configured_model

    torch.manual_seed(0)
    model = build_configured_model(ModelConfig.model_validate(card["model"])).eval()
    tokens = torch.from_numpy(load_split(Path(cache_dir), "test", fmt=fmt).features)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    return math.exp(float(loss))


@pytest.mark.e2e
def test_the_language_model_pipeline_from_raw_text_to_a_published_model(airflow_db, tmp_path):
    """Tokenize, convert, warm, train (an out-of-memory try on the way), verify, evaluate, publish."""
    raw = write_corpus(tmp_path / "raw")

    def edit(d):
        lm_spec(d, raw, epochs=2)
        d["storage"]["uri"] = str(tmp_path / "storage")
        d["cache"]["directory"] = str(tmp_path / "cache")
        d["training"]["rehearsal"] = {"enabled": True, "faults": [{"kind": "oom", "step": 6}]}

    dr, ctx = run_spec_dag(tmp_path, edit, name="lm")
    assert str(dr.state) == "success", dr.state
    report = json.loads(ctx.storage.read_bytes(ctx.report_key))
    tries = [a for task in report["attempts"] for a in task["attempts"]]  # every task's tries
    failed = [a for a in tries if a["outcome"] == "failed"]
    assert failed and failed[0]["failure_class"] == "oom", tries
    train = report["stages"]["train"]
    assert train["micro_batch_size"] == 8  # halved from 16; the global batch (32 sequences of 32 tokens) kept
    test = report["test"]
    assert test["metric"] == "loss" and math.isfinite(test["bits_per_byte"])
    assert test["perplexity"] == pytest.approx(math.exp(test["loss"]), rel=1e-6)
    warm = ctx.result("warm_cache")
    card_key = report["model_card"].split(str(ctx.storage.uri).rstrip("/") + "/")[-1]
    card = json.loads(ctx.storage.read_bytes(card_key))
    assert card["task"] == "causal_lm" and card["tokenizer"]["kind"] == "bytes"
    assert card["model"]["data"]["vocab_size"] == 257
    untrained = untrained_perplexity(card, warm.cache_dir, warm.format)
    assert test["perplexity"] < 0.5 * untrained, (test["perplexity"], untrained)
