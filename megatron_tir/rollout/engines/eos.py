"""Which token ids end a generation, read from an HF model directory (no weights loaded)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

# Base models end documents with <|endoftext|> even when the generation config names
# only the chat end token (SmolLM2-Instruct: <|im_end|> = 2, <|endoftext|> = 0).
DEFAULT_EXTRA_EOS_TOKENS: tuple[str, ...] = ("<|endoftext|>",)


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def resolve_eos_token_ids(model_dir: str | Path, extra_eos_tokens: Sequence[str] = DEFAULT_EXTRA_EOS_TOKENS,
                          *, tokenizer=None) -> tuple[int, ...]:
    """EOS ids: generation_config.eos_token_id, then config.eos_token_id, then the
    tokenizer's eos token, then ``extra_eos_tokens`` found in the vocabulary (in that
    order, without duplicates). ValueError when none is found."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    model_dir = Path(model_dir)
    ids: list[int] = []
    try:
        ids += _as_ids(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    ids += _as_ids(getattr(AutoConfig.from_pretrained(model_dir), "eos_token_id", None))
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_dir)
    ids += _as_ids(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids += [vocab[token] for token in extra_eos_tokens if token in vocab]
    if not ids:
        raise ValueError(f"no EOS token id found in {model_dir}; pass eos_token_ids explicitly")
    return tuple(dict.fromkeys(ids))
