"""Validation in bounded batches, with the result one validation of the whole data would give.

Great Expectations evaluates every expectation. Row-level ones (GX's column map expectations: not
null, between, in set, finite, shape, text length) run with GX on each batch; their per-batch counts
are summed, the failing rows' indices are global (each batch's frame is indexed by its rows' global
numbers) and the first few unexpected values are kept. Table-level ones (row count, balance shares,
uniqueness across batches, duplicate share, column existence) are fed streaming aggregates. Either way
the expectation's own `_validate` (the method GX's validator calls with the metrics it computed)
judges the combined metrics, so `mostly` is judged on the totals and the results are GX's, in GX's
format; one suite result is stored and GX renders the Data Docs site from it.

Memory is bounded by one batch plus the aggregates: a counter per balance column (one entry per
distinct value), the failing rows' numbers (8 bytes each; GX's stored result, and so its Data Docs,
keep the first INDICES of them, the Report all), and per `unique` column and text column with a
`duplicate_share` rule a bounded buffer of values (`repeats.Repeats`: past its budget the values go to
hash partitions on disk, each judged on its own at the end).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ballast.data_checks import Report, expectations_for, report_of

PARTIAL = 5  # unexpected values kept per expectation, as the one-shot result keeps
INDICES = 20
"""Failing rows' numbers in GX's stored result (and its Data Docs) per expectation, as GX's partial lists
keep: the Report carries them all (8 bytes a row, for the quarantine), GX's result JSON does not."""


class BatchValidation:
    """Feed `add(frame, offset)` the derived frame of each batch in row order, then `finish()`."""

    def __init__(self, rules: list[dict], *, array_columns: dict[str, int], text_columns: Iterable[str] = (),
                 name: str = "ballast", row_indices: bool = False, context: Any = None,
                 batch_definition: Any = None, spill_dir: Path | None = None) -> None:
        import great_expectations as gx
        from ballast.data_checks import gx_context, pandas_batch_definition

        self.rules = rules
        self.row_indices = row_indices
        self.name = name
        self.result_format = {"result_format": "COMPLETE" if row_indices else "SUMMARY",
                              "partial_unexpected_count": PARTIAL}
        self.context = context or gx_context()
        self.batch_definition = batch_definition or pandas_batch_definition(self.context, name)
        texts = tuple(text_columns)
        # One list for the suite the Data Docs show, one (the same expectations) for the per-batch suite.
        self.suite = self.context.suites.add(gx.ExpectationSuite(name=f"{name}_suite"))
        for exp in expectations_for(rules, array_columns=array_columns, text_columns=texts):
            self.suite.add_expectation(exp)
        self.expectations = list(self.suite.expectations)
        self.row_level = [i for i, e in enumerate(self.expectations) if is_row_level(e)]
        self.row_suite = gx.ExpectationSuite(name=f"{name}_rows")
        batch_exps = expectations_for(rules, array_columns=array_columns, text_columns=texts)
        for i in self.row_level:  # GX may return results in another order: each carries its index
            batch_exps[i].meta = {**(batch_exps[i].meta or {}), "ballast_index": i}
            self.row_suite.add_expectation(batch_exps[i])
        self.rows = 0
        self.columns: list[str] | None = None
        self.meta: dict | None = None
        self.batch_id: str | None = None
        self.partial: dict[int, RowLevel] = {i: RowLevel() for i in self.row_level}
        self.aggregates = Aggregates(self.expectations, self.row_level, texts, spill_dir=spill_dir)

    def add(self, frame: Any, offset: int) -> None:
        """Validate one batch whose first row is global row `offset`."""
        import pandas as pd
        from great_expectations.validator.v1_validator import Validator

        frame = frame.set_axis(pd.RangeIndex(offset, offset + len(frame)), axis=0)
        if self.columns is None:
            self.columns = list(frame.columns)
        if self.row_level or self.meta is None:  # the first batch also gives the result's batch metadata
            validator = Validator(batch_definition=self.batch_definition, batch_parameters={"dataframe": frame},
                                  result_format=self.result_format)
            suite_result = validator.validate_expectation_suite(self.row_suite)
            if self.meta is None:
                self.meta, self.batch_id = dict(suite_result.meta), suite_result.batch_id
            for res in suite_result.results:
                self.partial[int(res.expectation_config.meta["ballast_index"])].add(res)
        self.aggregates.add(frame)
        self.rows += len(frame)

    def close(self) -> None:
        """Remove what the aggregates spilled to disk (`finish` does; for a validation that stops early)."""
        for agg in [*self.aggregates.unique.values(), *self.aggregates.duplicates.values()]:
            agg.repeats.close()

    def finish(self) -> Report:
        """The combined result of every expectation, stored with GX and rendered into Data Docs."""
        from great_expectations.core.expectation_validation_result import (
            ExpectationSuiteValidationResult,
            ExpectationValidationResult,
        )
        from great_expectations.validator.validator import calc_validation_statistics

        results = []
        runtime = {"result_format": dict(self.result_format)}
        for i, exp in enumerate(self.expectations):
            if i in self.partial and self.partial[i].exception is not None:
                failed = self.partial[i].exception
                results.append(ExpectationValidationResult(success=False, expectation_config=exp.configuration,
                                                           result={}, exception_info=failed.exception_info))
                continue
            metrics = (self.partial[i].metrics(exp) if i in self.partial
                       else self.aggregates.metrics(i, exp, rows=self.rows, columns=self.columns or []))
            out = exp._validate(metrics, runtime_configuration=runtime)
            results.append(ExpectationValidationResult(success=bool(out["success"]),
                                                       expectation_config=exp.configuration,
                                                       result=out.get("result", {})))
        stats = calc_validation_statistics(results)
        suite_result = ExpectationSuiteValidationResult(
            results=results, success=stats.success, suite_name=self.suite.name,
            statistics={"evaluated_expectations": stats.evaluated_expectations,
                        "successful_expectations": stats.successful_expectations,
                        "unsuccessful_expectations": stats.unsuccessful_expectations,
                        "success_percent": stats.success_percent},
            meta=dict(self.meta or {}), batch_id=self.batch_id)
        docs = publish(self.context, self.suite, suite_result, self.batch_id)
        report = report_of(suite_result, rows=self.rows, docs_dir=docs)
        # Every failing row's number, where GX's result keeps the first INDICES.
        failed = [i for i, res in enumerate(results) if not res.success]
        for failure, i in zip(report.failures, failed, strict=True):
            if failure.rows is not None:
                failure.rows = self.partial[i].rows() if i in self.partial else \
                    self.aggregates.unique[self.expectations[i].column].rows
        return report


