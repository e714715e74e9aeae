"""The failure contract: every injected fault ends with its class's exit code and failure record, and
the recovery paths (skip a poisoned batch, preemption checkpoint, rendezvous restarts) hold."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from ballast.spec import parse_spec
from helpers import config, example_data, free_port, metric_value, record, run_single, torchrun
from ballast.training import checkpoint as ckpt
from ballast.training.checkpoint import gate
from ballast.training.failure import EXIT_CODES, host_name
from ballast.training.monitor import SpikeDetector, grad_stats


@pytest.mark.integration
@pytest.mark.parametrize("kind,cls", [("oom", "oom"), ("error", "user_code"), ("comm", "communication")])
def test_injected_fault_gives_class_exit_code_and_record(tmp_path, digits_cache, kind, cls):
    proc = run_single(config(tmp_path, digits_cache, changes={"rehearsal.faults": [{"kind": kind, "step": 7}]}))
    assert proc.returncode == EXIT_CODES[cls], proc.stderr[-2000:]
    rec = record(tmp_path)
    assert rec["class"] == cls and rec["step"] == 6 and rec["rank"] == 0 and rec["exit_code"] == EXIT_CODES[cls]
    assert "retryable" not in rec  # whether to retry is the retry policy's, by this class


@pytest.mark.integration
def test_nan_checkpoints_last_good_state_and_next_try_skips_the_batch(tmp_path, digits_cache):
    cfg = config(tmp_path, digits_cache, changes={"rehearsal.faults": [{"kind": "nan", "step": 9}]})
    first = run_single(cfg)
    assert first.returncode == EXIT_CODES["divergence"], first.stderr[-2000:]
    assert record(tmp_path)["class"] == "divergence"
    latest = gate.latest_passing(tmp_path / "ckpt", quarantine_failures=False)
    state = ckpt.read_trainer_state(latest)
    assert state["reason"] == "anomaly" and state["step"] == 8 and state["skip"] == [[0, 8]]
    second = run_single(cfg)  # the retry: resumes and steps over the poisoned batch
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["skipped_batches"] == [[0, 8]]
    events = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any(e["event"] == "anomaly" and e["kind"] == "nonfinite" for e in events)


@pytest.mark.integration
def test_hang_is_ended_by_the_watchdog_with_stacks(tmp_path, digits_cache):
    proc = run_single(config(tmp_path, digits_cache, changes={"rehearsal.faults": [{"kind": "hang", "step": 5}],
                                                               "execution.hang_timeout_seconds": 6}))
    assert proc.returncode == EXIT_CODES["hang"], proc.stderr[-2000:]
    assert record(tmp_path)["class"] == "hang"
    stacks = (tmp_path / "out" / "stacks-rank0.txt").read_text()
    assert "no progress" in stacks and "faults.py" in stacks  # the stack shows where it hung


@pytest.mark.integration
def test_sigterm_commits_a_checkpoint_and_exits_preempted(tmp_path, digits_cache):
    cfg = config(tmp_path, digits_cache, epochs=200)
    proc = subprocess.Popen([sys.executable, "-m", "ballast.training", "--config", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    beat = tmp_path / "out" / "heartbeat"
    deadline = time.monotonic() + 60
    while not (beat.exists() and int(beat.read_text().split()[0]) >= 30):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_CODES["preempted"], err[-2000:]
    rec = record(tmp_path)
    latest = gate.latest_passing(tmp_path / "ckpt", quarantine_failures=False)
    state = ckpt.read_trainer_state(latest)
    assert rec["class"] == "preempted" and state["reason"] == "preempted" and state["step"] >= 30


@pytest.mark.integration
def test_kill_during_save_leaves_previous_checkpoint_as_latest(tmp_path):
    script = f"""
