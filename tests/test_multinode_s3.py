"""Multi-node training on S3 storage: each node's checkpoint directory holds its own ranks' shards and
the whole manifest (training.checkpoint.commit, node-local), each node pushes its own share and node 0
writes the manifest and COMMITTED in storage only once every share is there (ballast.storage.checkpoints);
a node resuming pulls the checkpoint but its shard files, and its ranks fetch the shard files their loads
read (DCP's load plan), each checked against the manifest's size and sha256.

The integration tests run the commit protocol's ranks as threads (two nodes of two ranks each, the
gather over a barrier) against a real S3 server on loopback (moto); the end-to-end test trains under
FSDP on the real Slurm cluster (tests/slurm_cluster.py): 2 nodes x 1 CPU rank, S3 on loopback."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

import pytest
from ballast.training import checkpoint as ckpt

RANKS_PER_NODE, NODES = 2, 2


@pytest.fixture(scope="module")
def s3_endpoint():
    from helpers import free_port
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def ctx(s3_endpoint, monkeypatch, tmp_path):
    import boto3

    from ballast.pipeline.context import RunContext
    from ballast.spec import parse_spec
    from helpers import example_data

    for key, value in {"AWS_ENDPOINT_URL_S3": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    bucket = f"multinode-{tmp_path.name.lower().replace('_', '-')}"[:60]
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    d = example_data()
    d["storage"]["uri"] = f"s3://{bucket}/store"
    d["training"]["checkpoint"] = {"every_steps": 10, "keep_last": 5}
    c = RunContext(spec=parse_spec(d), dag_id="ballast_digits", run_id="r1")
    c.log = logging.getLogger("test_multinode_s3")
    return c


def _shard(step: int, rank: int, version: int = 0) -> bytes:
    return hashlib.sha256(f"{step}/{rank}/{version}".encode()).digest() * (64 + rank)


def save_on_nodes(roots: list[Path], step: int, version: int = 0) -> None:
    """One sharded checkpoint saved by NODES x RANKS_PER_NODE ranks (threads), each node committing into
    its own directory `roots[node]`: every rank its shard, rank 0 also DCP's .metadata and trainer.json."""
    world = NODES * RANKS_PER_NODE
    barrier = threading.Barrier(world)
    shares: list = [None] * world
    errors: list[BaseException] = []

    def gather(rank: int):
        def all_gather(obj):
            shares[rank] = obj
            barrier.wait()
            out = list(shares)
            barrier.wait()
            return out
        return all_gather

    def rank_main(rank: int) -> None:
        try:
            w = ckpt.Writer(roots[rank // RANKS_PER_NODE], step, rank=rank, barrier=barrier.wait,
                            local_rank=rank % RANKS_PER_NODE, node_local=True, gather=gather(rank))
            w.begin()
            (w.tmp / f"__{rank}_0.distcp").write_bytes(_shard(step, rank, version))
            w.adopt(f"__{rank}_0.distcp")
            if rank == 0:
                (w.tmp / ".metadata").write_bytes(_shard(step, -1, version))
                w.adopt(".metadata")
                w.write_json("trainer.json", {"step": step})
            w.write_json(f"rng-rank{rank}.json", {"rank": rank})
            w.commit()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the test's thread)
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def node_files(node: int) -> set[str]:
    ranks = range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
    own = {f"__{r}_0.distcp" for r in ranks} | {f"rng-rank{r}.json" for r in ranks}
    return own | ({".metadata", "trainer.json"} if node == 0 else set())


def _base(ctx, step: int) -> str:
    return f"{ctx.run_key}/checkpoints/{ckpt.step_dir_name(step)}/"


def _stored(ctx, base: str) -> set[str]:
    """The files under a checkpoint's prefix in storage (listings leave out DCP's .metadata: asked by key)."""
    return set(ctx.storage.list_dir(base)) | ({".metadata"} if ctx.storage.exists(base + ".metadata") else set())


@pytest.mark.integration
def test_each_node_commits_its_own_shards_under_the_whole_manifest(tmp_path):
    roots = [tmp_path / f"node{n}" for n in range(NODES)]
    save_on_nodes(roots, 10)
    every = set().union(*(node_files(n) for n in range(NODES)))
    manifests = []
    for n, root in enumerate(roots):
        path = root / "step-00000010"
        assert ckpt.is_committed(path)
        held = {p.name for p in path.iterdir()} - {ckpt.MANIFEST, ckpt.COMMIT_MARKER, ckpt.LOCAL_FILES}
        assert held == node_files(n)  # only this node's ranks' files on this node's disk
        assert ckpt.held_files(path) == node_files(n)
        manifest = ckpt.verify(path, held_only=True)
        assert set(manifest["files"]) == every  # ...under the manifest of the whole checkpoint
        manifests.append((path / ckpt.MANIFEST).read_bytes())
        with pytest.raises(ckpt.CheckpointFailure, match="holds only this node's files"):
            ckpt.verify(path)  # never resumed from, nor passed by the gate, as a whole checkpoint
    assert manifests[0] == manifests[1]  # the same bytes on every node: node 0 commits what every node pushed for
    shard = roots[1] / "step-00000010" / "__3_0.distcp"
    shard.write_bytes(b"x" * shard.stat().st_size)
    with pytest.raises(ckpt.CheckpointFailure, match=r"__3_0\.distcp: sha256 does not match"):
        ckpt.verify(shard.parent, held_only=True)
    # Pruning on each node's disk judges what that node holds.
    save_on_nodes(roots, 20)
    save_on_nodes(roots, 30)
    for root in roots:
        ckpt.prune(root, keep_last=2)
        assert [p.name for p in ckpt.committed(root)] == ["step-00000020", "step-00000030"]


@pytest.mark.integration
def test_s3_push_and_pull_of_shards_per_node_with_the_marker_after_every_shard(ctx, tmp_path):
    from ballast.storage import checkpoints as sync

    roots = [tmp_path / f"node{n}" for n in range(NODES)]
    save_on_nodes(roots, 10)
    base = _base(ctx, 10)
    # Node 0 first: its share goes up, the marker does not (node 1's shards are not there yet).
    assert sync.push(ctx, roots[0], node=0) == []
    keys = _stored(ctx, base)
    assert node_files(0) <= keys and ckpt.COMMIT_MARKER not in keys and ckpt.MANIFEST not in keys
    assert sync.push(ctx, roots[1], node=1) == []  # another node never commits
    assert ckpt.COMMIT_MARKER not in set(ctx.storage.list_dir(base))
    assert sync.push(ctx, roots[0], node=0) == [ctx.storage.describe(base.rstrip("/"))]
    files = sync.stored_files(ctx.storage, f"{ctx.run_key}/checkpoints/", "step-00000010")
    every = set().union(*(node_files(n) for n in range(NODES)))
    assert files is not None and set(files[:-2]) == every and files[-2:] == [ckpt.MANIFEST, ckpt.COMMIT_MARKER]
    records = [json.loads(ctx.storage.read_bytes(base + f"PUSHED-node{n}.json")) for n in range(NODES)]
    digest = hashlib.sha256((roots[0] / "step-00000010" / ckpt.MANIFEST).read_bytes()).hexdigest()
    assert [(r["manifest"], set(r["files"])) for r in records] == [(digest, node_files(n)) for n in range(NODES)]
    assert sync.push(ctx, roots[0], node=0) == [] and sync.push(ctx, roots[1], node=1) == []  # already there

    # Pulled for a resume: every shard of every node, each checked against the manifest, a whole checkpoint.
    fresh = tmp_path / "resume"
    assert sync.pull(ctx, fresh, newest=1) == ["step-00000010"]
    pulled = fresh / "step-00000010"
    ckpt.verify(pulled)
    assert ckpt.held_files(pulled) is None
    for n, root in enumerate(roots):
        for name in node_files(n):
            assert (pulled / name).read_bytes() == (root / "step-00000010" / name).read_bytes()


@pytest.mark.integration
def test_a_node_pulls_all_but_the_shards_and_fetches_the_ones_named_each_checked_against_the_manifest(ctx, tmp_path):
    from ballast.errors import StorageError
    from ballast.storage import checkpoints as sync
    from ballast.training.checkpoint import gate

    roots = _committed_step_10(ctx, tmp_path)
    fresh = tmp_path / "resume"
    assert sync.pull(ctx, fresh, newest=1, shards=False) == ["step-00000010"]
    pulled = fresh / "step-00000010"
    every = set().union(*(node_files(n) for n in range(NODES)))
    assert ckpt.held_files(pulled) == {f for f in every if not f.endswith(".distcp")}
    assert not list(pulled.glob("*.distcp")) and not (fresh / sync.PULLING).exists()
    ckpt.verify(pulled, held_only=True)
    with pytest.raises(ckpt.CheckpointFailure, match="holds only this node's files"):
        ckpt.verify(pulled)  # never resumed from as a whole checkpoint

    # Bad requests: nothing is fetched, nothing left behind.
    for names, what in [(["../node0/step-00000010/__0_0.distcp"], "does not list"), (["nope.distcp"], "does not list")]:
        with pytest.raises(StorageError, match=what):
            sync.fetch(ctx, pulled, names)
    with pytest.raises(StorageError, match="holds the whole checkpoint"):
        sync.fetch(ctx, _whole(ctx, tmp_path), ["__1_0.distcp"])
    base = _base(ctx, 10)
    good = ctx.storage.read_bytes(base + "__1_0.distcp")
    ctx.storage.write_bytes(base + "__1_0.distcp", good[:-1] + bytes([good[-1] ^ 1]))  # damaged in storage
    with pytest.raises(StorageError, match=r"__1_0\.distcp: size or sha256 does not match"):
        sync.fetch(ctx, pulled, ["__1_0.distcp"])
    assert not (pulled / "__1_0.distcp").exists() and not list(pulled.glob(".fetch-*"))
    assert "__1_0.distcp" not in ckpt.held_files(pulled)
    ctx.storage.write_bytes(base + "__1_0.distcp", good)

    # The ones named: in place, listed as held, and the gate passes on what the node holds.
    assert sync.fetch(ctx, pulled, ["__1_0.distcp"]) == len(good)
    assert (pulled / "__1_0.distcp").read_bytes() == (roots[0] / "step-00000010" / "__1_0.distcp").read_bytes()
    assert "__1_0.distcp" in ckpt.held_files(pulled) and "__0_0.distcp" not in ckpt.held_files(pulled)
    ckpt.verify(pulled, held_only=True)
    assert sync.fetch(ctx, pulled, ["__1_0.distcp"]) == 0  # held already

    # A pulled share is never pushed back, even where storage no longer holds it.
    assert json.loads((pulled / ckpt.LOCAL_FILES).read_text())["pulled"] is True
    assert sync.push(ctx, fresh, node=1) == [] and sync.push(ctx, fresh, node=0) == []
    # Storage no longer holding that very checkpoint (its marker taken down): refused, and still not pushed.
    ctx.storage.delete(base + ckpt.COMMIT_MARKER)
    before = _stored(ctx, base)
    assert sync.push(ctx, fresh, node=0) == [] and _stored(ctx, base) == before
    with pytest.raises(StorageError, match="not committed in storage with this checkpoint's manifest"):
        sync.fetch(ctx, pulled, ["__0_0.distcp"])
    assert gate.node_local(pulled)


def _whole(ctx, tmp_path: Path) -> Path:
    from ballast.storage import checkpoints as sync

    sync.pull(ctx, tmp_path / "whole", newest=1)
    return tmp_path / "whole" / "step-00000010"


def _committed_step_10(ctx, tmp_path: Path) -> list[Path]:
    """Every node's directory with step 10 saved, both shares pushed and the checkpoint committed in storage."""
    from ballast.storage import checkpoints as sync

    roots = [tmp_path / f"node{n}" for n in range(NODES)]
    save_on_nodes(roots, 10)
    sync.push(ctx, roots[1], node=1)
    sync.push(ctx, roots[0], node=0)
    return roots


@pytest.mark.integration
def test_a_crash_between_shard_pushes_leaves_no_marker_and_the_previous_checkpoint_valid(ctx, tmp_path):
    from ballast.storage import checkpoints as sync

    roots = _committed_step_10(ctx, tmp_path)
    save_on_nodes(roots, 20)
    # Node 1 dies after its first shard of step 20 is in storage (no second shard, no PUSHED record).
    real_upload, uploaded = ctx.storage.upload, []

    def dying_upload(local, key):
        if uploaded:
            raise KeyboardInterrupt("node 1 killed")
        real_upload(local, key)
        uploaded.append(key)

    ctx.storage.upload = dying_upload
    with pytest.raises(KeyboardInterrupt):
        sync.push(ctx, roots[1], node=1)
    ctx.storage.upload = real_upload
    assert len(uploaded) == 1 and uploaded[0].startswith(_base(ctx, 20))
    # Node 0 waits for it a bounded time, says what is missing, and writes no marker over the gap.
    assert sync.push(ctx, roots[0], node=0, wait=1.5) == []
    assert ckpt.COMMIT_MARKER not in set(ctx.storage.list_dir(_base(ctx, 20)))
    fresh = tmp_path / "resume"
    assert sync.pull(ctx, fresh, newest=1) == ["step-00000010"]  # the previous checkpoint is the valid one

    # A shard of the same size but other bytes (node 1's file left from the crash, rewritten): still no
    # marker, since no PUSHED record of node 1 covers it for this manifest.
    name = uploaded[0].rsplit("/", 1)[-1]
    ctx.storage.write_bytes(_base(ctx, 20) + "__3_0.distcp", b"y" * len(_shard(20, 3)))
    assert sync.push(ctx, roots[0], node=0) == []
    assert ckpt.COMMIT_MARKER not in set(ctx.storage.list_dir(_base(ctx, 20))), name

    # Node 1 comes back and pushes its share: node 0 commits step 20, which a resume then pulls whole.
    sync.push(ctx, roots[1], node=1)
    assert sync.push(ctx, roots[0], node=0) == [ctx.storage.describe(_base(ctx, 20).rstrip("/"))]
    assert sync.pull(ctx, tmp_path / "resume2", newest=1) == ["step-00000020"]

    # A shard damaged in storage after the commit (same size): the pull's check refuses step 20.
    ctx.storage.write_bytes(_base(ctx, 20) + "__2_0.distcp", b"z" * len(_shard(20, 2)))
    assert sync.pull(ctx, tmp_path / "resume3", newest=1) == ["step-00000010"]


@pytest.mark.integration
def test_the_same_step_saved_again_is_recommitted_only_once_every_node_pushed_the_new_one(ctx, tmp_path):
    from ballast.storage import checkpoints as sync

    _committed_step_10(ctx, tmp_path)
    old = ctx.storage.read_bytes(_base(ctx, 10) + "__2_0.distcp")
    later = [tmp_path / f"later{n}" for n in range(NODES)]  # the next try's directories
    save_on_nodes(later, 10, version=1)
    # Node 1 does not push over a committed checkpoint with another manifest: node 0 takes it down first.
    assert sync.push(ctx, later[1], node=1) == []
    assert ctx.storage.read_bytes(_base(ctx, 10) + "__2_0.distcp") == old
    assert sync.push(ctx, later[0], node=0) == []  # marker down, its share up, node 1's not there yet
    assert ckpt.COMMIT_MARKER not in set(ctx.storage.list_dir(_base(ctx, 10)))
    sync.push(ctx, later[1], node=1)
    assert sync.push(ctx, later[0], node=0) == [ctx.storage.describe(_base(ctx, 10).rstrip("/"))]
    assert sync.pull(ctx, tmp_path / "resume", newest=1) == ["step-00000010"]
    assert (tmp_path / "resume" / "step-00000010" / "__2_0.distcp").read_bytes() == _shard(10, 2, 1)


def _two_agents(tmp: Path, cache, *, epochs: int, port: int, fetch: list[str] | None = None) -> list:
    """Two torchrun agents on loopback as two nodes of one rank each, under FSDP, each node with a
    checkpoint directory of its own (`tmp/node<k>/ckpt`, node-local; `fetch`: the command its ranks copy
    checkpoint files from storage with)."""
    import subprocess

    from helpers import config, torchrun

    def two_nodes(d):
        d["training"].update(nodes=2, processes_per_node=1, global_batch_size=64, parallelism="fsdp",
                             checkpoint={"every_steps": 10, "keep_last": 3})
        d["execution"] = {"backend": "slurm", "slurm": {"partition": "debug"}}

    args = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=multinode-s3-{epochs}"]
    agents = []
    for n in range(NODES):
        (tmp / f"node{n}").mkdir(parents=True, exist_ok=True)
        cfg = config(tmp / f"node{n}", cache, epochs=epochs, edit=two_nodes,
                     changes={"checkpoint.node_local": True, "checkpoint.fetch": fetch})
        agents.append(subprocess.Popen(torchrun(cfg, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True))
    out = [a.communicate(timeout=240) for a in agents]
    for a, (_, err) in zip(agents, out):
        assert a.returncode == 0, err[-3000:]
    return [so + se for so, se in out]


@pytest.mark.integration
def test_fsdp_on_two_nodes_pushes_real_shards_per_node_and_resumes_from_storage_at_the_step(ctx, tmp_path,
                                                                                           digits_cache):
    import re

    from ballast.storage import checkpoints as sync
    from helpers import free_port

    _two_agents(tmp_path, digits_cache, epochs=1, port=free_port())
    dirs = [tmp_path / f"node{n}" / "ckpt" for n in range(NODES)]
    newest = ckpt.committed(dirs[0])[-1]
    assert [p.name for p in ckpt.committed(dirs[1])] == [p.name for p in ckpt.committed(dirs[0])]
    assert ckpt.held_files(newest) >= {"__0_0.distcp", ".metadata", "trainer.json"}
    assert {n for n in ckpt.held_files(dirs[1] / newest.name) if n.endswith(".distcp")} == {"__1_0.distcp"}
    assert (dirs[1] / newest.name / ckpt.MANIFEST).read_bytes() == (newest / ckpt.MANIFEST).read_bytes()
    # Node 1's share first, then node 0, which commits: the marker written after every shard.
    assert sync.push(ctx, dirs[1], node=1) == []
    committed = sync.push(ctx, dirs[0], node=0)
    assert committed and committed[-1].endswith(newest.name)
    import boto3

    bucket, _, key = ctx.storage.describe(f"{ctx.run_key}/checkpoints/{newest.name}/")[5:].partition("/")
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]
    when = {o["Key"].rsplit("/", 1)[-1]: o["LastModified"] for o in listing}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", ckpt.COMMIT_MARKER} <= set(when)
    assert all(when[ckpt.COMMIT_MARKER] >= t for t in when.values())
    # The next try: each node pulls what it resumes from but the shard files (the resume gate run on the
    # files it holds); its rank, once the rendezvous ranked it, fetches the shard files its load reads
    # (its own and rank 0's, which holds what every rank holds alike), and both resume at the newest step.
    manifest = json.loads((newest / ckpt.MANIFEST).read_text())["files"]
    for n in range(NODES):
        fresh = tmp_path / "next" / f"node{n}" / "ckpt"
        assert sync.pull_for_resume(ctx, fresh, shards=False) == [newest.name]
        assert ckpt.held_files(fresh / newest.name) == {f for f in manifest if not f.endswith(".distcp")}
        assert not list((fresh / newest.name).glob("*.distcp"))
    # Node 1 as a node's own save leaves it: without rank 0's metadata and trainer state (fetched first).
    own = tmp_path / "next" / "node1" / "ckpt" / newest.name
    rank0_only = {".metadata", "trainer.json", "optim_groups.json", "scaler.pt"} & set(manifest)
    for name in rank0_only:
        (own / name).unlink()
    (own / ckpt.LOCAL_FILES).write_text(json.dumps({"files": sorted(ckpt.held_files(own) - rank0_only)}))
    step = int(newest.name.split("-")[1])
    outs = _two_agents(tmp_path / "next", digits_cache, epochs=2, port=free_port(), fetch=_fetch_command(ctx, tmp_path))
    assert re.search(rf"resumed from \S*{newest.name} \(epoch \d+, step {step}\)", "".join(outs)), outs[0][-2000:]
    fetched = [[set(names.split(", ")) for names in re.findall(
        rf"fetched from storage \d+ file\(s\) of {newest.name} this node's ranks read: (.*) \(", out)] for out in outs]
    assert fetched[1][0] == rank0_only and len(fetched[0]) == 1 and len(fetched[1]) == 2, fetched
    assert sorted([fetched[0][-1], fetched[1][-1]], key=len) == [{"__0_0.distcp"}, {"__0_0.distcp", "__1_0.distcp"}]
    later = [p for p in ckpt.committed(tmp_path / "next" / "node1" / "ckpt") if ckpt.step_of_name(p.name) > step]
    assert later and len({n for n in ckpt.held_files(later[-1]) if n.endswith(".distcp")}) == 1
    # Storage no longer vouching for it (its marker taken down after the pull): the fetch is refused, every
    # node skips it, and the group starts over rather than resume from part of it.
    for n in range(NODES):
        assert sync.pull_for_resume(ctx, tmp_path / "third" / f"node{n}" / "ckpt", shards=False) == [newest.name]
    ctx.storage.delete(f"{ctx.run_key}/checkpoints/{newest.name}/{ckpt.COMMIT_MARKER}")
    out = "".join(_two_agents(tmp_path / "third", digits_cache, epochs=1, port=free_port(),
                              fetch=_fetch_command(ctx, tmp_path)))
    assert re.search(rf"checkpoint skipped: \S*{newest.name}: could not fetch .*not committed in storage", out), out[-3000:]
    assert "starting from scratch" in out and "resumed from" not in out


def _fetch_command(ctx, tmp_path: Path) -> list[str]:
    """`python -m ballast.node --job JOB --fetch`, JOB a job file of ctx's run (what a node passes its ranks)."""
    import sys

    from ballast.node import NodeJob

    job = tmp_path / "job.json"
    job.write_text(NodeJob(spec=ctx.spec.model_dump(mode="json"), dag_id=ctx.dag_id, run_id=ctx.run_id, task_id="train",
                           try_number=2, name="t", run_config={}, out_dir="", checkpoint_dir="").model_dump_json())
    return [sys.executable, "-m", "ballast.node", "--job", str(job), "--fetch"]


@pytest.fixture(scope="module")
def cluster():
    from slurm_cluster import available, running_cluster

    why = available()
    if why:
        pytest.fail(why)
    with running_cluster() as c:
        yield c


@pytest.fixture
def slurm_bucket(s3_endpoint, monkeypatch):
    """The S3 server on loopback, reachable from the Slurm job's processes through the environment
    sbatch exports."""
    import boto3

    for key, value in {"AWS_ENDPOINT_URL_S3": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="ballast-multinode")
    return "ballast-multinode"


@pytest.mark.e2e
def test_two_slurm_nodes_on_s3_push_their_own_shards_and_a_killed_rank_resumes_from_storage_at_the_step(
        cluster, airflow_db, digits_raw, tmp_path, slurm_bucket):
    import re
    import sys

    import boto3

    from ballast.recovery import history
    from helpers import run_spec_dag

    def edit(d):
        d["dataset"]["location"] = str(digits_raw)
        d["storage"] = {"uri": f"s3://{slurm_bucket}/pipelines"}
        d["training"].update(epochs=2, nodes=2, processes_per_node=1, global_batch_size=64, parallelism="fsdp",
                             checkpoint={"every_steps": 10, "keep_last": 5},
                             rehearsal={"faults": [{"kind": "crash", "step": 25, "rank": 1, "on_try": 1}]})
        d["evaluation"].update(threshold=None, patience=10)
        d["recovery"] = {"retry_delay_seconds": 0, "max_restarts": 0}
        d["schedule"] = {}
        d["execution"] = {"backend": "slurm", "slurm": {
            "partition": "spot", "on_demand_partition": "ondemand", "python": sys.executable, "cpus_per_node": 1,
            "memory": "3000M", "poll_seconds": 0.5}}

    dr, ctx = run_spec_dag(tmp_path, edit, conf={"rehearsal": True}, name="multinode_s3")
    logs = {p.name: p.read_text() for p in (ctx.work_dir / "train" / "jobs").glob("*.log")}
    assert str(dr.state) == "success", "\n".join(t[-3000:] for t in logs.values())
    tries = history.load(ctx, "train").attempts
    assert [a.outcome for a in tries] == ["failed", "success"], [a.reason for a in tries]
    # Try 1 died at step 25 (rank 1 SIGKILLed): node 0 had committed its checkpoints in storage once both
    # nodes' shares were there; try 2's nodes each pulled the newest of them and the group resumed there,
    # at that very step.
    t1 = next(t for name, t in logs.items() if name.endswith("-t1.log"))
    t2 = next(t for name, t in logs.items() if name.endswith("-t2.log"))
    up = [int(s) for s in re.findall(r"checkpoint uploaded: \S*/step-(\d{8})", t1)]
    shares = {int(n) for n in re.findall(r"checkpoint share pushed: \d+ file\(s\) of \S*/step-\d{8} from node (\d)", t1)}
    assert up and max(up) >= 20 and shares == {0, 1}, t1[-3000:]
    pulled = re.findall(r"checkpoints from storage: (\S+)", t2)
    assert pulled == [f"step-{max(up):08d}"] * 2, t2[-3000:]  # on each node, the newest committed
    # ... but its shard files: each node's rank fetched those its load reads, its own and rank 0's.
    fetched = re.findall(rf"fetched from storage \d+ file\(s\) of step-{max(up):08d} this node's ranks read: (.*) \(", t2)
    assert sorted(fetched) == ["__0_0.distcp", "__0_0.distcp, __1_0.distcp"], t2[-3000:]
    assert tries[1].resumed_step == max(up), tries[1]
    assert re.search(rf"resumed from \S*step-{max(up):08d} \(epoch \d+, step {max(up)}\)", t2), t2[-3000:]
    # Rank 0 of try 2 went on with the run's curve history (node 0 pulled it): the view's curves start at
    # try 1's first steps, not at the resume.
    from ballast.training.curves import parse_history

    buckets = parse_history(ctx.storage.read_bytes(f"{ctx.run_key}/train/curves.json")).buckets()
    assert buckets and buckets[0]["first"] < max(up) < buckets[-1]["last"], buckets[:2]
    prefix = f"{ctx.run_key}/checkpoints/"
    from ballast.storage import checkpoints as sync

    names = [n for n in sync.stored(ctx.storage, prefix) if sync.stored_files(ctx.storage, prefix, n)]
    assert "step-00000020" in names and len(names) >= 2, names
    s3 = boto3.client("s3")
    root = ctx.storage.describe(prefix)[len(f"s3://{slurm_bucket}/"):]
    for name in names:
        listing = s3.list_objects_v2(Bucket=slurm_bucket, Prefix=f"{root}{name}/")["Contents"]
        when = {o["Key"].rsplit("/", 1)[-1]: o["LastModified"] for o in listing}
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "PUSHED-node0.json", "PUSHED-node1.json"} <= set(when)
        assert all(when[ckpt.COMMIT_MARKER] >= t for t in when.values()), (name, when)  # the marker last
        pushed = [json.loads(ctx.storage.read_bytes(f"{prefix}{name}/PUSHED-node{n}.json")) for n in range(NODES)]
        distcp = [{f for f in p["files"] if f.endswith(".distcp")} for p in pushed]
        assert sorted(map(len, distcp)) == [1, 1] and distcp[0] | distcp[1] == {"__0_0.distcp", "__1_0.distcp"}
    assert cluster.jobs() == [] and cluster.leftovers() == []


