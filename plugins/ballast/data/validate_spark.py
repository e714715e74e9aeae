"""Validation on Spark, for the spark conversion engine: the same rules, report, Data Docs and quarantine.

The raw files are read by Spark; each row gets its global row number (`_row`: the file's offset, from
the footers, plus Parquet's `_metadata.row_index`), and the derived columns the pandas path computes
per batch are Spark expressions: an array's length, min, max (null when an element is NaN or null, as
numpy's reduction gives NaN, which GX counts as missing) and finiteness, a float's finiteness, a text's
length and whether it repeats an earlier row's text (a window over the text, ordered by row), a
balance column's share of the non-null rows. Great Expectations' Spark data source then evaluates the
expectations on the whole DataFrame (Spark spills), in GX's SUMMARY format: counts and a few examples,
never every failing row (GX's COMPLETE format collects them all into the driver). For each failed
row-level expectation, `failing_rows` then asks Spark for the rows of GX's own condition: the first few
by `_row` (so the examples equal the pandas path's) and, for the quarantine, every failing row number,
streamed into an int64 array.
"""

from __future__ import annotations

from functools import reduce
from pathlib import Path
from typing import Any

from ballast.data_checks import Report
from ballast.errors import DataError
from ballast.spec import DatasetSpec

ROW = "_row"
_FLOAT = ("float32", "float64")


