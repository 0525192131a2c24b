"""Numerical parity: transformers on the HF model vs megatron-core GPTModel on the checkpoint.

The same token ids go through both models; the report is the max |logit difference|
over every position and vocabulary entry and the share of positions whose argmax
agrees. For tp*pp*ep > 1 the Megatron side runs on ``tp*pp*ep`` spawned gloo ranks (an MoE
model's experts split over ``ep`` of them, each expert ``tp``-way; the last pipeline stage's
first TP rank of data-parallel replica 0 writes the logits, gathered over TP). Both sides compute in
float32 by default.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_tir.policy.spec import spec_from_hf_dir
from megatron_tir.policy.parallel import run_ranks
from megatron_tir.policy.checkpoint.layout import read_meta, resolve_checkpoint
from megatron_tir.policy.checkpoint.megatron_io import check_same_model, load_model
from megatron_tir.model_sources import resolve_model

log = logging.getLogger(__name__)

DEFAULT_TEXTS = (
    "Let x be the number of integers n with 1 <= n <= 100 such that n^2 + 1 is divisible by 5. "
    "We write a short Python program to count them, then put the final answer in \\boxed{}.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print(fibonacci(30))  # the thirtieth Fibonacci number is printed by the interpreter",
)


@dataclass(kw_only=True, slots=True)
class VerifyConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert-parallel size (MoE): world = tp * pp * ep
    atol: float = 1e-3
    min_argmax_agreement: float = 0.99
    max_tokens: int = 48
    texts: tuple[str, ...] = DEFAULT_TEXTS
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.ep < 1:
            raise ValueError(f"tp, pp and ep must be >= 1, got tp={self.tp} pp={self.pp} ep={self.ep}")
        if self.atol <= 0:
            raise ValueError("atol must be positive")
        if not 0 <= self.min_argmax_agreement <= 1:
            raise ValueError("min_argmax_agreement must be in [0, 1]")
        if self.max_tokens < 2 or not self.texts:
            raise ValueError("need at least one text and max_tokens >= 2")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class VerifyResult:
    max_abs_diff: float
    argmax_agreement: float
    n_tokens: int
    ok: bool

    def line(self, cfg: VerifyConfig) -> str:
        agree = round(self.argmax_agreement * self.n_tokens)
        return (f"max |logit diff| = {self.max_abs_diff:.3e} (tolerance {cfg.atol:.0e}), argmax agreement = "
                f"{100 * self.argmax_agreement:.2f}% ({agree}/{self.n_tokens} tokens, minimum "
                f"{100 * cfg.min_argmax_agreement:.0f}%) -> {'OK' if self.ok else 'FAIL'}")


def sample_ids(hf_dir: Path, cfg: VerifyConfig) -> torch.Tensor:
    """Token ids ``[B, S]``: each text tokenized and cut to the common length (<= max_tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in cfg.texts]
    length = min(cfg.max_tokens, *(len(i) for i in ids))
    if length < 2:
        raise ValueError("sample texts tokenize to fewer than 2 tokens")
    return torch.tensor([i[:length] for i in ids], dtype=torch.long)


@torch.no_grad()
def hf_logits(hf_dir: Path, ids_BS: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    model.eval()
    return model(input_ids=ids_BS).logits.float()


def _megatron_rank(rank: int, world: int, ckpt: str, tp: int, pp: int, dtype: str, ids_path: str,
                   out_path: str, ep: int = 1) -> None:
    from megatron.core import parallel_state

    from megatron_tir.policy.build import build_gpt_model
    from megatron_tir.policy.parallel import init_parallel
    from megatron_tir.policy.forward import forward_logits

    spec = dataclasses.replace(read_meta(Path(ckpt)).spec, dtype=dtype)
    init_parallel(tp, pp, ep=ep)
    model = build_gpt_model(spec, parallel_output=False, perform_initialization=False)
    load_model(model, Path(ckpt))
    logits = forward_logits(model, torch.load(ids_path))
    if (logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0):
        torch.save(logits, out_path)


def megatron_logits(ckpt: Path, ids_BS: torch.Tensor, *, tp: int, pp: int, dtype: str, ep: int = 1) -> torch.Tensor:
    with tempfile.TemporaryDirectory(prefix="tir-verify-") as tmp:
        ids_path, out_path = str(Path(tmp) / "ids.pt"), str(Path(tmp) / "logits.pt")
        torch.save(ids_BS, ids_path)
        if tp * pp * ep == 1:
            from megatron_tir.policy.parallel import destroy_parallel

            try:
                _megatron_rank(0, 1, str(ckpt), 1, 1, dtype, ids_path, out_path)
            finally:
                destroy_parallel()
        else:
            run_ranks(_megatron_rank, tp * pp * ep, str(ckpt), tp, pp, dtype, ids_path, out_path, ep)
        return torch.load(out_path)


def compare(a_BSV: torch.Tensor, b_BSV: torch.Tensor, cfg: VerifyConfig) -> VerifyResult:
    if a_BSV.shape != b_BSV.shape:
        raise ValueError(f"logit shapes differ: {tuple(a_BSV.shape)} vs {tuple(b_BSV.shape)}")
    diff = (a_BSV - b_BSV).abs().max().item()
    agree = (a_BSV.argmax(-1) == b_BSV.argmax(-1)).float().mean().item()
    ok = diff <= cfg.atol and agree >= cfg.min_argmax_agreement
    return VerifyResult(max_abs_diff=diff, argmax_agreement=agree, n_tokens=a_BSV.shape[0] * a_BSV.shape[1], ok=ok)


def verify(hf: str | Path, ckpt: Path, cfg: VerifyConfig) -> VerifyResult:
    hf_dir = resolve_model(hf)
    ckpt = resolve_checkpoint(ckpt)
    spec, _ = spec_from_hf_dir(hf_dir)
    meta = read_meta(ckpt)
    check_same_model(meta, spec, str(hf_dir))
    spec.check_layout(cfg.tp, cfg.pp, cfg.ep)
    ids = sample_ids(hf_dir, cfg)
    dtype = getattr(torch, cfg.dtype)
    ref = hf_logits(hf_dir, ids, dtype)
    got = megatron_logits(ckpt, ids, tp=cfg.tp, pp=cfg.pp, dtype=cfg.dtype, ep=cfg.ep)
    return compare(ref, got, cfg)
