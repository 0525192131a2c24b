"""What the policy's head computes from the model output: per-token log-probs, entropy, losses.

The learner hands a loss the model's output for a micro-batch (``LossFn``); for the policy
that is the vocab-parallel logits shard ``[b, L, V/tp]``, from which ``TokenOutputs`` makes
per-token log-probs (and entropy) with the vocab-parallel helpers (``vocab_parallel``), and
``TokenLoss`` turns a per-token loss on log-probs (``TokenLossFn``: the RL maths'
``PolicyLoss``) into a ``LossFn``. ``NLLLoss`` is plain next-token negative log-likelihood
(SFT) through the same helpers. A head producing something else (a value head) supplies its
own ``LossFn``; the learner's step does not change.

Columns: the value at column ``t`` is about token ``t`` (its log-prob given the tokens before
it, or the entropy of the distribution that predicted it); column 0 is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tir.policy.learner_config import LossInputs, TokenLossFn
from megatron_tir.policy.vocab_parallel import token_entropy, token_logprobs


def _shift_left(values_bL: torch.Tensor) -> torch.Tensor:
    """Column ``j`` <- column ``j - 1``, column 0 <- 0 (a prediction for token ``j`` sits at ``j - 1``)."""
    return torch.nn.functional.pad(values_bL[:, :-1], (1, 0))


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def aligned_logprobs(logits_bLV: torch.Tensor, tokens_bL: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[b, L]``: column t = log p(token t | tokens < t) under ``logits / temperature``; column 0 = 0."""
    target_bL = torch.roll(tokens_bL, -1, dims=1)
    return _shift_left(token_logprobs(logits_bLV, target_bL, temperature))


def aligned_entropy(logits_bLV: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[b, L]``: column t = entropy of the distribution that predicted token t; column 0 = 0."""
    return _shift_left(token_entropy(logits_bLV, temperature))


@dataclass(kw_only=True, slots=True, frozen=True)
class TokenOutputs:
    """An ``OutputFn``: ``{"logprobs"}`` (and ``"entropy"``) per token, masked, float32."""

    temperature: float = 1.0
    with_entropy: bool = False

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)

    @property
    def names(self) -> tuple[str, ...]:
        return ("logprobs", "entropy") if self.with_entropy else ("logprobs",)

    def __call__(self, logits_bLV: torch.Tensor, inputs: LossInputs) -> dict[str, torch.Tensor]:
        mask_bL = inputs.mask_bL
        out = {}
        if self.with_entropy:  # first: the log-prob helper may work in place on the logits
            out["entropy"] = aligned_entropy(logits_bLV, self.temperature) * mask_bL
        out["logprobs"] = aligned_logprobs(logits_bLV, inputs.tokens_bL, self.temperature) * mask_bL
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class TokenLoss:
    """A ``LossFn`` for the policy: ``token_loss(logprobs_bL, entropy_bL or None, extras)`` on the
    per-token log-probs (and entropy, with ``with_entropy``) under ``logits / temperature``."""

    token_loss: TokenLossFn
    temperature: float = 1.0
    with_entropy: bool = False

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)

    def __call__(self, logits_bLV: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        entropy_bL = aligned_entropy(logits_bLV, self.temperature) if self.with_entropy else None
        logp_bL = aligned_logprobs(logits_bLV, inputs.tokens_bL, self.temperature)  # may reuse the logits
        return self.token_loss(logp_bL, entropy_bL, inputs.extras)


@dataclass(kw_only=True, slots=True, frozen=True)
class NLLLoss:
    """A ``LossFn`` for supervised fine-tuning: ``-log p(token t | tokens < t)`` per token (the
    loss mask of the batch says which tokens are trained); metric ``nll``."""

    temperature: float = 1.0

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)

    def __call__(self, logits_bLV: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        nll_bL = -aligned_logprobs(logits_bLV, inputs.tokens_bL, self.temperature)
        return nll_bL, {"nll": nll_bL.detach()}
