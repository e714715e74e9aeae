"""Stage 1: check the raw data with Great Expectations before anything trusts it.

Runs the spec's rules, the named suite files, and (by default) schema checks derived from the spec:
every field present with its type, no nulls, array fields of the declared shape, and labels in
[0, num_classes). A failure fails the task without retrying, listing which expectations failed, on
how many rows, with a few bad values.
"""

from __future__ import annotations

import time

from ballast.context import RunContext
from ballast.errors import DataError, SpecError
from ballast.rawdata import check_frame, fingerprint_files, raw_files, read_table
from ballast.spec import RuleSpec


def rules_for(ctx: RunContext) -> list[dict]:
    spec = ctx.spec
    rules: list[dict] = [r.model_dump() for r in spec.validation.rules]
    names = {f.name for f in spec.dataset.fields}
    for suite in spec.validation.suites:
        from pydantic import ValidationError

        import data_checks

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
            rules.append(rule.model_dump())
    if spec.validation.schema_checks:
        for f in spec.dataset.fields:
            rules.append({"kind": "not_null", "column": f.name})
            if f.shape:
                rules.append({"kind": "shape", "column": f.name})
        rules.append({"kind": "between", "column": spec.dataset.label, "min": 0,
                      "max": spec.dataset.num_classes - 1})
    return rules


def run(ctx: RunContext) -> dict:
    import data_checks

    t0 = time.monotonic()
    files = raw_files(ctx)
    table = read_table(files, ctx.spec.dataset)
    frame, arrays = check_frame(table, ctx.spec.dataset)
    rules = rules_for(ctx)
    ctx.log.info("validating %d rows from %d file(s) with %d rules", table.num_rows, len(files), len(rules))
    report = data_checks.run(frame, rules, array_columns=arrays, name=ctx.spec.name)
    result = {
        "rows": table.num_rows,
        "files": [str(p) for p in files],
        "input_fingerprint": fingerprint_files(files),
        "expectations": report.evaluated,
        "failures": [f.line() for f in report.failures],
        "seconds": round(time.monotonic() - t0, 3),
    }
    if not report.success:
        for f in report.failures:
            ctx.log.error("expectation failed: %s", f.line())
        raise DataError(f"dataset.location {ctx.spec.dataset.location}: {report.summary()}")
    ctx.log.info("all %d expectations passed on %d rows", report.evaluated, table.num_rows)
    return result
