"""The config reference: every key described, ``config --explain`` a valid config file, docs/config.md in sync."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from megatron_tir.cli import main
from megatron_tir.config_doc import field_docs, leaves, sections
from megatron_tir.train.config import TrainConfig, apply_overrides, to_dict
from megatron_tir.train.recipes import RECIPES, load_recipe
from megatron_tir.train.config_file import load_config_file
from megatron_tir.train.config_reference import REGENERATE, explain_yaml, markdown

DOCS = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def _dotted(mapping: dict, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in mapping.items():
        if isinstance(value, dict) and f"{prefix}{name}" not in {leaf.key for leaf in leaves(TrainConfig)}:
            keys |= _dotted(value, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def test_every_key_and_section_has_a_description():
    keys = leaves(TrainConfig)
    assert {leaf.key for leaf in keys} == _dotted(to_dict(TrainConfig()))  # the walk reaches every key
    missing = [leaf.key for leaf in keys if not leaf.doc.strip()]
    assert not missing, f"config keys without a description (add a comment on the field): {missing}"
    assert not [key for key, _, doc in sections(TrainConfig) if not doc.strip()]


def test_descriptions_come_from_comments_and_metadata():
    @dataclasses.dataclass(kw_only=True)
    class Example:
        # above the field,
        # on two lines
        a: int = 1  # and after it
        b: str = "x"  # noqa: E501
        c: float = dataclasses.field(default=0.5, metadata={"doc": "from metadata"})  # not this comment
        d: int = 2

    docs = field_docs(Example)
    assert docs == {"a": "above the field, on two lines and after it", "b": "", "c": "from metadata", "d": ""}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_explained_yaml_reads_back_and_comments_every_key(tmp_path, recipe):
    cfg = load_recipe(recipe)
    text = explain_yaml(cfg, source=f"recipe {recipe}")
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert load_config_file(path) == cfg
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and i > 0:
            assert lines[i - 1].strip().startswith("#"), f"no comment above {stripped!r}"
    assert all(leaf.key.rsplit(".", 1)[-1] + ":" in text for leaf in leaves(TrainConfig))


def test_explain_shows_the_default_beside_the_recipe_value():
    cfg = apply_overrides(load_recipe("tiny-cpu"), ["rollout.max_turns=7"])
    text = explain_yaml(cfg, source="test")
    block = text[text.index("\nrollout:"):]
    comment, value = block[block.index("# model turns per trajectory"):].splitlines()[:2]
    assert "[default: 5]" in comment and value.strip() == "max_turns: 7"
    flat = " ".join(text.replace("#", " ").split())
    assert "on the command line also trainer.async" in flat
    assert "decided by trainer.mode" in flat


def test_config_command_explain(capsys):
    assert main(["config", "--recipe", "tiny-cpu", "--explain", "--set", "trainer.steps=3"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["trainer"]["steps"] == 3 and data["model"] == "tiny-qwen2"


def test_docs_config_md_is_generated_from_the_code():
    assert DOCS.read_text() == markdown(), f"docs/config.md is stale: {REGENERATE}"
    text = markdown()
    for leaf in leaves(TrainConfig):
        assert f"| `{leaf.key}` |" in text
    for name in RECIPES:
        assert f"| `{name}` |" in text


def test_train_help_lists_every_recipe_and_section(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in RECIPES:
        assert f"{name}:" in out and name in out.split("recipes:")[0]
    for key, _, _ in sections(TrainConfig):
        if "." not in key:
            assert key in out.split("config sections")[1]

