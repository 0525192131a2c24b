"""Fixtures for checkpoint tests: Megatron checkpoints converted once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_ckpt(smollm2_dir, tmp_path_factory):
    """SmolLM2-135M converted to a Megatron dist checkpoint (once)."""
    from checkpoints_tools.convert import hf_to_megatron

    return hf_to_megatron(smollm2_dir, tmp_path_factory.mktemp("smollm2-megatron") / "ckpt")


@pytest.fixture(scope="session")
def convert_once(tmp_path_factory):
    """Factory: HF dir -> Megatron checkpoint, cached per HF dir."""
    from checkpoints_tools.convert import hf_to_megatron

    made = {}

    def convert(hf_dir):
        if hf_dir not in made:
            made[hf_dir] = hf_to_megatron(hf_dir, tmp_path_factory.mktemp("megatron") / "ckpt")
        return made[hf_dir]

    return convert