@pytest.mark.unit
def test_a_node_of_several_on_object_storage_commits_into_a_node_local_directory(tmp_path):
    from ballast.launch.config import run_config
    from ballast.node import NodeJob, node_config
    from ballast.spec import parse_spec
    from helpers import example_data

    d = example_data()
    d["storage"]["uri"] = "s3://ballast-bucket/pipelines"
    d["training"].update(nodes=2, processes_per_node=1, global_batch_size=64, parallelism="fsdp")
    d["execution"] = {"backend": "slurm", "slurm": {"partition": "debug"}}
    spec = parse_spec(d)  # several nodes on s3:// storage: accepted
    cfg = run_config(spec, data_dir="/w/cache", data_format="petastorm", checkpoint_dir="/w/ckpt", output_dir="/w/out")
    assert cfg.checkpoint.node_local is False  # the worker's own run config: one directory
    job = NodeJob(spec=spec.model_dump(mode="json"), dag_id=spec.dag_id, run_id="r", task_id="train", try_number=1,
                  name="t", run_config=cfg.model_dump(mode="json"), out_dir="/w/out", checkpoint_dir="/w/ckpt")
    fetch = ["python", "-m", "ballast.node", "--job", "s3://ballast-bucket/job.json", "--fetch"]
    node = node_config(job, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", data_dir="/n/cache",
                       data_format="petastorm", node_local=True, fetch=fetch)
    assert node.checkpoint.node_local is True and node.checkpoint.directory == str(tmp_path / "ckpt")
    assert node.checkpoint.fetch == fetch and cfg.checkpoint.fetch is None
    assert node.checkpoint.model_dump(exclude={"directory", "node_local", "fetch"}) \
        == cfg.checkpoint.model_dump(exclude={"directory", "node_local", "fetch"})
    with pytest.raises(ValueError, match="needs the all-gather"):
        ckpt.Writer(tmp_path, 10, rank=0, barrier=lambda: None, node_local=True)


