"""Stage 2: convert the raw input into a Petastorm dataset and TFRecord shards, manifest written last.

Two engines write the same files (see ballast.data.packing for the layout and the encoding):
- `arrow` streams the raw row groups in one process, `conversion.read_batch_rows` at a time, and
  cuts a shard whenever a split has `shard_rows` rows buffered: memory is bounded by those two
  settings, not by the size of the data.
- `spark` runs the same encoding as a Spark job (ballast.data.spark).
A text dataset (`dataset.text`, a language model's documents) is tokenized, joined and cut into
`training.seq_len + 1` token sequences by ballast.data.text, streamed the same way (arrow engine).

`dataset_id` hashes the input fingerprint, the rows quarantined by validation and every setting that
changes the output (not the engine: both write the same bytes), so a re-run with the same input and
settings finds the manifest and reuses the output; a text dataset's id covers the tokenizer file's
sha256 and seq_len.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ballast.pipeline.context import RunContext
from ballast.errors import DataError, SpecError
from ballast.data.packing import (FORMAT_VERSION, SPLITS, FeatureEncoder, column_layouts, layout, plan_chunks, read_chunk,
                                  split_codes, unischema, write_petastorm_metadata, write_shard)
from ballast.data.progress import Progress
from ballast.data.raw import fingerprint_files, raw_files
from ballast.records import ConvertResult
from ballast.storage import ballast_home, sha256_file


def dataset_id(ctx: RunContext, input_fingerprint: str, quarantined: str = "") -> str:
    s = ctx.spec
    c = s.conversion
    key = {"v": FORMAT_VERSION, "input": input_fingerprint, "quarantined": quarantined,
           "fields": [f.model_dump() for f in s.dataset.fields], "label": s.dataset.label,
           "split": s.dataset.split.model_dump(), "formats": list(c.formats), "shard_rows": c.shard_rows,
           "row_group_rows": c.row_group_rows, "num_classes": s.dataset.num_classes, "task": s.training.task}
    if s.dataset.text is not None:
        from ballast.data.text import tokenizer_fingerprint

        key.update(text=s.dataset.text, tokenizer=tokenizer_fingerprint(ctx), seq_len=s.training.seq_len)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def load_quarantined(ctx: RunContext) -> Any:
    """Global row ids validation set aside (sorted int64), or an empty array."""
    import numpy as np

    q = ctx.result("validate").quarantine
    if q is None or not q.rows:
        return np.zeros(0, np.int64)
    return np.load(io.BytesIO(ctx.storage.read_bytes(q.row_ids_key)), allow_pickle=False)


def convert_arrow(chunks, spec, bad_rows, staging: Path, progress: Progress | None = None) -> list[dict]:
    """Stream the raw chunks into shards; returns the manifest entries of the shards written."""
    import numpy as np
    import pyarrow as pa

    ds, conv = spec.dataset, spec.conversion
    label = ds.label_field
    encoders = [*(FeatureEncoder(f) for f in ds.features), *([FeatureEncoder(label, "label")] if label else [])]
    layouts = [e.layout for e in encoders]
    pending: dict[str, list] = {s: [] for s in SPLITS}
    counts = {s: 0 for s in SPLITS}
    shard_no = {s: 0 for s in SPLITS}
    entries: list[dict] = []

    def cut(split: str, final: bool) -> None:
        while counts[split] >= conv.shard_rows or (final and counts[split]):
            cols = {c.name: pa.concat_arrays([p[c.name] for p in pending[split]]) for c in layouts}
            n = min(conv.shard_rows, counts[split])
            entries.extend(write_shard(staging, split, shard_no[split], {k: v.slice(0, n) for k, v in cols.items()},
                                       formats=conv.formats, layouts=layouts, row_group_rows=conv.row_group_rows))
            shard_no[split] += 1
            rest = counts[split] - n
            pending[split] = [{k: v.slice(n) for k, v in cols.items()}] if rest else []
            counts[split] = rest

    for chunk in chunks:
        done = 0
        for ids, values in read_chunk(chunk, ds, conv.read_batch_rows, drop=bad_rows):
            codes = split_codes(ids, validation=ds.split.validation, test=ds.split.test, seed=ds.split.seed)
            encoded = {e.layout.name: e.encode(values[e.layout.name]) for e in encoders}
            for code, split in enumerate(SPLITS):
                sel = np.flatnonzero(codes == code)
                if sel.size:
                    take = pa.array(sel)
                    pending[split].append({k: v.take(take) for k, v in encoded.items()})
                    counts[split] += sel.size
                    cut(split, final=False)
            done += len(ids)
            if progress:
                progress.add(len(ids))
        if progress and chunk.rows > done:  # the chunk's quarantined rows count as done too
            progress.add(chunk.rows - done)
    for split in SPLITS:
        cut(split, final=True)
    return entries


def finish(staging: Path, spec, entries: list[dict]) -> list[dict]:
    """Petastorm metadata per split, then sha256 of every file; the complete list of manifest entries."""
    out = list(entries)
    if "petastorm" in spec.conversion.formats:
        schema = unischema(column_layouts(spec.dataset, spec.training.seq_len))
        for split in SPLITS:
            parts = [e for e in entries if e["format"] == "petastorm" and e["split"] == split]
            if parts:
                path = write_petastorm_metadata(staging / "petastorm" / split, schema, parts)
                out.append({"path": f"petastorm/{split}/_common_metadata", "split": split, "format": "petastorm",
                            "rows": 0, "kind": "metadata", "bytes": path.stat().st_size})
    for e in out:
        e["sha256"] = sha256_file(staging / e["path"])
    return sorted(out, key=lambda e: (e["format"], SPLITS.index(e["split"]), e["path"]))


def run(ctx: RunContext) -> ConvertResult:
    spec = ctx.spec
    text = spec.dataset.text is not None
    tokenizer = None
    if text:
        from ballast.data.text import load_tokenizer

        if spec.conversion.engine != "arrow":
            raise SpecError(f"conversion.engine: {spec.conversion.engine} does not tokenize text; a text dataset"
                            f" (dataset.text) converts with engine arrow (the default)")
        tokenizer = load_tokenizer(ctx)  # before any data is read: a bad tokenizer fails here
    fingerprint = ctx.result("validate").input_fingerprint
    bad_rows = load_quarantined(ctx)
    quarantined = hashlib.sha256(bad_rows.tobytes()).hexdigest() if bad_rows.size else ""
    did = dataset_id(ctx, fingerprint, quarantined)
    prefix = f"datasets/{spec.name}/{did}"
    if ctx.storage.exists(f"{prefix}/manifest.json"):
        manifest = json.loads(ctx.storage.read_bytes(f"{prefix}/manifest.json"))
        ctx.log.info("reusing converted dataset %s (same input and settings)", ctx.storage.describe(prefix))
        return ConvertResult(dataset_id=did, prefix=prefix, reused=True, rows=manifest["rows"])

    t0 = time.monotonic()
    files = raw_files(ctx)
    if fingerprint_files(files) != fingerprint:
        # Never convert rows that validation did not see.
        raise DataError(f"dataset.location {spec.dataset.location}: the raw data changed after validation"
                        f" ({len(files)} file(s) now); run the pipeline again so the new data is validated")
    chunks = plan_chunks(files)
    total = sum(c.rows for c in chunks)
    staging = Path(tempfile.mkdtemp(prefix="convert-", dir=_staging_root()))
    try:
        ctx.log.info("converting %d rows (%d quarantined) with the %s engine into %s", total, bad_rows.size,
                     spec.conversion.engine, ", ".join(spec.conversion.formats))
        extra: dict = {}
        if text:
            from ballast.data.text import convert_text

            ctx.log.info("tokenizing %s with %s into %d-token sequences", spec.dataset.text, tokenizer.describe,
                         spec.training.seq_len + 1)
            progress = Progress(ctx.log, "tokenize", total, unit="documents", ctx=ctx, stage="convert").start()
            entries, extra["text"] = convert_text(chunks, spec, bad_rows, staging, tokenizer, spec.training.seq_len,
                                                  progress)
            mb = extra["text"]["text_bytes"] / 1e6
            ctx.log.info("tokenized %.1f MB of text in %.2fs (%.1f MB/s): %s", mb, time.monotonic() - t0,
                         mb / max(time.monotonic() - t0, 1e-9), ", ".join(
                             f"{s}={c['documents']} documents/{c['tokens']} tokens" for s, c in
                             extra["text"]["splits"].items()))
        elif spec.conversion.engine == "spark":
            from ballast.data.spark import convert_spark

            entries = convert_spark(chunks, spec, bad_rows, staging, log=ctx.log)
        else:
            progress = Progress(ctx.log, "convert", total, ctx=ctx, stage="convert").start()
            entries = convert_arrow(chunks, spec, bad_rows, staging, progress)
        entries = finish(staging, spec, entries)
        rows = {s: sum(e["rows"] for e in entries if e["split"] == s and e["format"] == spec.conversion.formats[0])
                for s in SPLITS}
        if not rows["train"]:
            what = f"no full sequence of {spec.training.seq_len + 1} tokens" if text else "no rows"
            raise DataError(f"dataset.location {spec.dataset.location}: {what} left for training after the split")
        columns = layout(spec.dataset, task=spec.training.task, seq_len=spec.training.seq_len,
                         tokenizer=tokenizer.manifest_entry() if tokenizer else None)
        manifest = {"dataset_id": did, "name": spec.name, "input_fingerprint": fingerprint,
                    "format_version": FORMAT_VERSION, **columns, "rows": rows,
                    "quarantined_rows": int(bad_rows.size), "files": entries, "created": time.time(), **extra}
        for i, e in enumerate(entries, 1):
            ctx.storage.upload(staging / e["path"], f"{prefix}/{e['path']}")
            if i % 50 == 0 or i == len(entries):
                ctx.log.info("uploaded %d/%d files", i, len(entries))
        # The manifest goes last: a dataset without one is incomplete and never read.
        ctx.storage.write_bytes(f"{prefix}/manifest.json", json.dumps(manifest, indent=2).encode())
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    seconds = time.monotonic() - t0
    ctx.log.info("converted %d rows into %d files in %.2fs (%s)", total, len(entries), seconds,
                 ", ".join(f"{s}={n}" for s, n in rows.items()))
    return ConvertResult(dataset_id=did, prefix=prefix, reused=False, rows=rows, files=len(entries),
                         engine=spec.conversion.engine, seconds=round(seconds, 3))


def _staging_root() -> Path:
    root = ballast_home() / "staging"
    root.mkdir(parents=True, exist_ok=True)
    return root
