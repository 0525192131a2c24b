"""The interface both engines share: the protocol signature check, PauseMode, generate's checks."""

from __future__ import annotations

import pytest
from megatron_tir.rollout.engines.base import (
    DEFAULT_PAUSE_MODE,
    GenerationEngine,
    PauseMode,
    SamplingParams,
    check_generate_args,
    pause_mode,
)

from engine_testing import protocol_mismatches


class _Engine:
    eos_token_ids = (0,)

    @property
    def weight_version(self): ...

    async def generate(self, prompt_ids, params): ...

    async def close(self): ...


def test_protocol_check_accepts_a_matching_engine_and_names_each_mismatch():
    assert protocol_mismatches(_Engine, GenerationEngine) == []

    class ExtraArgument(_Engine):
        async def generate(self, prompt_ids, params, *, timeout=None): ...

    class SyncClose(_Engine):
        def close(self): ...

    class NoClose:
        eos_token_ids = (0,)
        weight_version = _Engine.weight_version
        generate = _Engine.generate

    class NoVersion:
        eos_token_ids = (0,)
        generate, close = _Engine.generate, _Engine.close

    assert "ExtraArgument.generate" in protocol_mismatches(ExtraArgument, GenerationEngine)[0]
    assert "async/sync" in protocol_mismatches(SyncClose, GenerationEngine)[0]
    assert protocol_mismatches(NoClose, GenerationEngine) == ["NoClose.close is missing"]
    assert protocol_mismatches(NoVersion, GenerationEngine) == ["NoVersion.weight_version is missing"]


def test_the_interface_has_no_weight_update_and_no_pause():
    """How weights travel, and the pause around it, belong to the engine's weight sync."""
    assert not {"update_weights", "pause", "resume"} & set(vars(GenerationEngine))


def test_pause_mode_parsing():
    assert pause_mode("retract") is PauseMode.RETRACT and pause_mode(PauseMode.ABORT) is PauseMode.ABORT
    assert DEFAULT_PAUSE_MODE is PauseMode.ABORT
    with pytest.raises(ValueError, match="pause mode must be one of \\['abort', 'retract', 'in_place'\\]"):
        pause_mode("freeze")


def test_generate_argument_checks():
    params = SamplingParams(max_new_tokens=1)
    assert check_generate_args((1, 2), params) == [1, 2]
    for prompt, message in [([], "empty"), ("hi", "not text"), ([3, -1], "negative")]:
        with pytest.raises(ValueError, match=message):
            check_generate_args(prompt, params)
    with pytest.raises(TypeError, match="SamplingParams"):
        check_generate_args([1], {"max_new_tokens": 1})
    with pytest.raises(ValueError, match="route_key"):
        SamplingParams(max_new_tokens=1, route_key=3)