@pytest.mark.unit
def test_each_nodes_outputs_are_pushed_and_merged_wherever_global_rank_0_ran(tmp_path):
    """Global rank 0 (summary, events, curve history) is on whichever node torchrun's rendezvous ranks
    first, not necessarily Ballast's node 0, and each node may hold a failure record: every node pushes
    under node<k>/, and the train task takes rank 0's files from wherever they are and the first
    failure written on any node as failure.json (the others as failure-rank<R>.json)."""
    from types import SimpleNamespace

    from ballast.node import push_outputs
    from ballast.stages.train_try import _fetch_outputs
    from ballast.storage import FileStorage
    from ballast.training.outputs import FailureRecord, read_failure, write_failure

    ctx = SimpleNamespace(storage=FileStorage(tmp_path / "store"), run_key="runs/d/r", try_number=2)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for k, out in enumerate(nodes):
        out.mkdir()
        (out / f"run-node{k}.json").write_text("{}")
    (nodes[1] / "summary.json").write_text('{"steps": 42}')  # rank 0 ran on node 1
    (nodes[1] / "metrics.jsonl").write_text('{"event": "step"}\n')
    write_failure(nodes[1], FailureRecord.model_validate({"class": "communication", "rank": 0, "time": 20.0}))
    write_failure(nodes[0], FailureRecord.model_validate({"class": "oom", "rank": 1, "time": 10.0}))  # first
    write_failure(nodes[0], FailureRecord.model_validate({"class": "communication", "rank": 2, "time": 30.0}))
    for k, out in enumerate(nodes):
        push_outputs(ctx, out, node=k)
    task = tmp_path / "task"
    task.mkdir()
    _fetch_outputs(ctx, task)
    assert (task / "summary.json").read_text() == '{"steps": 42}' and (task / "metrics.jsonl").is_file()
    assert (task / "run-node0.json").is_file() and (task / "run-node1.json").is_file()
    first = read_failure(task)
    assert (first.failure_class, first.rank) == ("oom", 1)
    assert read_failure(task, "failure-rank0.json").rank == 0 and read_failure(task, "failure-rank2.json").rank == 2
    assert sorted(p.name for p in task.iterdir()) == ["failure-rank0.json", "failure-rank2.json", "failure.json",
                                                      "metrics.jsonl", "run-node0.json", "run-node1.json",
                                                      "summary.json"]


