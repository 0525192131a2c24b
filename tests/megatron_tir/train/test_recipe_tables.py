"""docs/recipes.md's tables say what the recipes are: every row naming a key is read back from the
recipe it documents (a departure from the papers has to be changed in both places)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_tir.train.recipes import load_recipe

RECIPES_DOC = Path(__file__).resolve().parents[3] / "docs" / "recipes.md"


def _tables() -> dict[str, list[tuple[list[str], list[str]]]]:
    """{recipe: [(keys, values)]} from the tables of docs/recipes.md."""
    section = RECIPES_DOC.read_text()
    out: dict[str, list] = {}
    for table in re.split(r"\n\s*\n", section):
        lines = [ln for ln in table.splitlines() if ln.startswith("|")]
        if len(lines) < 3:
            continue
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        recipe = next(h.strip("`") for h in header if h.startswith("`qwen"))
        col, key_col = header.index(f"`{recipe}`"), header.index("key")
        for ln in lines[2:]:
            cells = [c.strip() for c in ln.strip("|").split("|")]
            keys = re.findall(r"`([a-z_.0-9]+)`", cells[key_col])
            if not keys:
                continue
            first = keys[0].rsplit(".", 1)[0]
            keys = [k if "." in k else f"{first}.{k}" for k in keys]
            out.setdefault(recipe, []).append((keys, [v.strip() for v in cells[col].split(" / ")]))
    return out


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _same(value, text: str) -> bool:
    if isinstance(value, bool):
        return text == str(value).lower()
    if isinstance(value, (int, float)):
        return float(text) == pytest.approx(float(value))
    return str(value) == text


def test_recipe_tables_match_the_recipes():
    tables = _tables()
    assert set(tables) == {"qwen2.5-7b-simpletir", "qwen2.5-7b-zerotir"}
    checked = 0
    for recipe, rows in tables.items():
        cfg = load_recipe(recipe)
        for keys, values in rows:
            assert len(keys) == len(values), (recipe, keys, values)
            for key, text in zip(keys, values):
                assert _same(_get(cfg, key), text), f"{recipe}: {key} is {_get(cfg, key)!r}, docs/recipes.md says {text}"
                checked += 1
    assert checked >= 35
