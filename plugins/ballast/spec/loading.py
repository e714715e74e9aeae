"""Reading a spec file: YAML (safe loader) to the typed model, every problem one line.

Reading is bounded, since the DAG processor, `ballast lint` and the stability view's catalogue all read
every spec: at most MAX_SPEC_BYTES of text, and YAML aliases that expand to at most MAX_ALIAS_VALUES
values (a 300-byte "bomb" of nine nested lists is 9^9 values to whatever walks it); libyaml itself
refuses nesting past 1000 levels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ballast.errors import SpecError
from ballast.spec.messages import nearest_line, validation_error
from ballast.spec.root import Spec

# libyaml's safe loader is ~10x faster than the pure-Python one; same safety (no arbitrary objects).
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

MAX_SPEC_BYTES = 1 << 20
"""A spec is a page or two of YAML (the example is 3 KB); 1 MiB leaves room for long value lists."""
MAX_ALIAS_VALUES = 10_000
"""Values YAML aliases may add by repeating their anchors' contents (`<<: *defaults` adds a few dozen)."""


def load_spec(path: str | Path) -> Spec:
    """Read and validate one spec file. Raises SpecError with one line per problem."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
        text = raw.decode("utf-8")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read spec ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        if len(raw) <= MAX_SPEC_BYTES or exc.start < MAX_SPEC_BYTES - 4:  # not just a character cut at the limit
            raise SpecError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        text = ""
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: more than {MAX_SPEC_BYTES // 1024} KiB of YAML; a spec is at most that long"
                        f" (long lists of values belong in a suite under data_checks/suites/)")
    node, data = _read_yaml(text, path)
    return parse_spec(data, source=str(path), text=text, node=node)


def _read_yaml(text: str, path: Path) -> tuple[Any, Any]:
    """(the composed root node, the decoded document), the aliases checked in between."""
    loader = _SafeLoader(text)  # safe: no arbitrary objects
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        if "&" in text:  # no anchor, no alias: the check costs normal specs nothing
            _check_aliases(node, path)
        return node, loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{where}: invalid YAML: {problem}") from exc
    except RecursionError as exc:  # the pure-Python composer, where libyaml is missing, recurses per level
        raise SpecError(f"{path}: invalid YAML: nested too deeply") from exc
    finally:
        loader.dispose()


def _check_aliases(root: yaml.Node, path: Path) -> None:
    """Refuse a document whose aliases repeat more than MAX_ALIAS_VALUES values, or one that holds
    itself, naming the line of the collection where the limit was crossed. One pass over the distinct
    nodes (iterative: YAML nests deeper than Python recurses): each one's expanded size is counted once."""
    size: dict[int, int] = {}  # id(node) -> values it stands for, its aliases expanded
    claimed: set[int] = set()  # nodes reached once; each further reach is an alias repeating them
    repeated = 0
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        children = _children(node)
        if done:
            open_.discard(id(node))
            size[id(node)] = 1 + sum(size[id(c)] for c in children)
            for child in children:
                if id(child) in claimed:
                    repeated += size[id(child)]
                claimed.add(id(child))
            if repeated > MAX_ALIAS_VALUES:
                raise SpecError(f"{path}:{node.start_mark.line + 1}: YAML aliases here repeat more than"
                                f" {MAX_ALIAS_VALUES} values; a spec needs no more: write the values out")
            continue
        if id(node) in size:
            continue
        open_.add(id(node))
        stack.append((node, True))
        for child in children:
            if id(child) in open_:
                raise SpecError(f"{path}:{node.start_mark.line + 1}: invalid YAML: an alias inside its own anchor"
                                f" (a value that contains itself); write the value out")
            if id(child) not in size:
                stack.append((child, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return node.value
    return []


def parse_spec(data: Any, *, source: str = "<spec>", text: str | None = None, node: Any = None) -> Spec:
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError(f"{source}: a spec is a YAML mapping of sections (dataset, training, ...); this file is {kind}")
    try:
        return Spec.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, Spec, source=source, text=text, node=node) from None


def json_schema() -> dict[str, Any]:
    """JSON Schema of the spec, for editors (yaml-language-server) and `ballast schema`."""
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Ballast training pipeline spec"
    return schema


def check_model_options(spec: Spec, *, source: str = "<spec>", text: str | None = None) -> None:
    """The spec's `training.model.options` against its model's options_schema: a SpecError with one line
    per problem naming `training.model.options.<path>` (and the YAML line where there is text). Loads the
    model's factory, so its package's module is imported: `ballast lint` and the validate stage run it,
    never DAG parsing."""
    from ballast.training.failure import ConfigFailure
    from ballast.training.models import registry

    model = spec.training.model
    try:
        factory = registry.load_factory(model.name)
    except ConfigFailure as exc:
        raise SpecError(f"{source}: {exc}") from exc
    errors = registry.schema_errors(factory, spec.training.model_options)
    if not errors:
        return
    node = None
    if text:
        try:
            node = yaml.compose(text, Loader=_SafeLoader)
        except yaml.YAMLError:
            node = None
    lines = []
    for loc, msg in errors:
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        line = nearest_line(node, ("training", "model", "options", *loc))
        lines.append(f"{source}:{line}: training.model.options{field}: {msg}" if line else
                     f"{source}: training.model.options{field}: {msg}")
    raise SpecError(lines)


def lint_spec(path: str | Path) -> Spec:
    """`load_spec`, then what parsing leaves out because it imports a model's package: its options."""
    spec = load_spec(path)
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    check_model_options(spec, source=str(path), text=text)
    return spec
