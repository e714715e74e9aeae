"""The docstring under each field of a settings class, as its description; read once per source file.

pydantic's own `use_attribute_docstrings` finds a class's source by walking the interpreter's frames
and asking `inspect.getmodule` of each, which scans `sys.modules` (thousands of modules once Airflow
is imported): about 4 ms per class, most of the spec's DAG-parse cost. Here each module's source is
parsed once with `ast`, and the classes are found by name.
"""

from __future__ import annotations

import ast
import functools
import sys
from typing import Any


@functools.cache
def _module_docstrings(path: str) -> dict[str, dict[str, str]]:
    """{class qualname: {attribute: docstring}} for every class in the file at `path`."""
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError):
        return {}
    out: dict[str, dict[str, str]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if not isinstance(node, ast.ClassDef):
                continue
            name = f"{prefix}{node.name}"
            docs: dict[str, str] = {}
            for stmt, nxt in zip(node.body, node.body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    docs[stmt.target.id] = _clean(nxt.value.value)
            out[name] = docs
            visit(node.body, f"{name}.")

    visit(tree.body, "")
    return out


def _clean(text: str) -> str:
    import inspect

    return inspect.cleandoc(text)


def apply(cls: Any) -> None:
    """Set each field's description from the docstring under it, where none was given."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if not path:
        return
    docs = _module_docstrings(path).get(cls.__qualname__, {})
    for name, field in cls.__pydantic_fields__.items():
        if field.description is None and name in docs:
            field.description = docs[name]
