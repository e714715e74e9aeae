"""The `ballast.models` entry-point group: models from installed packages, by name.

A package registers `name = "package.module:factory"` under `[project.entry-points."ballast.models"]`;
the spec's `training.model.name` names the entry point, never an import path. `factory(options, data)`
returns a `torch.nn.Module` (`options`: the spec's `training.model.options`; `data`: what the task feeds
it, see `ballast.training.config.run.ModelConfig.data`). An optional `factory.options_schema` (a JSON
Schema dict) checks the options before any data is read. Under FSDP (`ballast.training.fsdp`), the
model's optional `ballast_blocks()` names its sharding units, and its optional `ballast_init_weights()`
(initialize every parameter and buffer in place, also on sharded parameters) lets it be built on the
meta device, each rank allocating only its own shards; `factory.meta_build = False` says the factory
must not be called on the meta device (it reads weights as it builds).

`names()` reads entry-point metadata only (no model module is imported: the DAG-parse budget holds).
Loading a factory or calling it may fail in a package's own code: that is a ConfigFailure (class
`config`, never retried) naming the distribution and the entry point.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ballast.training.failure import ConfigFailure

GROUP = "ballast.models"
_cache: dict[tuple[str, ...], dict[str, Any]] = {}


def _entry_points() -> dict[str, Any]:
    """name -> EntryPoint, read from the installed distributions' metadata; cached per sys.path (a test
    puts a dist-info directory on it)."""
    key = tuple(sys.path)
    found = _cache.get(key)
    if found is None:
        from importlib.metadata import entry_points

        found = {}
        for ep in entry_points(group=GROUP):
            found.setdefault(ep.name, ep)  # the first on sys.path wins, as an import would
        _cache.clear()
        _cache[key] = found
    return found


def names() -> tuple[str, ...]:
    """The registered model names, sorted (metadata only)."""
    return tuple(sorted(_entry_points()))


def unknown(name: str) -> str:
    """The one-line message for a name no package registers."""
    known = names()
    return f"unknown model {name!r}; registered: {', '.join(known) if known else '(none)'}"


def where(name: str) -> str:
    """'entry point NAME = VALUE of distribution DIST' for messages."""
    ep = _entry_points().get(name)
    if ep is None:
        return f"entry point {name!r}"
    dist = getattr(getattr(ep, "dist", None), "name", None) or "an unknown distribution"
    return f"entry point {name} = {ep.value} (group {GROUP}) of distribution {dist}"


def load_factory(name: str) -> Callable[..., Any]:
    """The factory registered as `name`; ConfigFailure for an unknown name or one that fails to import."""
    ep = _entry_points().get(name)
    if ep is None:
        raise ConfigFailure(f"training.model.name: {unknown(name)}")
    try:
        factory = ep.load()
    except Exception as exc:  # ImportError, AttributeError, SyntaxError, anything the module raises
        raise ConfigFailure(f"training.model.name: {where(name)} cannot be loaded:"
                            f" {type(exc).__name__}: {_first_line(exc)}") from exc
    if not callable(factory):
        raise ConfigFailure(f"training.model.name: {where(name)} is a {type(factory).__name__}, not a factory"
                            f" (a callable factory(options, data) -> torch.nn.Module)")
    return factory


def build(name: str, options: dict[str, Any], data: dict[str, Any]) -> Any:
    """The model: `factory(options, data)`, checked to be a torch.nn.Module; every failure a ConfigFailure
    naming the distribution and the entry point."""
    factory = load_factory(name)
    problems = schema_problems(factory, options)
    if problems:
        raise ConfigFailure("; ".join(problems))
    try:
        model = factory(dict(options), dict(data))
    except ConfigFailure:
        raise
    except Exception as exc:
        raise ConfigFailure(f"training.model: {where(name)} failed to build the model:"
                            f" {type(exc).__name__}: {_first_line(exc)}") from exc
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ConfigFailure(f"training.model: {where(name)} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def check_options(name: str, options: dict[str, Any]) -> list[str]:
    """One line per problem of `options` against the factory's options_schema (none without one),
    each naming `training.model.options.<path>`. Loads the factory (imports its module)."""
    return schema_problems(load_factory(name), options)


def schema_problems(factory: Any, options: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(['training.model.options', *map(str, loc)]) if loc else 'training.model.options'}: {msg}"
            .replace(".[", "[") for loc, msg in schema_errors(factory, options)]


def schema_errors(factory: Any, options: dict[str, Any]) -> list[tuple[tuple, str]]:
    """(location below training.model.options, message) for each problem of `options` against the
    factory's options_schema; none without one."""
    schema = getattr(factory, "options_schema", None)
    if schema is None:
        return []
    import jsonschema

    try:
        validator_cls = jsonschema.validators.validator_for(schema)
        validator_cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return [((), f"the model's own options_schema is not a valid JSON Schema ({_first_line(exc)})")]
    out: list[tuple[tuple, str]] = []
    for err in sorted(validator_cls(schema).iter_errors(options), key=lambda e: [str(p) for p in e.absolute_path]):
        loc = tuple(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = sorted(err.schema.get("properties") or {})
            for key in [k for k in err.instance if k not in allowed]:
                out.append(((*loc, key), "unknown option" + (f"; allowed: {', '.join(allowed)}" if allowed else "")))
            continue
        message = err.message if len(err.message) <= 300 else err.message[:297] + "..."
        out.append((loc, message))
    return sorted(out, key=lambda problem: [str(p) for p in problem[0]])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:300]
