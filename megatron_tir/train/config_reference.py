"""The config reference: a recipe's YAML with a comment per key, and ``docs/config.md``.

Both are rendered from the config dataclasses (:mod:`megatron_tir.config_doc`: each field's
comment is its description), so they cannot drift from the code:

    megatron-tir config --recipe smollm2-cpu --explain          # the YAML, every key explained
    python -m megatron_tir.train.config_reference > docs/config.md

The explained YAML is still a config file: ``megatron-tir train --config`` reads it back.
"""

from __future__ import annotations

import json
import sys
import textwrap

import yaml

from megatron_tir import config_io
from megatron_tir.config_doc import class_summary, leaves, sections
from megatron_tir.train.config import ASYNC_KEY, DECIDED_BY, DERIVED_KEYS, TrainConfig, to_dict
from megatron_tir.train.recipes import RECIPES
from megatron_tir.train.config_file import HEADER

WIDTH = 110
REGENERATE = "python -m megatron_tir.train.config_reference > docs/config.md"


def _flow(value) -> str:
    """``value`` as one line of YAML (flow style for lists and mappings)."""
    value = config_io._plain(value)
    if isinstance(value, str) and "\n" in value:
        return json.dumps(value)  # a YAML double-quoted scalar on one line
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def _notes(key: str) -> str:
    if key in DERIVED_KEYS:
        return "set from the top-level model; not settable"
    if key in DECIDED_BY:
        return f"decided by {DECIDED_BY[key]}; not settable"
    if key.startswith("trainer.asynchrony."):
        short = ASYNC_KEY if key == "trainer.asynchrony.mode" else ASYNC_KEY + key.removeprefix("trainer.asynchrony")
        return f"on the command line also {short}"
    return ""


def describe(key: str, doc: str, default) -> str:
    """One key's comment: meaning, default, and how it is set when that is not plain."""
    note = _notes(key)
    return f"{doc or '(undocumented)'} [default: {_flow(default)}{'; ' + note if note else ''}]"


def explain_yaml(cfg: TrainConfig, *, source: str) -> str:
    """``cfg`` as a config file whose every key and section has a comment above it."""
    info = {leaf.key: leaf for leaf in leaves(TrainConfig)}
    section_docs = {key: doc for key, _, doc in sections(TrainConfig)}
    out = [HEADER.format(source=source).rstrip("\n"),
           "# Each key: what it means [its default]. Set any with --set KEY=VALUE; docs/config.md lists them all."]

    def comment(text: str, indent: str) -> None:
        out.extend(textwrap.wrap(text, WIDTH - len(indent), initial_indent=indent + "# ",
                                 subsequent_indent=indent + "#   ", break_on_hyphens=False))

    def emit(mapping: dict, prefix: str, depth: int) -> None:
        indent = "  " * depth
        for name, value in mapping.items():
            key = prefix + name
            if key in section_docs:
                out.append("")
                comment(section_docs[key] or key, indent)
                out.append(f"{indent}{name}:")
                emit(value, key + ".", depth + 1)
                continue
            leaf = info[key]
            comment(describe(key, leaf.doc, leaf.default), indent)
            out.append(f"{indent}{name}: {_flow(value)}")

    emit(to_dict(cfg), "", 0)
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """``docs/config.md``: the recipes, then every section's keys with type, default and meaning."""
    by_parent: dict[str, list] = {}
    for leaf in leaves(TrainConfig):
        by_parent.setdefault(leaf.key.rpartition(".")[0], []).append(leaf)
    out = ["# Config reference", "",
           "Generated from the config dataclasses (each field's comment in the code is its description) by",
           f"`{REGENERATE}`; a test fails when this file and the code disagree.",
           "Set any key with `--set KEY=VALUE` (or a bare `KEY=VALUE`) on `megatron-tir train` / `config`;",
           "`megatron-tir config --recipe NAME --explain` prints a recipe's values with these descriptions,",
           "as a file that `megatron-tir train --config FILE` reads back. Values: `null` for none,",
           "`true`/`false`, comma-separated lists (`trainer.log.loggers=jsonl,tensorboard`).", "",
           "## Recipes", "", "| recipe | what it is |", "| --- | --- |"]
    for name, fn in RECIPES.items():
        out.append(f"| `{name}` | {_cell(recipe_summary(fn))} |")
    groups = [("", "top level", "")] + [(key, f"`{key}`", doc) for key, _, doc in sections(TrainConfig)]
    for key, title, doc in groups:
        rows = by_parent.get(key, [])
        if not rows:
            continue
        out += ["", f"## {title}", ""]
        if doc:
            out += [doc, ""]
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for leaf in rows:
            note = _notes(leaf.key)
            meaning = leaf.doc + (f" ({note})" if note else "")
            out.append(f"| `{leaf.key}` | `{_cell(leaf.type)}` | `{_cell(_flow(leaf.default))}` | {_cell(meaning)} |")
    return "\n".join(out) + "\n"


def section_names() -> list[str]:
    """The top-level sections of a config, in order (for ``train --help``)."""
    return [key for key, _, _ in sections(TrainConfig) if "." not in key]


def recipe_summary(fn) -> str:
    """The first sentence of a recipe function's docstring, on one line."""
    return " ".join((fn.__doc__ or "").split(". ")[0].split()).rstrip(".") + "."


def recipe_lines(width: int = 100) -> list[str]:
    """``name: summary`` for every recipe, each shortened to ``width`` characters."""
    return [textwrap.shorten(f"{name}: {recipe_summary(fn)}", width, placeholder=" ...") for name, fn in RECIPES.items()]


__all__ = ["class_summary", "describe", "explain_yaml", "markdown", "recipe_lines", "section_names"]

if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(markdown())
