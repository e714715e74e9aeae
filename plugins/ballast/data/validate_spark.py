"""Validation on Spark, for the spark conversion engine: the same rules, report, Data Docs and quarantine.

The raw files are read by Spark; each row gets its global row number (`_row`: the file's offset, from
the footers, plus Parquet's `_metadata.row_index`), and the derived columns the pandas path computes
per batch are Spark expressions: an array's length, min, max (null when an element is NaN or null, as
numpy's reduction gives NaN, which GX counts as missing) and finiteness, a float's finiteness, a text's
length and whether it repeats an earlier row's text (a window over the text, ordered by row), a
balance column's share of the non-null rows. Great Expectations' Spark data source then evaluates the
expectations on the whole DataFrame (Spark spills; nothing is collected but the results). Failing rows
come back as (`_row`, value) pairs, sorted by row, so the examples and indices equal the pandas path's.
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
        # COMPLETE with the row column: every failing row's (row, value), sorted below into the pandas order.
        result_format = {"result_format": "COMPLETE", "partial_unexpected_count": PARTIAL,
                         "unexpected_index_column_names": [ROW]}
        result = Validator(batch_definition=batch_def, batch_parameters={"dataframe": frame},
                           result_format=result_format).validate_expectation_suite(suite)
        doubles = {f.name for f in frame.schema.fields if f.dataType.typeName() == "double"}
    except DataError:
        raise
    except Exception as exc:
        from ballast.data.spark import _root_cause

        raise DataError(f"conversion.engine spark: validation on Spark failed: {_root_cause(exc)}") from exc
    finally:
        spark.stop()
    order = {e.id: i for i, e in enumerate(suite.expectations)}  # GX on Spark returns them in its own order
    result.results.sort(key=lambda res: order.get(res.expectation_config.id, len(order)))
    for res in result.results:
        in_row_order(res, keep_indices=row_indices, doubles=doubles)
    result.meta.pop("batch_spec", None)  # it holds the DataFrame's plan, not JSON
    return report_of(result, rows=sum(counts), docs_dir=publish(context, suite, result, result.batch_id))


def in_row_order(res: Any, *, keep_indices: bool, doubles: set[str]) -> None:
    """Rewrite a Spark result's failing rows ({_row, value} in partition order) as the pandas path has
    them: indices in row order (only with keep_indices), the first few values by row (a null double is
    NaN there, as pandas holds it)."""
    from ballast.data_checks.combine import PARTIAL

    info = res.result or {}
    pairs = info.pop("unexpected_index_list", None)
    for key in ("partial_unexpected_index_list", "unexpected_index_query", "unexpected_index_column_names",
                "unexpected_list", "partial_unexpected_counts"):
        info.pop(key, None)
    if pairs is None:
        return
    column = res.expectation_config.kwargs.get("column")
    pairs = sorted(pairs, key=lambda d: d[ROW])
    nan = float("nan") if column in doubles else None
    info["partial_unexpected_list"] = [nan if d.get(column) is None else d[column] for d in pairs[:PARTIAL]]
    if keep_indices:
        info["unexpected_index_list"] = [int(d[ROW]) for d in pairs]