def is_row_level(exp: Any) -> bool:
    """Judged row by row (so per batch, then summed): GX's column map expectations, but uniqueness,
    which holds only across all rows."""
    import great_expectations.expectations as gxe
    from great_expectations.expectations.expectation import ColumnMapExpectation

    return isinstance(exp, ColumnMapExpectation) and not isinstance(exp, gxe.ExpectColumnValuesToBeUnique)


class RowLevel:
    """One row-level expectation's per-batch results, summed."""

    def __init__(self) -> None:
        self.element = 0
        self.missing: int | None = 0
        self.unexpected = 0
        self.values: list[Any] = []
        self.indices = array("q")  # every failing row's number, 8 bytes each
        self.exception: Any = None

    def add(self, res: Any) -> None:
        if res.exception_info and res.exception_info.get("raised_exception"):
            self.exception = self.exception or res
            return
        info = res.result or {}
        self.element += int(info.get("element_count") or 0)
        if "missing_count" in info and self.missing is not None:
            self.missing += int(info["missing_count"] or 0)
        else:
            self.missing = None
        self.unexpected += int(info.get("unexpected_count") or 0)
        if len(self.values) < PARTIAL:
            self.values.extend(list(info.get("partial_unexpected_list") or [])[:PARTIAL - len(self.values)])
        self.indices.extend(int(i) for i in info.get("unexpected_index_list") or ())

    def rows(self) -> Any:
        import numpy as np

        return np.frombuffer(self.indices, dtype=np.int64) if self.indices else np.zeros(0, np.int64)

    def metrics(self, exp: Any) -> dict:
        m = exp.map_metric
        out = {"table.row_count": self.element, f"{m}.unexpected_count": self.unexpected,
               f"{m}.unexpected_values": list(self.values),
               f"{m}.unexpected_index_list": self.indices[:INDICES].tolist()}
        if self.missing is not None:
            out["column_values.nonnull.unexpected_count"] = self.missing
        return out