@pytest.mark.unit
def test_a_node_pushes_its_outputs_before_the_last_checkpoint_push_that_a_kill_may_cut_short(tmp_path, monkeypatch):
    """When a rank on another node fails, Slurm kills this node's agent KillWait later, and node 0's last
    checkpoint push may wait longer than that for shares that will not come: rank 0's events and curve
    history are in storage before that push starts (the Slurm e2e test lost them now and then)."""
    from types import SimpleNamespace

    from ballast import node
    from ballast.storage import FileStorage

    ctx = SimpleNamespace(storage=FileStorage(tmp_path / "store"), run_key="runs/d/r", try_number=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"event": "step"}\n')
    (out / "curves.json").write_text("{}")
    waits = []

    def killed(ctx_, ckpt_dir, *, node, wait):  # the agent killed while node 0 waits for the others' shares
        waits.append(wait)
        raise SystemExit(-9)

    monkeypatch.setattr(node.checkpoint_sync, "push", killed)
    with pytest.raises(SystemExit):
        node.finish(ctx, out, tmp_path / "ckpt", node=0, pulled_history={})
    assert waits == [node.COMMIT_WAIT_SECONDS]
    stored = sorted(k.rsplit("/", 1)[-1] for k in ctx.storage.list(node.outputs_prefix(ctx.run_key, 1)))
    assert stored == ["curves.json", "metrics.jsonl"]
