"""Reading a spec file: YAML (safe loader) to the typed model, every problem one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ballast.errors import SpecError
from ballast.spec.messages import validation_error
from ballast.spec.root import Spec

# libyaml's safe loader is ~10x faster than the pure-Python one; same safety (no arbitrary objects).
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_spec(path: str | Path) -> Spec:
    """Read and validate one spec file. Raises SpecError with one line per problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read spec ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        data = yaml.load(text, Loader=_SafeLoader)  # safe: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{where}: invalid YAML: {problem}") from exc
    return parse_spec(data, source=str(path), text=text)


def parse_spec(data: Any, *, source: str = "<spec>", text: str | None = None) -> Spec:
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError(f"{source}: a spec is a YAML mapping of sections (dataset, training, ...); this file is {kind}")
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, Spec, source=source, text=text) from None


def json_schema() -> dict[str, Any]:
    """JSON Schema of the spec, for editors (yaml-language-server) and `ballast schema`."""
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Ballast training pipeline spec"
    return schema