def derived_frame(spark: Any, paths: list[Path], offsets: list[int], dataset: DatasetSpec, rules: list[dict]) -> Any:
    """A Spark DataFrame of `_row` and the validation columns (raw.check_frame's, as Spark expressions)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    parts = [spark.read.parquet(str(p)).select(
        *[F.col(f.name) for f in dataset.fields],
        (F.lit(off).cast("long") + F.col("_metadata.row_index")).alias(ROW)) for p, off in zip(paths, offsets)]
    raw = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    inf = float("inf")
    cols = [F.col(ROW)]
    for f in dataset.fields:
        c = F.col(f.name)
        if f.name == dataset.text:
            first = Window.partitionBy(c).orderBy(F.col(ROW))
            cols += [F.length(c).cast("double").alias(f"{f.name}__len"),
                     F.when(c.isNull(), F.lit(0)).otherwise(
                         (F.row_number().over(first) > 1).cast("int")).alias(f"{f.name}__dup")]
        elif not f.shape:
            cols.append(c)
            if f.type in _FLOAT:
                x = c.cast("double")
                cols.append(F.coalesce(~(F.isnan(x) | (F.abs(x) == inf)), F.lit(False)).alias(f"{f.name}__finite"))
        else:
            def missing(x):
                return x.isNull() | F.isnan(x.cast("double"))

            def bad(x):
                return missing(x) | (F.abs(x.cast("double")) == inf)

            nan = F.exists(c, missing)
            cols += [F.when(c.isNull(), None).otherwise(F.size(c)).cast("double").alias(f"{f.name}__len"),
                     F.when(nan, None).otherwise(F.array_min(c)).cast("double").alias(f"{f.name}__min"),
                     F.when(nan, None).otherwise(F.array_max(c)).cast("double").alias(f"{f.name}__max"),
                     F.coalesce(~F.exists(c, bad), F.lit(True)).alias(f"{f.name}__finite")]
    frame = raw.select(*cols)
    for col in sorted({r["column"] for r in rules if r["kind"] == "balance"}):
        nonnull = frame.where(F.col(col).isNotNull()).count()
        shares = frame.where(F.col(col).isNotNull()).groupBy(col).agg(
            (F.count(F.lit(1)) / F.lit(float(nonnull))).alias(f"{col}__share"))
        frame = frame.join(shares, on=col, how="left")
    return frame


def validate_on_spark(paths: list[Path], counts: list[int], dataset: DatasetSpec, rules: list[dict], *, name: str,
                      row_indices: bool, master: str) -> Report:
    """Run the rules with GX on a Spark DataFrame of the raw files (`counts`: their rows, from the footers);
    the Report the pandas path gives."""
    import great_expectations as gx
    from great_expectations.validator.v1_validator import Validator

    from ballast.data.spark import session
    from ballast.data.validate_batches import array_columns
    from ballast.data_checks import expectations_for, gx_context, report_of
    from ballast.data_checks.combine import PARTIAL, publish

    offsets = [sum(counts[:i]) for i in range(len(counts))]
    context = gx_context()
    spark = session(master)
    try:
        frame = derived_frame(spark, paths, offsets, dataset, rules)
        source = context.data_sources.add_spark(name=f"{name}_source")
        batch_def = source.add_dataframe_asset(name=f"{name}_frame").add_batch_definition_whole_dataframe(
            f"{name}_batch")
        suite = context.suites.add(gx.ExpectationSuite(name=f"{name}_suite"))
        texts = [dataset.text] if dataset.text else []
        for exp in expectations_for(rules, array_columns=array_columns(dataset), text_columns=texts):
            suite.add_expectation(exp)
        # SUMMARY: counts and GX's own few examples (in partition order), nothing per row. The failing rows
        # of each failed column-map expectation are then queried by its condition (`failing_rows`).
        validator = Validator(batch_definition=batch_def, batch_parameters={"dataframe": frame},
                              result_format={"result_format": "SUMMARY", "partial_unexpected_count": PARTIAL})
        result = validator.validate_expectation_suite(suite)
        doubles = {f.name for f in frame.schema.fields if f.dataType.typeName() == "double"}
        rows_of = {}  # expectation id -> every failing row's number (with row_indices)
        for res in result.results:
            for key in ("partial_unexpected_index_list", "partial_unexpected_counts", "unexpected_list"):
                (res.result or {}).pop(key, None)  # in partition order, and per row: not kept
            if not res.success and (res.result or {}).get("unexpected_count"):
                rows_of[res.expectation_config.id] = failing_rows(
                    validator._wrapped_validator, res, keep_indices=row_indices, doubles=doubles)
    except DataError:
        raise
    except Exception as exc:
        from ballast.data.spark import _root_cause

        raise DataError(f"conversion.engine spark: validation on Spark failed: {_root_cause(exc)}") from exc
    finally:
        spark.stop()
    order = {e.id: i for i, e in enumerate(suite.expectations)}  # GX on Spark returns them in its own order
    result.results.sort(key=lambda res: order.get(res.expectation_config.id, len(order)))
    result.meta.pop("batch_spec", None)  # it holds the DataFrame's plan, not JSON
    report = report_of(result, rows=sum(counts), docs_dir=publish(context, suite, result, result.batch_id))
    # Every failing row's number, where the result (and its Data Docs) keeps the first INDICES.
    for failure, res in zip(report.failures, [r for r in result.results if not r.success], strict=True):
        if rows_of.get(res.expectation_config.id) is not None:
            failure.rows = rows_of[res.expectation_config.id]
    return report


def failing_rows(validator: Any, res: Any, *, keep_indices: bool, doubles: set[str]) -> Any:
    """Rewrite a failed column-map expectation's result as the pandas path has it, without collecting
    its failing rows: the first PARTIAL values by row (a null double is NaN there, as pandas holds it)
    and, with keep_indices, the first INDICES row numbers; returns every failing row's number, streamed
    into one sorted int64 array (8 bytes a row, as the pandas path keeps them), or None. The rows are
    those of GX's own condition for the expectation (its `<metric>.condition` metric on the Spark engine:
    null handling and, for uniqueness, the window included), applied to the records of its domain.
    GX's SUMMARY examples are in partition order, not by row."""
    import numpy as np
    from great_expectations.expectations.registry import get_metric_kwargs
    from great_expectations.validator.metric_configuration import MetricConfiguration
    from pyspark.sql import functions as F

    from ballast.data_checks.combine import INDICES, PARTIAL

    cfg = res.expectation_config
    metric = getattr(type(cfg.to_domain_obj()), "map_metric", None)
    info, column = res.result, cfg.kwargs.get("column")
    if not metric or column is None:
        return None  # an aggregate or table expectation: no rows to name
    name = f"{metric}.condition"
    kwargs = get_metric_kwargs(name, configuration=cfg)
    condition, compute, accessor = validator.get_metric(
        MetricConfiguration(name, kwargs["metric_domain_kwargs"], kwargs["metric_value_kwargs"]))
    records = validator.execution_engine.get_domain_records(domain_kwargs={**compute, **accessor})
    bad = records.withColumn("__unexpected", condition).where(F.col("__unexpected")).select(ROW, column)
    nan = float("nan") if column in doubles else None
    first = bad.orderBy(ROW).limit(PARTIAL).collect()
    info["partial_unexpected_list"] = [nan if r[column] is None else r[column] for r in first]
    if not keep_indices:
        return None
    rows = np.sort(np.fromiter((r[0] for r in bad.select(ROW).toLocalIterator()), np.int64))
    if len(rows) != info.get("unexpected_count"):  # the quarantine must hold exactly the rows GX counted
        raise DataError(f"conversion.engine spark: {cfg.type} on {column}: GX counted {info.get('unexpected_count')}"
                        f" failing rows, its condition selects {len(rows)}; is great-expectations the pinned 1.24.1?")
    info["unexpected_index_list"] = rows[:INDICES].tolist()
    return rows
