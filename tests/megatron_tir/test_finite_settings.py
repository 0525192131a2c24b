"""Every float setting of the training and eval configs refuses NaN and ±inf, naming the key (issue 19)."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing

import pytest

from megatron_tir.eval.runner import EvalConfig
from megatron_tir.train.config import DERIVED_KEYS, TrainConfig, apply_overrides, from_dict, to_dict
from megatron_tir.train.recipes import load_recipe


def _float_keys(cls, prefix: str = "") -> list[str]:
    """Dotted keys of every field typed float (``float``, ``float | None``, ``tuple[float, ...]``)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _float_keys(tp, f"{prefix}{f.name}.")
            continue
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType, tuple) else (tp,)
        if float in args:
            keys.append(f"{prefix}{f.name}")
    return keys


TRAIN_FLOAT_KEYS = [k for k in _float_keys(TrainConfig) if k not in DERIVED_KEYS]
BAD = ("nan", "inf", "-inf")


def test_the_walk_finds_the_settings_named_in_the_issue():
    for key in ("learner.grad_clip", "trainer.loss.clip_high", "trainer.loss.entropy_coef", "rollout.temperature",
                "learner.lr", "trainer.filters.high_ratio_bound", "sandbox.probe_timeout_s"):
        assert key in TRAIN_FLOAT_KEYS
    assert len(TRAIN_FLOAT_KEYS) >= 14


@pytest.mark.parametrize("key", TRAIN_FLOAT_KEYS)
@pytest.mark.parametrize("bad", BAD)
def test_every_train_float_setting_refuses_non_finite_values(key, bad):
    with pytest.raises(ValueError) as info:
        apply_overrides(load_recipe("tiny-cpu"), [f"{key}={bad}"])
    text = str(info.value)
    assert key in text and "\n" not in text


@pytest.mark.parametrize("key", TRAIN_FLOAT_KEYS)
def test_a_config_json_with_a_non_finite_float_is_refused_naming_the_key(key):
    data = to_dict(load_recipe("tiny-cpu"))
    section = data
    *path, name = key.split(".")
    for part in path:
        section = section[part]
    section[name] = math.nan
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        from_dict(json.loads(json.dumps(data)))


@pytest.mark.parametrize("key", [k for k in _float_keys(EvalConfig) if k not in ("engine.model",)])
def test_every_eval_float_setting_refuses_non_finite_values(key):
    cfg = EvalConfig(data="aime24")
    obj = cfg
    *path, name = key.split(".")
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, name, math.inf)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        dataclasses.replace(cfg)
