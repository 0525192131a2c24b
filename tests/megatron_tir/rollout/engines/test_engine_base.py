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

    async def generate(self, prompt_ids, params): ...

    async def update_weights(self, named_tensors): ...

    async def pause(self, *, mode=DEFAULT_PAUSE_MODE): ...

    async def resume(self): ...

    async def close(self): ...


def test_protocol_check_accepts_a_matching_engine_and_names_each_mismatch():
    assert protocol_mismatches(_Engine, GenerationEngine) == []

    class OldLocalPause(_Engine):  # the LocalEngine pause before PauseMode
        async def pause(self, *, abort_in_flight=False): ...

    class OtherDefault(_Engine):
        async def pause(self, *, mode=PauseMode.RETRACT): ...

    class SyncResume(_Engine):
        def resume(self): ...

    class NoClose:
        eos_token_ids = (0,)
        generate, update_weights = _Engine.generate, _Engine.update_weights
        pause, resume = _Engine.pause, _Engine.resume

    assert "OldLocalPause.pause" in protocol_mismatches(OldLocalPause, GenerationEngine)[0]
    assert "OtherDefault.pause" in protocol_mismatches(OtherDefault, GenerationEngine)[0]
    assert "async/sync" in protocol_mismatches(SyncResume, GenerationEngine)[0]
    assert protocol_mismatches(NoClose, GenerationEngine) == ["NoClose.close is missing"]


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
