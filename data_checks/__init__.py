"""Data validation: declarative rules run with Great Expectations 1.x, called directly.

Rules (from a spec's `validation.rules` or a suite file under data_checks/suites/) are plain
mappings: `{kind, column, min, max, values, mostly}`. `balance` checks each value's share of the
rows (`<col>__share`), e.g. that no class of the label is rarer than `min`. Array columns (images, embeddings) are checked
through derived columns computed once with numpy: `<col>__len`, `<col>__min`, `<col>__max` and
`<col>__finite`, so GX never iterates Python objects row by row. Text columns (a language model's
documents) likewise: `<col>__len` (characters; null for a null value) and `<col>__dup` (the row repeats
an earlier row's text), which `text_length` (row-level) and `duplicate_share` (table-level: the mean of
`__dup`) check; the documents themselves never reach GX. Validated in batches, `__dup`'s mean is counted
at the end from each document's 128-bit digest (`combine.Duplicates`), in bounded memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUITES_DIR = Path(__file__).parent / "suites"


@dataclass
class Failure:
    expectation: str
    column: str | None
    detail: str
    unexpected_count: int | None = None
    examples: list[Any] = field(default_factory=list)
    rows: Any = None  # the failing rows' numbers (row-level expectations, complete results): a list or int64 array

    def line(self) -> str:
        where = f" on {self.column}" if self.column else ""
        count = f", {self.unexpected_count} rows" if self.unexpected_count is not None else ""
        ex = f", e.g. {self.examples[:5]}" if self.examples else ""
        return f"{self.expectation}{where}: {self.detail}{count}{ex}"


@dataclass
class Report:
    success: bool
    evaluated: int
    failures: list[Failure]
    rows: int
    docs_dir: Path | None = None  # GX's Data Docs site for this validation (HTML)

    def summary(self) -> str:
        head = f"{len(self.failures)} of {self.evaluated} expectations failed on {self.rows} rows"
        return "; ".join([head, *(f.line() for f in self.failures)])


def expectations_for(rules: Iterable[dict], *, array_columns: dict[str, int],
                     text_columns: Iterable[str] = ()) -> list[Any]:
    """Translate rules into GX expectation objects. `array_columns` maps an array column to its length;
    `text_columns` are checked through their derived columns."""
    import great_expectations.expectations as gxe

    texts = set(text_columns)
    out: list[Any] = []
    for r in rules:
        kind, col, mostly = r["kind"], r.get("column"), r.get("mostly", 1.0)
        is_array = col in array_columns or col in texts
        if kind in ("text_length", "duplicate_share") and col not in texts:
            raise ValueError(f"rule {kind!r} needs the text column (dataset.text); {col!r} is not it")
        if kind == "row_count":
            out.append(gxe.ExpectTableRowCountToBeBetween(min_value=r.get("min"), max_value=r.get("max")))
        elif kind == "not_null":
            out.append(gxe.ExpectColumnValuesToNotBeNull(column=f"{col}__len" if is_array else col, mostly=mostly))
        elif kind == "between":
            if is_array:
                if r.get("min") is not None:
                    out.append(gxe.ExpectColumnValuesToBeBetween(column=f"{col}__min", min_value=r["min"], mostly=mostly))
                if r.get("max") is not None:
                    out.append(gxe.ExpectColumnValuesToBeBetween(column=f"{col}__max", max_value=r["max"], mostly=mostly))
            else:
                out.append(gxe.ExpectColumnValuesToBeBetween(column=col, min_value=r.get("min"),
                                                              max_value=r.get("max"), mostly=mostly))
        elif kind == "in_set":
            out.append(gxe.ExpectColumnValuesToBeInSet(column=col, value_set=list(r["values"]), mostly=mostly))
        elif kind == "unique":
            out.append(gxe.ExpectColumnValuesToBeUnique(column=col, mostly=mostly))
        elif kind == "finite":
            out.append(gxe.ExpectColumnValuesToBeInSet(column=f"{col}__finite", value_set=[True], mostly=mostly))
        elif kind == "shape":
            if col not in array_columns:
                raise ValueError(f"rule 'shape' needs an array column; {col!r} is a scalar")
            out.append(gxe.ExpectColumnValuesToBeInSet(column=f"{col}__len", value_set=[array_columns[col]],
                                                       mostly=mostly))
        elif kind == "balance":
            # Shares are per value, so this is a table-level check: the rarest and the commonest value.
            if r.get("min") is not None:
                out.append(gxe.ExpectColumnMinToBeBetween(column=f"{col}__share", min_value=r["min"]))
            if r.get("max") is not None:
                out.append(gxe.ExpectColumnMaxToBeBetween(column=f"{col}__share", max_value=r["max"]))
        elif kind == "text_length":
            out.append(gxe.ExpectColumnValuesToBeBetween(column=f"{col}__len", min_value=r.get("min"),
                                                         max_value=r.get("max"), mostly=mostly))
        elif kind == "duplicate_share":
            out.append(gxe.ExpectColumnMeanToBeBetween(column=f"{col}__dup", min_value=0, max_value=r["max"]))
        elif kind == "exists":
            out.append(gxe.ExpectColumnToExist(column=f"{col}__len" if is_array else col))
        else:
            raise ValueError(f"unknown rule kind {kind!r}")
    return out


def gx_context() -> Any:
    """An ephemeral GX context, quiet: no analytics, no progress bars in task logs."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")  # no network here; no phoning home anyway
    os.environ.setdefault("TQDM_DISABLE", "1")              # progress bars clutter task logs
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    # Progress bars clutter task logs; TQDM_DISABLE alone is missed when tqdm was imported earlier.
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    return context


