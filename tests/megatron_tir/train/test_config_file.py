"""Config files: recipe -> YAML (``megatron-tir config``) -> ``train --config`` resolves to the
identical config; a run's config.json reads the same way; bad files fail on one line naming
file, line and key."""

import json

import pytest

from megatron_tir.cli import build_parser, main
from megatron_tir.train.cli import fresh_config
from megatron_tir.train.config import apply_overrides, to_dict
from megatron_tir.train.recipes import RECIPES, load_recipe
from megatron_tir.train.config_file import load_config_file


def config_yaml(capsys, *argv) -> str:
    assert main(["config", *argv]) == 0
    return capsys.readouterr().out


def train_args(*argv):
    return build_parser().parse_args(["train", *argv])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_to_yaml_to_config_is_identical(capsys, tmp_path, recipe):
    path = tmp_path / "run.yaml"
    path.write_text(config_yaml(capsys, "--recipe", recipe))
    assert load_config_file(path) == load_recipe(recipe)
    # --set and bare key=value apply on top, the same as on the recipe
    cfg = fresh_config(train_args("--config", str(path), "--set", "rollout.max_turns=7", "trainer.steps=3",
                                  "--out", str(tmp_path / "r")))
    assert cfg == apply_overrides(load_recipe(recipe), ["rollout.max_turns=7", "trainer.steps=3"])


def test_overrides_in_the_printed_config_and_a_run_config_json(capsys, tmp_path):
    text = config_yaml(capsys, "--recipe", "tiny-cpu", "--set", "rollout.max_turns=4", "data.eval_size=3")
    path = tmp_path / "run.yaml"
    path.write_text(text)
    expected = apply_overrides(load_recipe("tiny-cpu"), ["rollout.max_turns=4", "data.eval_size=3"])
    assert load_config_file(path) == expected
    config_json = tmp_path / "config.json"  # what a run writes (megatron_tir.train.cli.prepare)
    config_json.write_text(json.dumps(to_dict(expected), indent=2))
    assert load_config_file(config_json) == expected


def test_hand_edited_file_with_an_unknown_key_names_file_line_and_key(capsys, tmp_path):
    lines = config_yaml(capsys, "--recipe", "tiny-cpu").splitlines()
    at = lines.index("rollout:") + 1
    lines.insert(at, "  max_turnz: 5")  # a typo, on line at + 1
    path = tmp_path / "edited.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as info:
        load_config_file(path)
    assert str(info.value).startswith(f"{path}:{at + 1}: rollout.max_turnz: unknown key")
    code = main(["train", "--config", str(path), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{path}:{at + 1}: rollout.max_turnz" in err


def test_ill_typed_value_and_bad_yaml_name_the_line(capsys, tmp_path):
    lines = config_yaml(capsys, "--recipe", "tiny-cpu").splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("max_turns:"))
    lines[at] = lines[at].split(":")[0] + ": five"
    path = tmp_path / "typed.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:{at + 1}: rollout\.max_turns: expected int, got 'five'"):
        load_config_file(path)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: tiny-qwen2\nrollout: [1, 2\n")
    with pytest.raises(ValueError, match=rf"^{broken}:\d+: not valid YAML"):
        load_config_file(broken)


def test_bare_pairs_must_be_key_value(tmp_path, capsys):
    code = main(["train", "--recipe", "tiny-cpu", "--out", str(tmp_path / "r"), "steps"])
    assert code == 2 and "unexpected argument 'steps'" in capsys.readouterr().err
