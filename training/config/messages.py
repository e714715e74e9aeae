"""One line per validation problem: `field.path: what is wrong (got VALUE)`.

Shared by the run config (training processes) and the spec (`ballast lint`, DAG import errors, trigger
parameters), so that both say the same thing the same way. pydantic only.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from pydantic import BaseModel

NOVALUE = object()
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
_SIMPLE = {
    "int_parsing": "must be an integer", "int_type": "must be an integer", "int_from_float": "must be an integer",
    "float_parsing": "must be a number", "float_type": "must be a number", "string_type": "must be a string",
    "bool_parsing": "must be true or false", "bool_type": "must be true or false",
    "model_type": "must be a mapping of keys", "model_attributes_type": "must be a mapping of keys",
    "dict_type": "must be a mapping of keys", "tuple_type": "must be a list", "list_type": "must be a list",
    "too_short": "must not be empty", "string_too_short": "must not be empty",
    "finite_number": "must be a finite number",
}
# pydantic puts a union member's type name into the location; it is no field of the user's.
_UNION_MEMBERS = {"str", "int", "float", "bool"}


def describe(err: dict[str, Any], root: type[BaseModel]) -> tuple[tuple, str, Any]:
    """(field location, message, the bad value or NOVALUE) for one pydantic error of a `root` model."""
    loc = _field_location(tuple(err["loc"]), root)
    kind, ctx, value, msg = err["type"], err.get("ctx") or {}, err.get("input"), err["msg"]
    if kind == "value_error":
        msg = str(ctx.get("error", msg))
        # A model-level check may name a sub-field: "label: 'x' is not ..." -> loc + label.
        head, sep, rest = msg.partition(": ")
        if sep and re.fullmatch(r"[a-z_][a-z0-9_.\[\]]*", head):
            for part in head.split("."):
                name, _, index = part.partition("[")
                loc = loc + ((name, int(index.rstrip("]"))) if index else (name,))
            msg = rest
        value = NOVALUE
    elif kind == "extra_forbidden":
        msg = f"unknown key {short(loc[-1])}"
        allowed = allowed_keys(root, loc[:-1])
        if allowed:
            msg += f"; allowed here: {', '.join(allowed)}"
        value = NOVALUE
    elif kind == "missing":
        msg, value = "required field is missing", NOVALUE
    elif kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        if isinstance(bound, float) and bound.is_integer() and abs(bound) < 2**53:
            bound = int(bound)  # a float field's bound: 65535, not 65535.0
        msg = f"must be {_BOUNDS[kind]} {bound}"
    elif kind == "literal_error" and loc and loc[-1] == "[key]":  # a mapping's key, e.g. a failure class
        loc = loc[:-1]
        msg = f"unknown key {short(value)}; must be one of {ctx.get('expected')}"
        value = NOVALUE
    elif kind == "literal_error":
        msg = f"must be one of {ctx.get('expected')}"
    elif kind == "string_pattern_mismatch":
        msg = f"must match {ctx.get('pattern')}"
    elif kind in _SIMPLE:
        msg = _SIMPLE[kind]
    else:
        msg = msg[0].lower() + msg[1:] if msg else kind
    return loc, msg, value


def _field_location(loc: tuple, root: type[BaseModel]) -> tuple:
    """`loc` without the tags pydantic adds for the member of a union it tried (`int`, `str`, a model's
    class name): walking the models, a part that is no field there but names a member is dropped."""
    out: list = []
    model: Any = root
    members: set[str] = set()  # the class names of the union the last field holds
    for part in loc:
        fields = getattr(model, "model_fields", None) or {}
        if isinstance(part, str) and part not in fields and (part in _UNION_MEMBERS or part in members):
            continue
        out.append(part)
        if isinstance(part, str) and part in fields:
            ann = fields[part].annotation
            members = {a.__name__ for a in getattr(ann, "__args__", ()) if isinstance(a, type)}
            model = _nested(ann)
    return tuple(out)


def _nested(ann: Any) -> Any:
    """The model class a field holds (directly, in a union or in a tuple), or None."""
    for a in (ann, *getattr(ann, "__args__", ())):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def short(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters. Written piece by piece and stopped at the limit: a value
    from a spec can be huge, or a YAML alias bomb's 9^9 shared lists, whose whole repr never ends."""
    text, size = [], 0
    for piece in _repr_pieces(value, limit + 1, 0):
        text.append(piece)
        size += len(piece)
        if size > limit:
            break
    out = "".join(text)
    return out if len(out) <= limit else out[:limit - 3] + "..."


_BRACKETS = {list: "[]", tuple: "()", set: "{}", frozenset: "{}", dict: "{}"}


def _repr_pieces(value: Any, budget: int, depth: int) -> Iterator[str]:
    """The pieces of `repr(value)` in order, lazily (containers item by item), each at most ~`budget` long."""
    kind = next((k for k in _BRACKETS if isinstance(value, k)), None)
    if kind is None:
        if isinstance(value, str) and len(value) > budget:
            yield repr(value[:budget])[:-1]  # the closing quote: never shown, the text is cut before it
            return
        try:
            text = repr(value)
        except ValueError:  # an integer past Python's limit of digits in a str
            text = f"<{value.bit_length()}-bit integer>" if isinstance(value, int) else f"<{type(value).__name__}>"
        yield text[:budget]
        return
    opening, closing = _BRACKETS[kind]
    if depth >= 20:  # deep enough to be cut anyway; no recursion limit for a deeply nested value
        yield opening + "..."
        return
    yield opening
    for i, item in enumerate(value.items() if kind is dict else value):
        if i:
            yield ", "
        if kind is dict:
            yield from _repr_pieces(item[0], budget, depth + 1)
            yield ": "
            item = item[1]
        yield from _repr_pieces(item, budget, depth + 1)
    yield ("," if kind is tuple and len(value) == 1 else "") + closing


MAX_MESSAGE = 400
"""A message longer than this is cut: a validator may quote a value, and values can be huge."""


def one_line(loc: tuple, msg: str, value: Any) -> str:
    """`field.path: message (got VALUE)`."""
    got = "" if value is NOVALUE else f" (got {short(value)})"
    msg = " ".join(msg.split()) if "\n" in msg else msg
    if len(msg) > MAX_MESSAGE:
        msg = msg[:MAX_MESSAGE - 3] + "..."
    path = dotted(loc) or "(top level)"
    if len(path) > MAX_MESSAGE:  # a key of the user's own making can be long too
        path = path[:MAX_MESSAGE - 3] + "..."
    return f"{path}: {msg}{got}"


def allowed_keys(root: type[BaseModel], loc: tuple) -> list[str]:
    """The keys the model at `loc` (below `root`) accepts, in declaration order."""
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        nested = [a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            return []
        model = nested[0]
    return list(getattr(model, "model_fields", {}))
