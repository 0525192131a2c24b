"""resolve_eos_token_ids reads generation_config, config, tokenizer and the extra EOS tokens."""

from __future__ import annotations

import json
import shutil

import pytest
from megatron_tir.rollout.engines.eos import resolve_eos_token_ids


def test_smollm2_ends_on_im_end_and_endoftext(smollm2_dir):
    assert resolve_eos_token_ids(smollm2_dir) == (2, 0)
    assert resolve_eos_token_ids(smollm2_dir, extra_eos_tokens=()) == (2,)


def test_generation_config_list_comes_first_and_a_missing_file_is_fine(tiny_llama, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert resolve_eos_token_ids(model_dir) == (7, 2, 0)
    (model_dir / "generation_config.json").unlink()
    assert resolve_eos_token_ids(model_dir, extra_eos_tokens=("<|endoftext|>", "<|not-a-token|>")) == (2, 0)


def test_no_eos_anywhere_is_a_clear_error(tiny_llama, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama, model_dir)
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["eos_token_id"] = None
    (model_dir / "config.json").write_text(json.dumps(config))
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok_cfg.pop("eos_token", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(ValueError, match="no EOS token id"):
        resolve_eos_token_ids(model_dir, extra_eos_tokens=())
