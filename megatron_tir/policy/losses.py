"""What the policy's head computes from the model output: per-token log-probs, entropy, losses.

The learner hands a loss the model's output for a micro-batch (``LossFn``); for the policy
that is the vocab-parallel logits shard ``[b, L, V/tp]``, from which ``TokenOutputs`` makes
per-token log-probs (and entropy) with the vocab-parallel helpers (``vocab_parallel``), and
``TokenLoss`` turns a per-token loss on log-probs (``TokenLossFn``: the RL maths'
``PolicyLoss``) into a ``LossFn``. ``NLLLoss`` is plain next-token negative log-likelihood
(SFT) through the same helpers. A head producing something else (a value head) supplies its
own ``LossFn``; the learner's step does not change: ``ValueOutputs`` / ``ValueLoss`` are the
critic's (``megatron_tir.policy.value_head``), on its ``[b, L, 1]`` output.

Columns: the value at column ``t`` is about token ``t`` (its log-prob given the tokens before
it, or the entropy of the distribution that predicted it); column 0 is 0.

The entropy is a diagnostic unless the token loss trains on it (an entropy bonus): ``TokenLoss``
then computes it without autograd, in chunks of tokens (``ENTROPY_CHUNK_ELEMS`` logit elements at a
time), so it adds nothing to the backward graph. With autograd it keeps four float32 tensors the
size of the logits shard (``z``, ``z - max``, ``exp``, their product) for the backward pass; measured
on CPU (``tests/launch/test_plan_loss_memory.py``) the loss path holds 18 bytes per bf16 logit
element that way against 8 without the entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tir.policy.learner_contract import LossInputs, TokenLossFn
from megatron_tir.policy.vocab_parallel import token_entropy, token_logprobs

ENTROPY_CHUNK_ELEMS = 1 << 24  # logit elements per chunk of the entropy diagnostic (4 float32 temporaries: 256 MiB)


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


@torch.no_grad()
def aligned_entropy_diagnostic(logits_bLV: torch.Tensor, temperature: float,
                               chunk_elems: int | None = None) -> torch.Tensor:
    """:func:`aligned_entropy` without autograd, ``chunk_elems`` (default ``ENTROPY_CHUNK_ELEMS``)
    logit elements at a time (whole columns of the micro-batch): the same values, none of its
    temporaries kept for backward.
    Every TP rank cuts the same chunks (the shard's shape is the same), so the per-chunk
    reductions over the TP group match."""
    b, length, vocab = logits_bLV.shape
    step = max(1, (chunk_elems or ENTROPY_CHUNK_ELEMS) // max(1, b * vocab))
    parts = [token_entropy(logits_bLV[:, i:i + step], temperature) for i in range(0, length, step)]
    return _shift_left(torch.cat(parts, dim=1))


def entropy_needs_grad(token_loss: TokenLossFn) -> bool:
    """Whether ``token_loss``'s gradient goes through the entropy: its ``entropy_needs_grad``
    attribute (``rl.loss.PolicyLoss``: an entropy coefficient > 0); a token loss that does not
    say is taken to need it (the entropy then keeps its autograd graph)."""
    return bool(getattr(token_loss, "entropy_needs_grad", True))


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
    per-token log-probs (and entropy, with ``with_entropy``) under ``logits / temperature``. The
    entropy is computed without autograd, in chunks, unless the token loss trains on it
    (:func:`entropy_needs_grad`)."""

    token_loss: TokenLossFn
    temperature: float = 1.0
    with_entropy: bool = False

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)

    def __call__(self, logits_bLV: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        entropy_bL = None
        if self.with_entropy:
            entropy_bL = aligned_entropy(logits_bLV, self.temperature) if entropy_needs_grad(self.token_loss) \
                else aligned_entropy_diagnostic(logits_bLV, self.temperature)
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


def aligned_values(output_bL1: torch.Tensor) -> torch.Tensor:
    """``[b, L]``: column t = the value head's output at position t - 1 (the state in which token t
    was sampled, the log-probs' alignment); column 0 = 0."""
    return _shift_left(output_bL1[..., 0].float())


@dataclass(kw_only=True, slots=True, frozen=True)
class ValueOutputs:
    """The critic's ``OutputFn``: ``{"values"}`` per token, masked, float32."""

    names = ("values",)

    def __call__(self, output_bL1: torch.Tensor, inputs: LossInputs) -> dict[str, torch.Tensor]:
        return {"values": aligned_values(output_bL1) * inputs.mask_bL}


@dataclass(kw_only=True, slots=True, frozen=True)
class ValueLoss:
    """The critic's ``LossFn``: the clipped value loss (``megatron_tir.rl.critic.value_loss_BT``)
    against ``extras["returns_BT"]`` with ``extras["old_values_BT"]``; the batch's loss mask holds
    the model's own tokens only (ZeroTIR's value masking). Metrics: ``value_clipped``, ``value``."""

    clip: float | None = 0.2
    clip_high: float | None = None  # the clip above the old value (None: clip; ZeroTIR's fork: 0.28)

    def __post_init__(self) -> None:
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"value clip must be > 0 (or null), got {self.clip}")
        if self.clip_high is not None and not self.clip_high > 0:
            raise ValueError(f"value clip_high must be > 0 (or null), got {self.clip_high}")

    def __call__(self, output_bL1: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from megatron_tir.rl.critic import value_loss_BT

        values_bL = aligned_values(output_bL1)
        loss_bL, clipped_bL = value_loss_BT(values_bL, inputs.extras["old_values_BT"], inputs.extras["returns_BT"],
                                            clip=self.clip, clip_high=self.clip_high)
        return loss_bL, {"value_clipped": clipped_bL, "value": values_bL.detach()}
