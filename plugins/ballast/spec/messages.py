"""Spec problems as one line each: ``FILE:LINE: field.path: what is wrong (got VALUE); fix``.

The field-level wording is the training package's (`training.config.messages`), so the run config and
the spec say the same thing; this module adds the file and the line of the YAML key.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ballast.errors import SpecError
from training.config.messages import describe, one_line


def validation_error(exc: ValidationError, root: type[BaseModel], *, source: str, text: str | None) -> SpecError:
    """A SpecError with one line per pydantic error, each pointing at the nearest line of `text`."""
    lines = line_index(text) if text else {}
    problems = []
    for err in exc.errors():
        loc, msg, value = describe(err, root)
        line = nearest_line(lines, loc)
        problems.append(f"{source}:{line}: {one_line(loc, msg, value)}" if line else
                        f"{source}: {one_line(loc, msg, value)}")
    return SpecError(problems)


def line_index(text: str) -> dict[tuple, int]:
    """Map each key/item path in the YAML document to its 1-based line number."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    index: dict[tuple, int] = {}

    def walk(node: Any, path: tuple) -> None:
        index[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                kpath = path + (key.value,)
                walk(value, kpath)
                index[kpath] = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    if root is not None:
        walk(root, ())
    return index


def nearest_line(index: dict[tuple, int], loc: tuple) -> int | None:
    while loc:
        if loc in index:
            return index[loc]
        loc = loc[:-1]
    return None
