"""Spec problems as one line each: ``FILE:LINE: field.path: what is wrong (got VALUE); fix``.

The field-level wording is the training package's (`training.config.messages`), so the run config and
the spec say the same thing; this module adds the file and the line of the YAML key.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ballast.errors import SpecError
from ballast.training.config.messages import describe, one_line

MAX_PROBLEMS = 20
"""Problems reported per spec; the rest are counted (a 50,000-item list of wrong types is 50,000 errors)."""


def validation_error(exc: ValidationError, root: type[BaseModel], *, source: str, text: str | None,
                     node: Any = None) -> SpecError:
    """A SpecError with one line per pydantic error (at most MAX_PROBLEMS, then a count), each pointing
    at the nearest line of the YAML document: `node` as composed, else `text`."""
    if node is None and text:
        try:
            node = yaml.compose(text, Loader=_Loader)
        except (yaml.YAMLError, RecursionError):
            node = None
    problems = []
    errors = exc.errors(include_url=False)
    for err in errors[:MAX_PROBLEMS]:
        loc, msg, value = describe(err, root)
        line = nearest_line(node, loc)
        problems.append(f"{source}:{line}: {one_line(loc, msg, value)}" if line else
                        f"{source}: {one_line(loc, msg, value)}")
    if len(errors) > MAX_PROBLEMS:
        problems.append(f"{source}: ... and {len(errors) - MAX_PROBLEMS} more problems")
    return SpecError(problems)


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def nearest_line(root: yaml.Node | None, loc: tuple) -> int | None:
    """The 1-based line of the deepest key or item of `loc` in the composed document `root`, found by
    following `loc` down from the root: never a walk of the whole document, which aliases can make
    endless (a 300-byte YAML alias bomb is 9^9 values deep and wide)."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            # The last of equal keys: the one the loader kept.
            pair = next((p for p in reversed(node.value) if isinstance(p[0], yaml.ScalarNode) and p[0].value == part),
                        None)
            if pair is None:
                break
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
