"""One reader for the typed configs: a dataclass from a mapping, back to a mapping, and ``key=value`` text.

The configs are ``@dataclass(kw_only=True, slots=True)`` trees whose ``__post_init__`` validates.
Three ways in, one set of rules:

* :func:`build` -- a config from a JSON/YAML mapping (a run's ``config.json``, the launcher's
  cluster file): unknown and missing keys are refused, each value must already have its field's
  type (an int where a float is expected is fine; a list becomes a tuple for ``tuple[...]``
  fields; a string becomes an enum member by value);
* :func:`to_dict` -- the JSON/YAML-ready mapping :func:`build` reads back into an equal config;
* :func:`apply_overrides` -- ``key=value`` text (``--set``) parsed by the field's type
  (``null`` for None, ``true``/``false``, comma-separated tuples), then every section rebuilt so
  its ``__post_init__`` sees the result. Keys that another key decides are refused, naming it.

Every error is one ``ValueError`` line that names the dotted key.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import types
import typing
from collections.abc import Mapping, Sequence

__all__ = ["apply_overrides", "build", "parse_text", "to_dict"]


def _optional(tp):
    """``(inner, True)`` for ``X | None``, else ``(tp, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(args) < len(typing.get_args(tp)):
            return args[0], True
    return tp, False


def _finite(value: float, key: str) -> float:
    """NaN and ±inf are refused for every float field, before the section's own checks (which
    compare, and ``nan > 0`` / ``nan <= 1`` are both False); see :mod:`megatron_tir.finite`."""
    if not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value}")
    return value


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


# ----------------------------------------------------------------------------- mappings


def build(cls, data, key: str = ""):
    """``cls`` (a config dataclass) from the mapping ``data``; errors name the dotted ``key``."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{key or 'the config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{key}." if key else ""
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: unknown key (known: {', '.join(fields)})")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{prefix}{missing[0]}: missing")
    kwargs = {name: _value(hints[name], value, prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{key}: {exc}" if key else str(exc)) from None


def _value(tp, value, key: str):
    tp, optional = _optional(tp)
    if value is None and optional:
        return None
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping, got {type(value).__name__}")
        return {str(k): _value(item, v, f"{key}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        item = typing.get_args(tp)[0]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {type(value).__name__}")
        items = [_value(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ValueError(f"{key}: {value!r} is not one of {', '.join(str(m.value) for m in tp)}") from None
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(float(value), key)
    else:
        raise AssertionError(f"unhandled type {tp} at {key}")
    raise ValueError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def to_dict(cfg) -> dict:
    """A JSON/YAML-ready dict of a config (enums as their values, tuples as lists)."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.init:
            out[f.name] = _plain(getattr(cfg, f.name))
    return out


def _plain(v):
    if dataclasses.is_dataclass(v):
        return to_dict(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


# ----------------------------------------------------------------------------- key=value text


def parse_text(text: str, tp, key: str):
    """``text`` (command-line text) as a value of the resolved annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and text.strip().lower() in ("null", "none", ""):
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return parse_text(text, a, key)
            except ValueError:
                continue
        raise ValueError(f"{key}: {text!r} is not a {' | '.join(_type_name(a) for a in args)}")
    if origin is tuple:
        item = typing.get_args(tp)[0]
        return tuple(parse_text(x.strip(), item, key) for x in text.split(",") if x.strip())
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{key}: {text!r} is not a bool (true/false)")
    if tp in (int, float):
        try:
            value = tp(text)
        except ValueError:
            raise ValueError(f"{key}: {text!r} is not {'an int' if tp is int else 'a number'}") from None
        return _finite(value, key) if tp is float else value
    if tp is str:
        return text
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(text)
        except ValueError:
            raise ValueError(f"{key}: {text!r} is not one of {', '.join(str(m.value) for m in tp)}") from None
    raise ValueError(f"{key}: fields of type {tp} cannot be set from the command line")


def _assign(cfg, path: list[str], text: str, key: str) -> None:
    """Set ``path`` of ``cfg`` (in place, not yet validated) to ``text`` parsed by the field's type."""
    obj = cfg
    for depth, name in enumerate(path):
        names = [f.name for f in dataclasses.fields(obj)]
        where = ".".join(path[:depth]) or "the config"
        if name not in names:
            raise ValueError(f"unknown key {key!r} ({where} has: {', '.join(names)})")
        current = getattr(obj, name)
        last = depth == len(path) - 1
        if dataclasses.is_dataclass(current):
            if last:
                raise ValueError(f"{key} is a section; set one of its keys ({key}.<key>)")
            obj = current
            continue
        if not last:
            raise ValueError(f"unknown key {key!r} ({'.'.join(path[:depth + 1])} is not a section)")
        setattr(obj, name, parse_text(text, typing.get_type_hints(type(obj))[name], key))


def _validated(obj, prefix: str, touched: dict[str, list[str]]):
    """``obj`` rebuilt bottom-up (every ``__post_init__`` runs); errors name the keys set in the failing section."""
    changes = {}
    for f in dataclasses.fields(obj):
        sub = getattr(obj, f.name)
        if dataclasses.is_dataclass(sub):
            changes[f.name] = _validated(sub, f"{prefix}{f.name}.", touched)
    try:
        return dataclasses.replace(obj, **changes)
    except (ValueError, TypeError) as exc:
        keys = touched.get(prefix, []) or [k for p, ks in touched.items() if p.startswith(prefix) for k in ks]
        raise ValueError(f"{', '.join(keys) or prefix.rstrip('.') or 'config'}: {exc}") from None


def apply_overrides(cfg, overrides: Sequence[str], *, decided_by: Mapping[str, str] | None = None):
    """``cfg`` with every ``key=value`` applied (a new config; ``cfg`` is not changed).

    ``decided_by`` maps a key to the key that decides it (``rollout.void_turn`` ->
    ``trainer.mode``): setting such a key is refused, naming the deciding one. All values are
    parsed and set first, then every section is validated, so keys that depend on each other
    can come in any order; errors name the key (a bad value) or the keys set in the section
    that failed validation.
    """
    decided_by = decided_by or {}
    cfg = copy.deepcopy(cfg)
    touched: dict[str, list[str]] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value")
        if key in decided_by:
            raise ValueError(f"{key} is decided by {decided_by[key]}; set {decided_by[key]} instead")
        path = key.split(".")
        _assign(cfg, path, text, key)
        touched.setdefault("".join(p + "." for p in path[:-1]), []).append(f"{key}={text}")
    return _validated(cfg, "", touched)