class Aggregates:
    """What the table-level expectations need, accumulated batch by batch."""

    def __init__(self, expectations: list[Any], row_level: list[int], texts: Iterable[str] = (),
                 spill_dir: Path | None = None) -> None:
        import great_expectations.expectations as gxe

        self.counts: dict[str, Counter] = {}      # balance: value -> rows, per column
        self.unique: dict[str, Unique] = {}
        self.duplicates: dict[str, Duplicates] = {}  # <text>__dup -> its repeats
        self.means: dict[str, list[float]] = {}   # column -> [sum, rows]
        dup_columns = {f"{t}__dup": t for t in texts}
        for i, e in enumerate(expectations):
            if i in row_level:
                continue
            col = getattr(e, "column", None)
            if isinstance(e, gxe.ExpectColumnValuesToBeUnique):
                self.unique[col] = Unique(spill_dir)
            elif isinstance(e, (gxe.ExpectColumnMinToBeBetween, gxe.ExpectColumnMaxToBeBetween)) and \
                    col.endswith("__share"):
                self.counts[col[:-len("__share")]] = Counter()
            elif isinstance(e, gxe.ExpectColumnMeanToBeBetween) and col in dup_columns:
                self.duplicates[col] = Duplicates(dup_columns[col], spill_dir)
            elif isinstance(e, gxe.ExpectColumnMeanToBeBetween):
                self.means[col] = [0.0, 0]

    def add(self, frame: Any) -> None:
        for col, counter in self.counts.items():
            if col in frame:
                counter.update(frame[col].value_counts(dropna=True).to_dict())
        for col, u in self.unique.items():
            if col in frame:
                u.add(frame[col])
        for dup in self.duplicates.values():
            dup.add(frame)
        for col, acc in self.means.items():
            if col in frame:
                s = frame[col].dropna()
                acc[0] += float(s.sum())
                acc[1] += len(s)

    def shares(self, col: str) -> list[float]:
        counter = self.counts[col]
        total = sum(counter.values())
        return [n / total for n in counter.values()] if total else []

    def metrics(self, i: int, exp: Any, *, rows: int, columns: list[str]) -> dict:
        import great_expectations.expectations as gxe

        col = getattr(exp, "column", None)
        if isinstance(exp, gxe.ExpectTableRowCountToBeBetween):
            return {"table.row_count": rows}
        if isinstance(exp, gxe.ExpectColumnToExist):
            return {"table.columns": columns}
        if isinstance(exp, gxe.ExpectColumnValuesToBeUnique):
            return self.unique[col].metrics(exp, rows)
        if isinstance(exp, gxe.ExpectColumnMeanToBeBetween) and col in self.duplicates:
            return {"column.mean": self.duplicates[col].mean(rows)}
        if isinstance(exp, gxe.ExpectColumnMeanToBeBetween):
            total, n = self.means[col]
            return {"column.mean": total / n if n else None}
        if isinstance(exp, (gxe.ExpectColumnMinToBeBetween, gxe.ExpectColumnMaxToBeBetween)):
            shares = self.shares(col[:-len("__share")])
            pick = min if isinstance(exp, gxe.ExpectColumnMinToBeBetween) else max
            return {"column.min" if pick is min else "column.max": pick(shares) if shares else None}
        raise ValueError(f"no streaming aggregate for {exp.expectation_type} on {col!r}")


class Unique:
    """The rows whose value occurs more than once across every batch (`repeats.Repeats`, in bounded
    memory): every occurrence fails, the first one too, as GX marks them."""

    def __init__(self, spill_dir: Path | None = None) -> None:
        from ballast.data_checks.repeats import Repeats

        self.repeats = Repeats(("value",), rows=True, examples=PARTIAL, directory=spill_dir)
        self.nulls = 0
        self.rows: Any = None  # the failing rows' numbers, once judged

    def add(self, column: Any) -> None:
        import numpy as np
        import pandas as pd

        values = column.dropna()
        self.nulls += len(column) - len(values)
        self.repeats.add(pd.DataFrame({"value": values.to_numpy(), "_row": values.index.to_numpy(dtype=np.int64)}))

    def metrics(self, exp: Any, rows: int) -> dict:
        m = exp.map_metric
        found = self.repeats.finish()
        self.rows = found.rows
        return {"table.row_count": rows, "column_values.nonnull.unexpected_count": self.nulls,
                f"{m}.unexpected_count": len(found.rows), f"{m}.unexpected_values": found.examples,
                f"{m}.unexpected_index_list": found.rows[:INDICES].tolist()}


class Duplicates:
    """A text column's rows that repeat an earlier row's document, counted from the documents' 128-bit
    digests (`<col>__digest_hi`, `__digest_lo`) in bounded memory: `duplicate_share`'s mean of `<col>__dup`."""

    def __init__(self, text: str, spill_dir: Path | None = None) -> None:
        from ballast.data_checks.repeats import Repeats

        self.hi, self.lo = f"{text}__digest_hi", f"{text}__digest_lo"
        self.repeats = Repeats((self.hi, self.lo), rows=False, directory=spill_dir)

    def add(self, frame: Any) -> None:
        import numpy as np
        import pandas as pd

        if self.hi not in frame:
            return
        keep = frame[self.hi].notna().to_numpy()
        rows = frame.index.to_numpy(dtype=np.int64)[keep]
        self.repeats.add(pd.DataFrame({k: frame[k].to_numpy(dtype=np.uint64, na_value=0)[keep]
                                       for k in (self.hi, self.lo)} | {"_row": rows}))

    def mean(self, rows: int) -> float | None:
        return self.repeats.finish().repeats / rows if rows else None


def publish(context: Any, suite: Any, result: Any, batch_id: str | None) -> Any:
    """Store the combined suite result and have GX build its Data Docs; returns the site's folder."""
    import datetime

    from ballast.data_checks import docs_dir
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.data_context.types.resource_identifiers import (
        ExpectationSuiteIdentifier,
        ValidationResultIdentifier,
    )

    run_id = RunIdentifier(run_time=datetime.datetime.now(datetime.UTC))
    result.meta.update({"run_id": run_id, "validation_time": run_id.run_time})
    suite_id = ExpectationSuiteIdentifier(name=suite.name)
    result_id = ValidationResultIdentifier(expectation_suite_identifier=suite_id, run_id=run_id,
                                           batch_identifier=batch_id or "combined")
    context.validation_results_store.set(result_id, result)
    context.build_data_docs(resource_identifiers=[result_id, suite_id])
    return docs_dir(context)
