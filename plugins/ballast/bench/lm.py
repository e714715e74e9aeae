"""`ballast bench lm`: the language-model workload, measured side by side in one run.

* Training: tokens/s of the Ballast trainer (every monitor on) against training/baseline.py, a plain
  hand-written DDP loop of the same `gpt`, data, order and batch, on two CPU ranks (gloo); runs
  alternate, the median of the per-pair ratios is reported; target >= 0.95x.
* Tokenization: MB/s of text through the pipeline's tokenizer path (ballast.data.text: reading the
  batches, `encode_batch`, joining documents with end-of-text, cutting sequences) against `tokenizers`'
  own `encode_batch` of the same documents with the same tokenizer file, single process; target >= 0.8x.
* Conversion memory: peak RSS of the convert stage (tokenize and pack) on the corpus and on ten times
  it, each in a process of its own; target <= 1.2x (streamed in bounded batches, never the corpus whole).

The corpus is the Python standard library's own source (on every machine, nothing downloaded).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ballast.bench.measure import target

SEQ_LEN = 128
GPT = {"name": "gpt", "options": {"layers": 4, "width": 128, "heads": 4}}


def stdlib_corpus(limit_bytes: int) -> list[str]:
    """Source files of the Python standard library, sorted by path, up to `limit_bytes` of text."""
    import sysconfig

    out, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        out.append(text)
        size += len(text.encode())
        if size >= limit_bytes:
            break
    return out


def write_corpus(dest: Path, docs: list[str], *, copies: int = 1) -> Path:
    """`docs` (`copies` times over) as raw Parquet with a `text` column, written a copy at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dest.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": pa.array(docs, pa.string())})
    with pq.ParquetWriter(dest / "part-0.parquet", table.schema) as w:
        for _ in range(copies):
            w.write_table(table, row_group_size=256)
    return dest


def lm_spec(root: Path, raw: Path, *, tokenizer: dict | None = None, epochs: int = 1) -> Any:
    import yaml

    from ballast.spec import parse_spec

    example = Path(__file__).resolve().parents[3] / "dags" / "specs" / "digits.yaml"
    d = yaml.safe_load(example.read_text())
    d["dataset"] = {"location": str(raw), "fields": [{"name": "text", "type": "string"}], "text": "text",
                    "tokenizer": tokenizer or {"kind": "bytes"}, "split": {"validation": 0.05, "test": 0.05, "seed": 1}}
    d["validation"]["rules"] = []
    d["conversion"].update(formats=["petastorm"], shard_rows=512)
    d["storage"]["uri"] = str(root / "storage")
    d["cache"]["directory"] = str(root / "cache")
    d["evaluation"] = {"patience": 1000}
    t = d["training"]
    t.pop("hidden_size", None)
    t.update(task="causal_lm", model=GPT, seq_len=SEQ_LEN, epochs=epochs, processes_per_node=2, micro_batch_size=8,
             global_batch_size=16, learning_rate=0.001, checkpoint={"every_seconds": 31_536_000})
    return parse_spec(d)


def _prepare(root: Path, spec) -> tuple[Any, dict]:
    """The corpus validated, tokenized, converted and cached by the real stages."""
    from ballast.pipeline.context import RunContext
    from ballast.stages import convert, validate, warm_cache

    ctx = RunContext(spec=spec, dag_id="bench_lm", run_id="bench")
    for module in (validate, convert, warm_cache):
        ctx.save_result(module.__name__.rsplit(".", 1)[-1], module.run(ctx))
    warm_cache.warm_rest(ctx)
    cache = ctx.result("warm_cache")
    return cache, json.loads((Path(cache.cache_dir) / "manifest.json").read_text())


def _config(spec, cache, manifest: dict, run: Path, changes: dict[str, Any] | None = None) -> Path:
    from ballast.launch.config import run_config

    cfg = run_config(spec, data_dir=cache.cache_dir, data_format=cache.format, checkpoint_dir=str(run / "ckpt"),
                     output_dir=str(run / "out"), manifest=manifest)
    run.mkdir(parents=True, exist_ok=True)
    cfg.updated(changes or {}).dump(run / "run.json")
    return run / "run.json"


def bench_training(root: Path, *, repeat: int = 3, epochs: int = 1) -> dict[str, Any]:
    from ballast.bench.train_runtime import _free_port_block, _torchrun
    from ballast.training.outputs import read_summary

    raw = write_corpus(root / "raw", stdlib_corpus(1_000_000))
    spec = lm_spec(root, raw, epochs=epochs)
    cache, manifest = _prepare(root, spec)
    ours, plain = [], []
    for i in range(repeat):
        for kind in (("trainer", "plain") if i % 2 == 0 else ("plain", "trainer")):
            run = root / f"{kind}-{i}"
            if kind == "trainer":
                _torchrun(_config(spec, cache, manifest, run, {"execution.metrics_port": _free_port_block(2)}))
                ours.append(read_summary(run / "out").samples_per_second * SEQ_LEN)
            else:
                _torchrun(_config(spec, cache, manifest, run), module="ballast.training.baseline")
                plain.append(json.loads((run / "out" / "baseline.json").read_text())["samples_per_second"] * SEQ_LEN)
    ratios = [a / b for a, b in zip(ours, plain)]
    return {"model": f"gpt {GPT['options']}, seq_len {SEQ_LEN}, micro-batch 8 x 2 ranks (gloo, CPU)",
            "train_rows": manifest["rows"]["train"], "trainer_tokens_per_second": ours,
            "plain_ddp_tokens_per_second": plain, "ratios": ratios, "ratio": statistics.median(ratios)}


