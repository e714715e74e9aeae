"""The spec's `validation` section: the rules run with Great Expectations before anything else."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ballast.training.config.sections import Section

RuleKind = Literal["not_null", "between", "in_set", "row_count", "unique", "finite", "shape", "balance",
                   "text_length", "duplicate_share"]
TEXT_RULES = ("text_length", "duplicate_share")


class RuleSpec(Section):
    kind: RuleKind
    """What to check: not_null, between (min/max), in_set (values), row_count (min/max), unique,
    finite (no NaN/Inf in a numeric or array column), shape (array length matches the schema),
    balance (every value's share of the rows within min/max, e.g. class balance of the label); for text
    columns: text_length (each value's length in characters within min/max; `min: 1` refuses empty
    documents), duplicate_share (the share of rows repeating an earlier row's value at most max)."""
    column: str | None = None
    """The column checked; not used by row_count. `field:` is read as the same."""
    min: float | None = None
    """Lower bound (between, row_count, balance, text_length)."""
    max: float | None = None
    """Upper bound (between, row_count, balance, text_length, duplicate_share)."""
    values: tuple[int | float | str | bool, ...] | None = None
    """Allowed values (in_set)."""
    mostly: float = Field(1.0, gt=0.0, le=1.0)
    """Fraction of rows that must pass."""

    @model_validator(mode="before")
    @classmethod
    def _field_is_column(cls, data: Any) -> Any:
        """`field:` names the column too (text rules read naturally with it)."""
        if isinstance(data, dict) and "field" in data:
            if "column" in data:
                raise ValueError("give `column` or `field`, not both (they name the same)")
            data = {("column" if k == "field" else k): v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _check_kind(self) -> RuleSpec:
        if self.kind == "row_count":
            if self.column is not None:
                raise ValueError("column: row_count checks the whole table; remove column")
        elif self.column is None:
            raise ValueError(f"column: rule {self.kind!r} needs a column")
        if self.kind in ("between", "row_count", "balance", "text_length") and self.min is None and self.max is None:
            raise ValueError(f"rule {self.kind!r} needs min, max or both")
        if self.kind == "duplicate_share" and (self.max is None or self.min is not None or not 0 <= self.max <= 1):
            raise ValueError("rule 'duplicate_share' needs max, a share between 0 and 1 (and no min)")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is greater than max ({self.max})")
        if self.kind == "in_set" and not self.values:
            raise ValueError("values: rule 'in_set' needs a non-empty list of values")
        return self


class ValidationSpec(Section):
    rules: tuple[RuleSpec, ...] = ()
    """Checks declared in the spec, run with Great Expectations before anything else."""
    suites: tuple[str, ...] = ()
    """Names of suite files under data_checks/suites/ (without .yaml) to run as well."""
    schema_checks: bool = True
    """Also check that every schema field exists, is not null and has its declared shape."""
    on_failure: Literal["fail", "quarantine"] = "fail"
    """`fail`: any failed expectation fails the run (no retry). `quarantine`: rows failing a row-level
    expectation go to a quarantine file and the good rows go on, unless more than
    `max_bad_fraction` of the rows are bad; table-level expectations (row_count) still fail the run."""
    max_bad_fraction: float = Field(0.01, ge=0.0, lt=1.0)
    """With `on_failure: quarantine`: the largest fraction of rows that may be set aside."""