import os, signal, torch
from ballast.training import checkpoint as ckpt
root = {str(tmp_path)!r}
for step in (10, 20):
    w = ckpt.Writer(root, step, rank=0, barrier=lambda: None)
    w.begin()
    w.write_tensors("model.pt", {{"w": torch.full((1000,), float(step))}})
    if step == 20:
        os.kill(os.getpid(), signal.SIGKILL)  # dies with the save half written
    w.write_json("trainer.json", {{"step": step}})
    w.commit()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / ".step-00000020.tmp" / "model.pt").exists()
    assert gate.latest_passing(tmp_path, quarantine_failures=False).name == "step-00000010"


@pytest.mark.integration
def test_killed_rank_restarts_and_resumes_to_identical_weights(tmp_path, digits_cache):
    import torch

    def two_proc(d):
        d["training"].update(processes_per_node=2, global_batch_size=64, checkpoint={"every_steps": 5})

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = subprocess.run(torchrun(config(ref_dir, digits_cache, epochs=3, edit=two_proc), "--standalone",
                                  "--nproc-per-node=2"), capture_output=True, text=True, timeout=240)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # From step 12: the step-5 checkpoint is committed by then (the save at step 10 waits for its
    # write, which runs at idle priority and, on two busy cores, may not have had a core before).
    step = random.Random(os.getpid()).randint(12, 55)
    cfg = config(run_dir, digits_cache, epochs=3, edit=two_proc,
                 changes={"rehearsal.faults": [{"kind": "crash", "step": step, "rank": 1}]})
    run = subprocess.run(torchrun(cfg, "--standalone", "--nproc-per-node=2", "--max-restarts=3"),
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, f"killed at step {step}\n" + run.stderr[-3000:]
    assert "resumed from" in run.stdout, f"killed at step {step}\n" + run.stdout[-3000:]
    wa = ckpt.load_tensors(ckpt.committed(ref_dir / "ckpt")[-1] / "model.pt")
    wb = ckpt.load_tensors(ckpt.committed(run_dir / "ckpt")[-1] / "model.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), f"weights differ after a kill at step {step}"


@pytest.mark.integration
def test_a_group_that_cannot_read_its_config_is_not_restarted(tmp_path, digits_cache):
    """No failure record (the ranks never learned where to write it) is not a rank killed outright when
    the exit code names a class: torchrun's restarts would only fail the same way."""
    def two_proc(d):
        d["training"].update(processes_per_node=2, global_batch_size=64)

    cfg = config(tmp_path, digits_cache, edit=two_proc)
    data = json.loads(cfg.read_text())
    data["checkpoint"]["dir"] = "x"  # an unknown key: the trainer refuses the whole config
    cfg.write_text(json.dumps(data))
    launch = [sys.executable, "-m", "ballast.training.torchrun", "--standalone", "--nproc-per-node=2", "--max-restarts=3",
              "--module", "ballast.training", "--config", str(cfg)]
    run = subprocess.run(launch, capture_output=True, text=True, timeout=240)
    assert run.returncode == 64, run.stderr[-3000:]  # the class's code: a Job's pod failure policy reads it
    assert re.search(r"rank \d exited 64 \(class config\) without a failure record; not restarting the group", run.stderr)
    assert run.stderr.count("failed (config, exit 64)") == 2, run.stderr[-3000:]  # one group: no restart
    assert not (tmp_path / "out" / "failure.json").exists()


@pytest.mark.integration
def test_resume_from_an_anomaly_checkpoint_replays_the_step_exactly(tmp_path, digits_cache):
    """A loss spike (under alert) checkpoints the state before its step applies, after that step's
    forward pass has drawn its dropout masks: resumed from it, a run must draw the same masks again."""
    import shutil

    import torch

    changes = {"rehearsal.faults": [{"kind": "spike", "step": 20}], "checkpoint.keep_last": 100,
               "monitors.anomaly_checkpoint_min_steps": 0}
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "resumed"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_single(config(ref_dir, digits_cache, epochs=2, changes=changes))
    assert ref.returncode == 0, ref.stderr[-3000:]
    anomaly = [p for p in ckpt.committed(ref_dir / "ckpt") if ckpt.read_trainer_state(p)["reason"] == "anomaly"]
    assert [ckpt.read_trainer_state(p)["step"] for p in anomaly] == [19]
    shutil.copytree(anomaly[0], run_dir / "ckpt" / anomaly[0].name)  # the spike fires again: no marker here
    run = run_single(config(run_dir, digits_cache, epochs=2, changes=changes))
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"resumed from {run_dir / 'ckpt' / anomaly[0].name}" in run.stdout + run.stderr
    wa = ckpt.load_tensors(ckpt.committed(ref_dir / "ckpt")[-1] / "model.pt")
    wb = ckpt.load_tensors(ckpt.committed(run_dir / "ckpt")[-1] / "model.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ after resuming from the anomaly checkpoint"


@pytest.mark.integration
def test_a_group_restart_is_only_for_a_rank_killed_outright_not_for_an_oom(tmp_path, digits_cache):
    def two_proc(d):
        d["training"].update(processes_per_node=2, global_batch_size=64, checkpoint={"every_steps": 5})

    cfg = config(tmp_path, digits_cache, epochs=2, edit=two_proc,
                 changes={"rehearsal.faults": [{"kind": "oom", "step": 9, "rank": 1}]})
    launch = [sys.executable, "-m", "ballast.training.torchrun", "--standalone", "--nproc-per-node=2", "--max-restarts=3",
              "--module", "ballast.training", "--config", str(cfg)]  # what the train stage runs
    run = subprocess.run(launch, capture_output=True, text=True, timeout=240)
    assert run.returncode == 73, run.stderr[-3000:]
    assert "failed with class oom; not restarting the group" in run.stderr
    assert record(tmp_path)["class"] == "oom" and record(tmp_path)["rank"] == 1  # left for the next try
    events = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "first_step" for e in events) == 1  # one group: no restart


@pytest.mark.integration
def test_two_agents_rendezvous_on_loopback_train_and_resume(tmp_path, digits_cache):
    def two_nodes(d):
        d["training"].update(nodes=2, processes_per_node=1, global_batch_size=64)
        d["execution"] = {"backend": "slurm", "slurm": {"partition": "debug"}}  # what a 2-node run would use

    port = free_port()

    def launch(epochs: int) -> list[subprocess.CompletedProcess]:
        cfg = config(tmp_path, digits_cache, epochs=epochs, edit=two_nodes)
        args = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=two-agents-{epochs}"]
        agents = [subprocess.Popen(torchrun(cfg, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for _ in range(2)]
        out = []
        for a in agents:
            so, se = a.communicate(timeout=240)
            out.append(subprocess.CompletedProcess(a.args, a.returncode, so, se))
        return out

    first = launch(1)
    assert all(p.returncode == 0 for p in first), [p.stderr[-2000:] for p in first]
    assert "world 2 (gloo" in "".join(p.stdout for p in first)
    second = launch(2)
    assert all(p.returncode == 0 for p in second), [p.stderr[-2000:] for p in second]
    assert "resumed from" in "".join(p.stdout for p in second)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["epochs"] == 2


@pytest.mark.integration
@pytest.mark.parametrize("edit", [
    lambda d: d["training"].update(parallelism="fsdp"),
    lambda d: d["training"].update(gradient_compression="fp16"),
    lambda d: d["training"].update(precision="bf16"),
    lambda d: d["training"].update(precision="fp16"),  # no fp16 autocast on CPU: fp32, loss scaler off
], ids=["fsdp", "fp16-compression", "bf16", "fp16-on-cpu"])
def test_parallelism_and_precision_options_train_and_resume(tmp_path, digits_cache, edit):
    def opts(d):
        d["training"].update(processes_per_node=2, global_batch_size=64)
        edit(d)

    first = subprocess.run(torchrun(config(tmp_path, digits_cache, epochs=1, edit=opts), "--standalone",
                                    "--nproc-per-node=2"), capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    second = subprocess.run(torchrun(config(tmp_path, digits_cache, epochs=3, edit=opts), "--standalone",
                                     "--nproc-per-node=2"), capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["best"]["value"] > 0.8


@pytest.mark.unit
def test_checkpoint_averaging(tmp_path):
    import torch

    for step, value in ((10, 1.0), (20, 2.0), (30, 6.0)):
        w = ckpt.Writer(tmp_path, step, rank=0, barrier=lambda: None)
        w.begin()
        w.write_tensors("model.pt", {"w": torch.full((3,), value), "n": torch.tensor(step)})
        w.commit()
    avg = ckpt.average(ckpt.committed(tmp_path))
    assert torch.equal(avg["w"], torch.full((3,), 3.0)) and int(avg["n"]) == 10


@pytest.mark.unit
def test_learning_rate_scales_linearly_with_global_batch():
    d = example_data()
    d["training"].update(learning_rate=0.001, lr_reference_batch_size=32, global_batch_size=256,
                         micro_batch_size=32, processes_per_node=8)
    assert parse_spec(d).training.effective_learning_rate == pytest.approx(0.008)


@pytest.mark.integration
@pytest.mark.parametrize("action", ["alert", "rollback"])
def test_loss_spike_alerts_and_rolls_back(tmp_path, digits_cache, action):
    cfg = config(tmp_path, digits_cache, epochs=2, changes={
        "rehearsal.faults": [{"kind": "spike", "step": 35}], "monitors.spike_action": action,
        "monitors.spike_window": 20, "checkpoint.every_steps": 10, "monitors.anomaly_checkpoint_min_steps": 0})
    proc = run_single(cfg)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    spikes = [e for e in events if e["event"] == "anomaly" and e["kind"] == "loss_spike"]
    # The injected spike (loss x1000) is unmistakable; a noisy small-batch loss may add milder ones.
    injected = [e for e in spikes if e["step"] == 34]
    assert len(injected) == 1 and injected[0]["zscore"] > 50
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    if action == "rollback":
        assert "rolled back to step-00000030" in proc.stdout
        assert [0, 34] in summary["skipped_batches"]  # 42 steps per epoch here: global step 35 = epoch 0, batch 34
    else:
        assert any(e["event"] == "checkpoint" and e["reason"] == "anomaly" and e["step"] == 34 for e in events)
        assert summary["skipped_batches"] == []


@pytest.mark.integration
def test_alert_storm_checkpoints_the_last_good_state_once(tmp_path, digits_cache):
    # Two unmistakable spikes 25 steps apart under alert (the first has left the 20-step window by the
    # second): both raise an alert, only the first one saves.
    cfg = config(tmp_path, digits_cache, epochs=2, changes={
        "rehearsal.faults": [{"kind": "spike", "step": 35}, {"kind": "spike", "step": 60}],
        "monitors.spike_window": 20, "monitors.anomaly_checkpoint_min_steps": 100})
    proc = run_single(cfg)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    alerted = {e["step"] for e in events if e["event"] == "anomaly" and e["kind"] == "loss_spike"}
    assert {34, 59} <= alerted
    saved = [e["step"] for e in events if e["event"] == "checkpoint" and e["reason"] == "anomaly"]
    assert saved == [34]


@pytest.mark.unit
def test_spike_detector_only_looks_and_a_kept_level_stops_alerting():
    det = SpikeDetector(window=20, zscore=3.0)
    for i in range(20):
        det.add(1.0 + 0.01 * (i % 3))
    assert det.check(5.0) > 3.0 and det.check(5.0) > 3.0  # check does not move the window
    alerts = 0
    for _ in range(40):  # the loss settles at a new level that training keeps: alerts stop
        if det.check(5.0) is not None:
            alerts += 1
        det.add(5.0)
    assert 0 < alerts < 20 and det.check(5.0) is None


@pytest.mark.unit
def test_gradient_statistics_count_every_entry_by_power_of_two():
    import math

    import torch

    gen = torch.Generator().manual_seed(3)
    specials = torch.tensor([0.0, -0.0, 1e-40, -3e-42, float("nan"), float("inf"), -float("inf"), 1e30, 2.0 ** -40,
                             2.0 ** 7, 0.75, -1.0])
    grads = [torch.cat([torch.randn(5000, generator=gen) * 10.0 ** float(k), specials]) for k in range(-8, 3)]
    grads.append(torch.randn(300, generator=gen).to(torch.bfloat16))  # converted to float32 for the bins
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: skipped
    stats = grad_stats(params, lo=-40, hi=8, chunk=777)  # chunks that do not divide the tensors

    every = torch.cat([g.float() for g in grads])
    finite = every[torch.isfinite(every)]
    nonzero = finite[finite != 0]
    expected = [0] * 48
    for v in nonzero.abs().tolist():
        expected[min(max(math.floor(math.log2(v)), -40), 7) + 40] += 1
    assert stats["histogram_log2_abs"] == expected and stats["range_log2"] == [-40, 8]
    assert sum(expected) + stats["nonfinite"] + stats["zero_fraction"] * every.numel() == pytest.approx(every.numel())
    assert stats["nonfinite"] == 3 * 11
    assert stats["zero_fraction"] == pytest.approx(2 * 11 / every.numel())
    assert stats["denormal_fraction"] == pytest.approx(2 * 11 / every.numel())
    assert stats["max_abs"] == pytest.approx(1e30)
    json.dumps(stats, allow_nan=False)  # finite JSON even with NaN/Inf gradients
    assert grad_stats([torch.nn.Parameter(torch.zeros(2))]) == {}


@pytest.mark.integration
def test_prometheus_endpoint_serves_training_metrics(tmp_path, digits_cache):
    import urllib.request

    port = free_port()
    cfg = config(tmp_path, digits_cache, changes={"rehearsal.faults": [{"kind": "hang", "step": 20}],
                                                  "execution.hang_timeout_seconds": 10,
                                                  "execution.metrics_port": port})
    proc = subprocess.Popen([sys.executable, "-m", "ballast.training", "--config", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        text = ""
        while metric_value(text, "ballast_train_step", rank="0") != 19.0:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.2)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                continue
        for metric, extra in (("loss", {}), ("step_seconds", {"phase": "compute"}), ("samples_per_second", {}),
                              ("memory_bytes", {}), ("loss_scale", {}), ("last_step_timestamp_seconds", {})):
            assert metric_value(text, f"ballast_train_{metric}", rank="0", **{"try": "1"}, **extra) is not None, metric
        assert metric_value(text, "ballast_train_step", rank="0", pipeline="digits", node=host_name()) == 19.0
        assert 'ballast_train_gpu_utilization_percent{' not in text  # no NVML on CPU: declared, never sampled
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == EXIT_CODES["hang"]


@pytest.mark.integration
def test_a_taken_metrics_port_does_not_end_training(tmp_path, digits_cache):
    import socket

    with socket.socket() as taken:  # another pipeline's rank on this worker
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_single(config(tmp_path, digits_cache, epochs=1, changes={"execution.metrics_port": port}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"metrics port {port} is in use" in proc.stderr
    served = int((tmp_path / "out" / "metrics-port-rank0").read_text())
    assert served != port


@pytest.mark.integration
def test_average_export_cli(tmp_path):
    import torch

    for step, value in ((10, 2.0), (20, 4.0)):
        w = ckpt.Writer(tmp_path / "ckpt", step, rank=0, barrier=lambda: None)
        w.begin()
        w.write_tensors("model.pt", {"w": torch.full((2,), value), "v": torch.full((4,), value)})
        w.commit()
    out = tmp_path / "avg.pt"
    proc = subprocess.run([sys.executable, "-m", "ballast.training.average", str(tmp_path / "ckpt"), "--last", "2",
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(ckpt.load_tensors(out)["w"], torch.full((2,), 3.0))
    # Into a directory: safetensors shards and their index, written a shard at a time.
    proc = subprocess.run([sys.executable, "-m", "ballast.training.average", str(tmp_path / "ckpt"), "--last", "2",
                           "--out", str(tmp_path / "avg"), "--shard-bytes", "8"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "avg").iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    loaded = ckpt.load_tensors(tmp_path / "avg" / "model.safetensors.index.json")
    assert torch.equal(loaded["w"], torch.full((2,), 3.0)) and torch.equal(loaded["v"], torch.full((4,), 3.0))
    (tmp_path / "ckpt" / "step-00000020" / "model.pt").write_bytes(b"tampered")
    bad = subprocess.run([sys.executable, "-m", "ballast.training.average", str(tmp_path / "ckpt"), "--out", str(out)],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "size 8 does not match the manifest" in bad.stderr


@pytest.mark.integration
def test_checkpoint_from_another_model_shape_is_refused(tmp_path, digits_cache):
    assert run_single(config(tmp_path, digits_cache, epochs=1)).returncode == 0
    proc = run_single(config(tmp_path, digits_cache, epochs=2,
                             changes={"model.options": {"hidden_size": 64, "dropout": 0.1}}))
    assert proc.returncode == EXIT_CODES["data"]
    assert "refusing to resume" in record(tmp_path)["exception"]
    assert ("checkpoint is for model mlp(dropout=0.1, hidden_size=128) for classification [8, 8], not this run's"
            " mlp(dropout=0.1, hidden_size=64) for classification [8, 8]") in record(tmp_path)["exception"]


@pytest.mark.integration
def test_unknown_optimizer_is_a_config_error(tmp_path, digits_cache):
    proc = run_single(config(tmp_path, digits_cache, changes={"optim.optimizer": "lamb"}))
    assert proc.returncode == EXIT_CODES["config"]
    assert "optimizer: unknown optimizer 'lamb'; known: adamw, sgd" in proc.stderr


@pytest.mark.integration
def test_resume_from_the_average_of_the_last_checkpoints(tmp_path, digits_cache):
    every = {"checkpoint.every_steps": 20}
    assert run_single(config(tmp_path, digits_cache, epochs=2, changes=every)).returncode == 0
    proc = run_single(config(tmp_path, digits_cache, epochs=3, changes={**every,
                                                                        "checkpoint.resume_average_last": 3}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming from the average of 3 checkpoints" in proc.stdout


@pytest.mark.unit
def test_a_monitor_setting_reaches_the_anomaly_policy_from_the_spec():
    # One definition (training.config.sections.MonitorSettings.max_rollbacks): the spec field, its
    # bounds, the run config and the policy that uses it.
    from ballast.errors import SpecError
    from ballast.launch.config import run_config
    from ballast.training.anomaly import AnomalyPolicy

    d = example_data()
    d["training"]["monitors"] = {"spike_action": "rollback", "max_rollbacks": 1}
    cfg = run_config(parse_spec(d), data_dir="d", data_format="petastorm", checkpoint_dir="c", output_dir="o")
    assert cfg.monitors.max_rollbacks == 1
    policy = AnomalyPolicy(cfg.monitors)
    assert policy.may_roll_back_to("step-00000010") and not policy.may_roll_back_to("step-00000010")
    assert policy.may_roll_back_to("step-00000020")  # counted per checkpoint
    d["training"]["monitors"]["max_rollbacks"] = -1
    with pytest.raises(SpecError, match=r"training\.monitors\.max_rollbacks: must be >= 0 \(got -1\)"):
        parse_spec(d)


@pytest.mark.unit
def test_fp16_loss_scaling_skips_non_finite_steps_down_to_its_minimum_scale_then_the_run_diverges():
    # A real GradScaler (on CPU) and the policy as the trainer drives them: gradients that stay NaN are
    # skipped while the scale halves, and the step at training.loss_scale.minimum ends the run instead
    # of skipping every step for ever.
    import math

    import torch
    from ballast.launch.config import run_config
    from ballast.training.anomaly import AnomalyPolicy

    d = example_data()
    d["training"]["loss_scale"] = {"initial": 1024, "minimum": 4}
    cfg = run_config(parse_spec(d), data_dir="d", data_format="petastorm", checkpoint_dir="c", output_dir="o")
    ls = cfg.numerics.loss_scale
    assert (ls.initial, ls.minimum) == (1024, 4)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=ls.initial, growth_interval=ls.growth_interval)
    policy = AnomalyPolicy(cfg.monitors, scaler=scaler, min_loss_scale=ls.minimum)
    actions = []
    for step in range(20):
        loss = (w * torch.tensor([1.0, float("nan"), 1.0])).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gnorm = float(torch.nn.utils.clip_grad_norm_([w], 1.0))
        verdict = policy.judge(float(loss.detach()), gnorm, step=step)
        actions.append(verdict.action)
        if verdict.action == "diverged":
            break
        assert verdict.nonfinite
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    # 1024, 512, ..., 8 skipped (8 steps), the step at 4 diverges: log2(initial / minimum) + 1 steps.
    assert actions == ["train"] * 8 + ["diverged"]
    assert len(actions) == int(math.log2(ls.initial / ls.minimum)) + 1
    assert torch.equal(w.detach(), torch.ones(3))  # every skipped step left the weights alone
    assert verdict.detail == " at loss scale 4 (training.loss_scale.minimum: 4)"
    # A finite step at the minimum trains; without a scaler (or with a disabled one) a non-finite step diverges.
    assert policy.judge(1.0, 1.0, step=0).action == "train"
    for off in (None, torch.amp.GradScaler("cpu", enabled=False)):
        assert AnomalyPolicy(cfg.monitors, scaler=off).judge(math.nan, 1.0, step=0).action == "diverged"
    # A spec from before the minimum existed, with an initial scale under 1, still parses: it starts there.
    d["training"]["loss_scale"] = {"initial": 0.5}
    assert parse_spec(d).training.loss_scale.minimum == 0.5


@pytest.mark.unit
def test_faults_from_the_environment_fire_only_where_the_run_config_allows_a_rehearsal(monkeypatch, capsys):
    from ballast.training.config.run import RehearsalConfig
    from ballast.training.faults import load_faults

    monkeypatch.setenv("BALLAST_FAULTS", '[{"kind": "crash", "step": 3}]')
    assert load_faults(RehearsalConfig()) == []  # a node's environment alone starts no fault
    assert "BALLAST_FAULTS ignored" in capsys.readouterr().err
    assert [(f.kind, f.step) for f in load_faults(RehearsalConfig(env_faults=True))] == [("crash", 3)]


@pytest.mark.unit
def test_the_orchestrator_allows_environment_faults_only_in_a_rehearsal_try():
    from ballast.launch.config import run_config
    from ballast.spec import load_spec
    from helpers import EXAMPLE_SPEC
    from ballast.training.config.rehearsal import FaultSettings

    spec = load_spec(EXAMPLE_SPEC)
    paths = dict(data_dir=".", data_format="petastorm", checkpoint_dir=".", output_dir=".")
    assert run_config(spec, **paths).rehearsal.env_faults is False
    assert run_config(spec, faults=(), **paths).rehearsal.env_faults is False  # rehearsal off, or a scheduled run
    rehearsal = run_config(spec, faults=(FaultSettings(kind="oom", step=2),), **paths).rehearsal
    assert rehearsal.env_faults is True


@pytest.mark.unit
def test_a_rollback_closes_the_loss_scalers_step_so_the_next_step_can_unscale(tmp_path):
    """fp16 on a GPU: the step a spike abandons has unscaled its gradients; without closing that step the
    next one's unscale_ raised "unscale_() has already been called" (a CPU GradScaler, enabled, the same code)."""
    from types import SimpleNamespace

    import torch
    from ballast.training.state import TrainState
    from ballast.training.trainer import Trainer

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)

    def step():
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        scaler.unscale_(opt)  # as Trainer._step does before clipping and judging the step

    step()
    loaded = []
    me = SimpleNamespace(checkpoints=SimpleNamespace(wait=lambda: None, latest=lambda: tmp_path / "step-00000001"),
                         anomalies=SimpleNamespace(may_roll_back_to=lambda name: True), opt=opt, scaler=scaler,
                         state=TrainState(), log=lambda m: None, resume=loaded.append)
    assert Trainer._rollback(me) is True and loaded == [tmp_path / "step-00000001"]
    step()  # the next step after the rollback unscales again
    scaler.step(opt)
    scaler.update()
