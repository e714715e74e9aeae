"""Data for the workload tests, made here (no download, nothing written by Ballast), and the small
language model the LM and sharded-checkpoint tests train on it."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path


def stdlib_texts(limit_bytes: int) -> list[str]:
    """Source files of the Python standard library, in name order, up to `limit_bytes` of text."""
    out, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="replace")
        out.append(text)
        size += len(text.encode())
        if size >= limit_bytes:
            break
    return out


SEQ_LEN = 32
GPT = {"name": "gpt", "options": {"layers": 2, "width": 32, "heads": 2}}


def write_corpus(dest: Path, limit_bytes: int = 200_000) -> Path:
    """`stdlib_texts` as raw Parquet with a `text` column under `dest`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dest.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(stdlib_texts(limit_bytes), pa.string())}), dest / "part-0.parquet")
    return dest


def lm_spec(d: dict, raw: Path, *, epochs: int = 2) -> None:
    """The example spec turned into a small language model on the text under `raw`."""
    d["dataset"] = {"location": str(raw), "fields": [{"name": "text", "type": "string"}], "text": "text",
                    "tokenizer": {"kind": "bytes"}, "split": {"validation": 0.15, "test": 0.15, "seed": 3}}
    d["validation"]["rules"] = []
    d["conversion"]["shard_rows"] = 128
    t = d["training"]
    t.pop("hidden_size", None)
    t.update(task="causal_lm", model=GPT, seq_len=SEQ_LEN, epochs=epochs, micro_batch_size=16,
             global_batch_size=32, learning_rate=0.003, checkpoint={"every_steps": 10, "keep_last": 3})
    d["evaluation"] = {"patience": 10}


def lm_config(tmp: Path, ctx, cache, *, changes: dict | None = None, procs: int = 2) -> Path:
    """The run config of a training run on `cache` (the LM data of `lm_spec`), with `{"section.field": value}`
    changes written as given."""
    from ballast.launch.config import run_config

    manifest = json.loads((Path(cache.cache_dir) / "manifest.json").read_text())
    cfg = run_config(ctx.spec, data_dir=cache.cache_dir, data_format=cache.format, checkpoint_dir=str(tmp / "ckpt"),
                     output_dir=str(tmp / "out"), manifest=manifest)
    data = cfg.model_dump(mode="json")
    data["distributed"]["timeout_seconds"] = 120
    for dotted, value in (changes or {}).items():
        *head, last = dotted.split(".")
        node = data
        for part in head:
            node = node[part]
        node[last] = value
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "run.json").write_text(json.dumps(data))
    return tmp / "run.json"