def train_tokenizer(docs: list[str], path: Path, vocab: int = 2048) -> Path:
    """A byte-level BPE tokenizer trained on `docs` with `tokenizers`, saved as its JSON file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"]))
    tok.save(str(path))
    return path


def pipeline_tokenize(raw: Path, tokenizer: bytes, *, seq_len: int, batch_rows: int = 4096) -> int:
    """What the convert stage does to text, without writing: read the raw Parquet in bounded slices,
    encode with the tokenizer file, join with end-of-text and cut sequences. The number of sequences."""
    from ballast.data.packing import plan_chunks
    from ballast.data.text import SequenceCutter, file_tokenizer, text_slices

    tok = file_tokenizer(tokenizer, "bench")
    cutter = SequenceCutter(seq_len + 1, 512, tok.eot_id)
    n = 0
    for chunk in plan_chunks(sorted(raw.glob("*.parquet"))):
        for _, texts in text_slices(chunk, "text", batch_rows, None):
            for rows in cutter.add(*tok.encode(texts)):
                n += len(rows)
    for rows in cutter.finish():
        n += len(rows)
    return n


def bench_tokenization(root: Path, *, mb: float = 8.0, repeat: int = 3) -> dict[str, Any]:
    """The pipeline's tokenization of a corpus against `tokenizers`' own batch encode, same file."""
    from tokenizers import Tokenizer

    root.mkdir(parents=True, exist_ok=True)
    docs = stdlib_corpus(int(mb * 1e6))
    size = sum(len(d.encode()) for d in docs) / 1e6
    path = train_tokenizer(docs[: max(1, len(docs) // 10)], root / "tokenizer.json")
    raw = write_corpus(root / "raw-tok", docs)
    ours, theirs = [], []
    for i in range(repeat):
        for kind in (("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")):
            t0 = time.perf_counter()
            if kind == "ours":
                n = pipeline_tokenize(raw, path.read_bytes(), seq_len=SEQ_LEN)
                ours.append(size / (time.perf_counter() - t0))
            else:
                tok = Tokenizer.from_str(path.read_text())
                for start in range(0, len(docs), 1024):
                    tok.encode_batch(docs[start:start + 1024], add_special_tokens=False)
                theirs.append(size / (time.perf_counter() - t0))
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"corpus_mb": round(size, 2), "documents": len(docs), "sequences": n, "pipeline_mb_per_second": ours,
            "tokenizers_encode_batch_mb_per_second": theirs, "ratios": ratios, "ratio": statistics.median(ratios)}


CONVERT_CHILD = r"""
import json, sys
from pathlib import Path
from ballast.bench.lm import lm_spec
root, raw, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
spec = lm_spec(root, raw)
from ballast.pipeline.context import RunContext
from ballast.stages import convert, validate
ctx = RunContext(spec=spec, dag_id="bench_lm", run_id="rss")
for m in (validate, convert):
    ctx.save_result(m.__name__.rsplit(".", 1)[-1], m.run(ctx))
# VmHWM: this process's own peak (ru_maxrss would carry the forking parent's over the exec)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
out.write_text(json.dumps({"peak_rss_mb": hwm / 1024, "rows": ctx.result("convert").rows}))
"""


def bench_conversion_memory(root: Path, *, mb: float = 4.0) -> dict[str, Any]:
    """Peak RSS of validate + convert (tokenize and pack) on 1x and 10x the corpus, a process each."""
    docs = stdlib_corpus(int(mb * 1e6))
    out = {}
    # A script file, not `python -c`: pyspark 4.3 (imported by Great Expectations) ends a process whose
    # __main__ has no file with exit status 0 when Spark Connect's extras are missing.
    child = root / "convert_child.py"
    root.mkdir(parents=True, exist_ok=True)
    child.write_text(CONVERT_CHILD)
    for copies in (1, 10):
        raw = write_corpus(root / f"raw-{copies}x", docs, copies=copies)
        result = root / f"conv-{copies}x.json"
        proc = subprocess.run([sys.executable, str(child), str(root / f"conv-{copies}x"), str(raw), str(result)],
                              capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not result.is_file():
            raise RuntimeError(f"conversion of {copies}x the corpus failed:\n{proc.stderr[-3000:]}")
        out[f"{copies}x"] = json.loads(result.read_text())
    return {"corpus_mb": round(sum(len(d.encode()) for d in docs) / 1e6, 2), "runs": out,
            "ratio": out["10x"]["peak_rss_mb"] / out["1x"]["peak_rss_mb"]}


def bench_lm(*, repeat: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ballast-bench-lm-") as tmp:
        root = Path(tmp)
        tokenization = bench_tokenization(root / "tok", repeat=repeat)
        memory = bench_conversion_memory(root / "rss")
        training = bench_training(root / "train", repeat=repeat)
    return {
        "benchmark": "lm", "training": training, "tokenization": tokenization, "conversion_memory": memory,
        "targets": {
            "trainer_vs_plain_ddp_tokens_per_second": target(round(training["ratio"], 4), 0.95, lower_is_better=False),
            "tokenization_vs_tokenizers_encode_batch": target(round(tokenization["ratio"], 4), 0.8,
                                                              lower_is_better=False),
            "conversion_peak_rss_10x_vs_1x": target(round(memory["ratio"], 4), 1.2),
        },
    }
