"""Stage 1: check the raw data with Great Expectations before anything trusts it.

Runs the spec's rules, the named suite files, and (by default) schema checks derived from the spec:
every field present with its type, no nulls, array fields of the declared shape, and integer labels
in [0, num_classes). A text dataset's tokenizer is loaded first (a missing or broken file fails before
any data is read), and its text column is checked through derived columns (`text_length`,
`duplicate_share`). A failure fails the task without retrying, listing which expectations failed, on
how many rows, with a few bad values.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from ballast.data.raw import fingerprint_files, raw_files
from ballast.errors import DataError, SpecError
from ballast.pipeline.context import RunContext
from ballast.records import Quarantine, ValidateResult
from ballast.spec import RuleSpec
from ballast.spec.validation import TEXT_RULES
from ballast.storage import ballast_home


def rules_for(ctx: RunContext) -> list[dict]:
    spec = ctx.spec
    rules: list[dict] = [r.model_dump() for r in spec.validation.rules]
    names = {f.name for f in spec.dataset.fields}
    for i, r in enumerate(spec.validation.rules):
        if r.kind in TEXT_RULES and r.column != spec.dataset.text:
            raise SpecError(f"validation.rules[{i}]: rule {r.kind!r} checks the text column (dataset.text:"
                            f" {spec.dataset.text!r}), not {r.column!r}")
    for suite in spec.validation.suites:
        from pydantic import ValidationError

        from ballast import data_checks

        try:
            path, data = data_checks.load_suite(suite)
        except ValueError as exc:
            raise SpecError(f"validation.suites: {exc}") from exc
        for i, raw in enumerate((data or {}).get("rules", [])):
            try:
                rule = RuleSpec.model_validate(raw)
            except ValidationError as exc:
                raise SpecError(f"{path}: rules[{i}]: {exc.errors()[0]['msg']}") from exc
            if rule.column is not None and rule.column not in names:
                raise SpecError(f"{path}: rules[{i}].column: {rule.column!r} is not a field of dataset"
                                f" {spec.name!r} ({', '.join(sorted(names))})")
            if rule.kind in TEXT_RULES and rule.column != spec.dataset.text:
                raise SpecError(f"{path}: rules[{i}]: rule {rule.kind!r} checks the text column (dataset.text:"
                                f" {spec.dataset.text!r}), not {rule.column!r}")
            rules.append(rule.model_dump())
    if spec.validation.schema_checks:
        for f in spec.dataset.fields:
            rules.append({"kind": "not_null", "column": f.name})
            if f.shape:
                rules.append({"kind": "shape", "column": f.name})
        label = spec.dataset.label_field
        if label is not None and spec.dataset.num_classes and label.type in ("int32", "int64", "uint8"):
            rules.append({"kind": "between", "column": label.name, "min": 0, "max": spec.dataset.num_classes - 1})
    return rules


def run(ctx: RunContext) -> ValidateResult:
    from ballast.spec.loading import check_model_options

    check_model_options(ctx.spec, source=ctx.spec_file or ctx.spec.name)  # before any data is read
    t0 = time.monotonic()
    v = ctx.spec.validation
    rules = rules_for(ctx)
    if ctx.spec.dataset.text is not None:
        from ballast.data.text import load_tokenizer

        tok = load_tokenizer(ctx)  # a missing or unreadable tokenizer fails before any data is read
        ctx.log.info("tokenizer: %s (vocabulary %d, end-of-text id %d)", tok.describe, tok.vocab_size, tok.eot_id)
    files = raw_files(ctx)
    quarantine = v.on_failure == "quarantine"
    report = _report(ctx, files, rules, quarantine)
    n_rows = report.rows
    result = ValidateResult(
        rows=n_rows,
        files=[str(p) for p in files],
        input_fingerprint=fingerprint_files(files),
        expectations=report.evaluated,
        failures=[f.line() for f in report.failures],
        data_docs=_keep_data_docs(ctx, report.docs_dir),
        seconds=round(time.monotonic() - t0, 3),
    )
    if report.success:
        ctx.log.info("all %d expectations passed on %d rows", report.evaluated, n_rows)
        return result
    for f in report.failures:
        ctx.log.error("expectation failed: %s", f.line())
    where = f"dataset.location {ctx.spec.dataset.location}"
    if not quarantine:
        ctx.save_result("validate", result)  # the report and Data Docs stay findable after the failure
        raise DataError(f"{where}: {report.summary()}")
    table_level = [f for f in report.failures if f.rows is None]
    if table_level:
        ctx.save_result("validate", result)
        raise DataError(f"{where}: table-level expectations failed, which quarantining rows cannot fix: "
                        + "; ".join(f.line() for f in table_level))
    return result.model_copy(update={"quarantine": _quarantine(ctx, report, result, files)})


def _report(ctx: RunContext, files: list[Path], rules: list[dict], row_indices: bool):
    """Run the rules over the raw files a bounded batch at a time, or on Spark for the spark engine."""
    from ballast.data.progress import Progress
    from ballast.data.validate_batches import array_columns, check_files, frames

    ds = ctx.spec.dataset
    counts = check_files(files, ds)  # every footer read and schema checked before any data
    texts = [ds.text] if ds.text else []
    spark = ctx.spec.conversion.engine == "spark"
    ctx.log.info("validating %d rows from %d file(s) with %d rules %s", sum(counts), len(files), len(rules),
                 "on Spark" if spark else "in bounded batches")
    if spark:
        from ballast.data.validate_spark import validate_on_spark

        return validate_on_spark(files, counts, ds, rules, name=ctx.spec.name, row_indices=row_indices,
                                 master=ctx.spec.conversion.spark_master)
    from ballast.data_checks.combine import BatchValidation

    checker = BatchValidation(rules, array_columns=array_columns(ds), text_columns=texts, name=ctx.spec.name,
                              row_indices=row_indices, spill_dir=ballast_home() / "tmp")
    progress = Progress(ctx.log, "validate", sum(counts))  # in the task log, every few seconds
    try:
        for offset, frame in frames(files, ds, max_rows=ctx.spec.conversion.read_batch_rows):
            checker.add(frame, offset)
            progress.add(len(frame))
        return checker.finish()
    finally:
        checker.close()


def _quarantine(ctx: RunContext, report, result: ValidateResult, files: list[Path]) -> Quarantine:
    """Set the failing rows aside in a quarantine file; fail if there are more than allowed. The rows are
    read back and written a batch at a time (to a local file, then to storage): however many fail, no
    more than one batch of them is held, with 8 bytes per failing row for their numbers."""
    import tempfile

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ballast.data.validate_batches import row_schema, rows_at

    v = ctx.spec.validation
    failed = [(f"{f.expectation}({f.column})" if f.column else f.expectation, np.unique(np.asarray(f.rows, np.int64)))
              for f in report.failures if f.rows is not None and len(f.rows)]
    bad = np.unique(np.concatenate([rows for _, rows in failed])) if failed else np.empty(0, np.int64)
    total = result.rows
    fraction = len(bad) / max(total, 1)
    if fraction > v.max_bad_fraction:
        ctx.save_result("validate", result)
        raise DataError(f"validation.max_bad_fraction: {len(bad)} of {total} rows ({fraction:.2%}) fail"
                        f" expectations, more than the {v.max_bad_fraction:.2%} allowed; {report.summary()}")
    prefix = f"{ctx.run_key}/quarantine"
    schema = row_schema(files, ctx.spec.dataset)
    schema = schema.append(pa.field("_row", pa.int64())).append(pa.field("_failed", pa.string()))
    spill = ballast_home() / "tmp"
    spill.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quarantine-", dir=spill) as tmp:
        rows_file, ids_file = Path(tmp) / "rows.parquet", Path(tmp) / "row_ids.npy"
        with pq.ParquetWriter(rows_file, schema) as writer:
            for ids, table in rows_at(files, ctx.spec.dataset, bad, max_rows=ctx.spec.conversion.read_batch_rows):
                reasons = [[] for _ in range(len(ids))]
                for label, rows in failed:
                    at = np.minimum(np.searchsorted(rows, ids), len(rows) - 1)
                    for i in np.flatnonzero(rows[at] == ids):
                        reasons[i].append(label)
                writer.write_table(table.append_column("_row", pa.array(ids)).append_column(
                    "_failed", pa.array(["; ".join(r) for r in reasons], pa.string())))
        np.save(ids_file, bad, allow_pickle=False)
        ctx.storage.upload(ids_file, f"{prefix}/row_ids.npy")
        ctx.storage.upload(rows_file, f"{prefix}/rows.parquet")
    ctx.log.warning("quarantined %d of %d rows (%.2f%%, limit %.2f%%) into %s; the other rows go on", len(bad),
                    total, 100 * fraction, 100 * v.max_bad_fraction,
                    ctx.storage.describe(f"{prefix}/rows.parquet"))
    return Quarantine(rows=len(bad), fraction=round(fraction, 6), file=f"{prefix}/rows.parquet",
                      row_ids_key=f"{prefix}/row_ids.npy")


def _keep_data_docs(ctx: RunContext, docs_dir: Path | None) -> str | None:
    """Copy GX's Data Docs site into the run's storage; returns the key of its index.html."""
    if docs_dir is None or not (docs_dir / "index.html").exists():
        return None
    prefix = f"{ctx.run_key}/data_docs"
    for p in sorted(docs_dir.rglob("*")):
        if p.is_file():
            ctx.storage.upload(p, f"{prefix}/{p.relative_to(docs_dir).as_posix()}")
    shutil.rmtree(docs_dir, ignore_errors=True)
    ctx.log.info("Data Docs: %s", ctx.storage.describe(f"{prefix}/index.html"))
    return f"{prefix}/index.html"
