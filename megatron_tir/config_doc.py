"""What each config key means, read from the config dataclasses themselves.

The description of a field is, in this order:

* ``field(metadata={"doc": "..."})`` when the field carries one;
* otherwise the comment lines directly above the field joined with its trailing comment
  (``tp: int = 1  # tensor-parallel size``) -- the convention every config dataclass of the
  project follows (a ``# noqa`` / ``# type:`` pragma is not a description).

A section (a field whose type is a dataclass) is described by the first line of its class
docstring, or by its own comment when the class has no docstring. :func:`leaves` walks a config
class into dotted keys with their type, default and description: ``megatron-tir config
--explain`` and ``docs/config.md`` (:mod:`megatron_tir.train.config_reference`) are both
rendered from it, and a test checks that every key has a description.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
import typing
from dataclasses import dataclass

__all__ = ["Leaf", "class_summary", "field_docs", "leaves", "sections"]

_PRAGMA = re.compile(r"^(noqa|type:|pragma|fmt:|pylint:)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Leaf:
    """One settable key: its dotted name, its annotation as written, its default and its meaning."""
    key: str
    type: str
    default: object
    doc: str


@functools.cache
def _source_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment description, from the class body's source (fields ``cls`` defines)."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = src.splitlines()
    comments: dict[int, tuple[int, str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            comments[tok.start[0]] = (tok.start[1], "" if _PRAGMA.match(text) else text)
    body = ast.parse(src).body[0]
    out = {}
    for stmt in getattr(body, "body", []):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        line = stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line][1])
            line -= 1
        trailing = comments.get(stmt.end_lineno)
        own_line = trailing is not None and lines[stmt.end_lineno - 1][:trailing[0]].strip()
        parts = above + ([trailing[1]] if own_line else [])
        out[stmt.target.id] = " ".join(p for p in parts if p)
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Init field name -> description ("" when the field has none) of the dataclass ``cls``."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_source_comments(klass))
    return {f.name: f.metadata.get("doc") or comments.get(f.name, "")
            for f in dataclasses.fields(cls) if f.init}


def class_summary(cls: type) -> str:
    """The first paragraph of ``cls``'s own docstring, on one line ("" without one)."""
    doc = cls.__dict__.get("__doc__") or ""
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature, not a description
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _type_text(tp) -> str:
    """The annotation as written (a string under ``from __future__ import annotations``)."""
    if isinstance(tp, str):
        return tp
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _section_type(cls: type, name: str):
    tp = typing.get_type_hints(cls)[name]
    return tp if dataclasses.is_dataclass(tp) else None


def sections(cls: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """``(dotted key, class, description)`` of every section below ``cls``, depth first."""
    out = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        sub = _section_type(cls, f.name) if f.init else None
        if sub is not None:
            out.append((prefix + f.name, sub, class_summary(sub) or docs[f.name]))
            out.extend(sections(sub, f"{prefix}{f.name}."))
    return out


def leaves(cls: type, prefix: str = "") -> list[Leaf]:
    """Every settable key below ``cls`` (sections expanded), in the dataclasses' order."""
    out = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        sub = _section_type(cls, f.name)
        if sub is not None:
            out.extend(leaves(sub, f"{prefix}{f.name}."))
        else:
            out.append(Leaf(prefix + f.name, _type_text(f.type), _default(f), docs[f.name]))
    return out