def pandas_batch_definition(context: Any, name: str) -> Any:
    source = context.data_sources.add_pandas(name=f"{name}_source")
    asset = source.add_dataframe_asset(name=f"{name}_frame")
    return asset.add_batch_definition_whole_dataframe(f"{name}_batch")


def run(frame: Any, rules: list[dict], *, array_columns: dict[str, int], name: str = "ballast",
        row_indices: bool = False, text_columns: Iterable[str] = ()) -> Report:
    """Validate a whole pandas DataFrame (with derived array columns) at once; never raises on bad data.

    The one-shot path, for data that fits in memory (ballast.data_checks.combine validates in batches
    and gives this result). Runs a GX Checkpoint whose UpdateDataDocsAction renders the Data Docs site
    (Report.docs_dir). With row_indices, failures of row-level expectations carry every failing row's index.
    """
    import great_expectations as gx

    for r in rules:
        col = r.get("column")
        if r["kind"] == "balance" and f"{col}__share" not in frame:
            frame = frame.assign(**{f"{col}__share": frame[col].map(frame[col].value_counts(normalize=True))})
    context = gx_context()
    batch_def = pandas_batch_definition(context, name)
    suite = context.suites.add(gx.ExpectationSuite(name=f"{name}_suite"))
    for exp in expectations_for(rules, array_columns=array_columns, text_columns=text_columns):
        suite.add_expectation(exp)
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(data=batch_def, suite=suite, name=f"{name}_validation"))
    result_format = {"result_format": "COMPLETE" if row_indices else "SUMMARY", "partial_unexpected_count": 5}
    checkpoint = context.checkpoints.add(gx.Checkpoint(
        name=f"{name}_checkpoint", validation_definitions=[definition],
        actions=[gx.checkpoint.UpdateDataDocsAction(name="data_docs")], result_format=result_format))
    run_result = checkpoint.run(batch_parameters={"dataframe": frame})
    (result,) = run_result.run_results.values()
    return report_of(result, rows=len(frame), docs_dir=docs_dir(context))


def report_of(result: Any, *, rows: int, docs_dir: Path | None) -> Report:
    """A Report from GX's suite validation result: each failed expectation with its count and examples."""
    failures = []
    for res in result.results:
        if res.success:
            continue
        cfg = res.expectation_config
        kwargs = dict(cfg.kwargs)
        info = res.result or {}
        if res.exception_info and res.exception_info.get("raised_exception"):
            detail = f"could not run: {res.exception_info.get('exception_message')}"
        elif "observed_value" in info and info.get("unexpected_count") is None:
            detail = f"observed {info['observed_value']}, expected {_bounds(kwargs)}"
        else:
            detail = f"expected {_bounds(kwargs)}"
        indices = info.get("unexpected_index_list")
        failures.append(Failure(expectation=cfg.type, column=kwargs.get("column"), detail=detail,
                                unexpected_count=info.get("unexpected_count"),
                                examples=list(info.get("partial_unexpected_list") or [])[:5],
                                rows=[int(i) for i in indices] if indices is not None else None))
    return Report(success=bool(result.success), evaluated=len(result.results), failures=failures, rows=rows,
                  docs_dir=docs_dir)


def docs_dir(context: Any) -> Path | None:
    """The local folder of the context's Data Docs site, if it has one."""
    docs = None
    for site in context.get_docs_sites_urls():
        url = site.get("site_url") or ""
        if url.startswith("file://"):
            docs = Path(url[len("file://"):]).parent
    return docs


def _bounds(kwargs: dict) -> str:
    if "value_set" in kwargs:
        vs = list(kwargs["value_set"])
        return f"values in {vs if len(vs) <= 12 else vs[:12] + ['...']}"
    lo, hi = kwargs.get("min_value"), kwargs.get("max_value")
    if lo is not None or hi is not None:
        return f"between {lo} and {hi}"
    if kwargs.get("mostly", 1.0) < 1.0:
        return f"at least {kwargs['mostly']:.0%} of rows passing"
    return "every row passing"


def load_suite(name: str) -> tuple[Path, Any]:
    """Read data_checks/suites/<name>.yaml (a mapping with a `rules:` list); returns (path, data)."""
    import yaml

    if not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"suite name {name!r} may hold only letters, digits, '_' and '-'")
    path = SUITES_DIR / f"{name}.yaml"
    try:
        return path, yaml.safe_load(path.read_text())
    except FileNotFoundError:
        known = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))
        raise ValueError(f"{path}: no such suite; known: {', '.join(known) or 'none'}") from None
