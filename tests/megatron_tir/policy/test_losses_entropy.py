"""The entropy diagnostic without autograd: the same values and the same gradients as with it, in chunks."""

from __future__ import annotations

import pytest
import torch

from megatron_tir.policy.learner_contract import LossInputs
from megatron_tir.policy.losses import TokenLoss, aligned_entropy, aligned_entropy_diagnostic, entropy_needs_grad
from megatron_tir.rl.loss import LossConfig, PolicyLoss


@pytest.fixture(scope="module")
def parallel_1x1():
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


class Recording:
    """A token loss that keeps the entropy it was given; ``needs`` None: it does not say (autograd kept)."""

    def __init__(self, inner, needs: bool | None) -> None:
        self.inner, self.seen = inner, None
        if needs is not None:
            self.entropy_needs_grad = needs

    def __call__(self, logprobs_bL, entropy_bL, extras):
        self.seen = entropy_bL
        return self.inner(logprobs_bL, entropy_bL, extras)


def _case(seed=0, b=3, length=37, vocab=50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, length, vocab, generator=g) * 3
    tokens = torch.randint(0, vocab, (b, length), generator=g)
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[0, 30:] = False
    extras = {"old_logprobs_BT": -torch.rand(b, length, generator=g) * 4, "advantages_BT": torch.randn(b, length,
                                                                                                       generator=g)}
    return logits, LossInputs(tokens_bL=tokens, mask_bL=mask, extras=extras)


def _run(token_loss, logits, inputs, temperature):
    x = logits.clone().requires_grad_(True)
    loss_bL, metrics = TokenLoss(token_loss=token_loss, temperature=temperature, with_entropy=True)(x, inputs)
    (loss_bL * inputs.mask_bL).sum().backward()
    return loss_bL.detach(), metrics, x.grad


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_diagnostic_entropy_matches_the_autograd_one_and_leaves_the_gradient_alone(parallel_1x1, temperature):
    logits, inputs = _case()
    policy = PolicyLoss(LossConfig())  # entropy_coef 0: the trainer's default
    assert entropy_needs_grad(policy) is False and entropy_needs_grad(lambda *a: a) is True
    old = Recording(policy, needs=None)  # says nothing: the entropy keeps its graph, as before
    new = Recording(policy, needs=False)
    loss_old, m_old, grad_old = _run(old, logits, inputs, temperature)
    loss_new, m_new, grad_new = _run(new, logits, inputs, temperature)
    assert old.seen.requires_grad and not new.seen.requires_grad
    torch.testing.assert_close(new.seen, old.seen.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(m_new["entropy"], m_old["entropy"], rtol=0, atol=1e-6)
    torch.testing.assert_close(loss_new, loss_old, rtol=0, atol=0)
    torch.testing.assert_close(grad_new, grad_old, rtol=0, atol=0)


def test_chunks_cover_every_column(parallel_1x1):
    logits, _ = _case(seed=1)
    whole = aligned_entropy(logits, 0.9).detach()
    for chunk in (1, 50, 3 * 50 * 5, 10**9):  # one column of one row (rounded up to a column), 5 columns, all
        torch.testing.assert_close(aligned_entropy_diagnostic(logits, 0.9, chunk_elems=chunk), whole, rtol=0,
                                   atol=1e-6)


def test_an_entropy_bonus_keeps_the_entropy_in_the_graph(parallel_1x1):
    logits, inputs = _case(seed=2)
    bonus = Recording(PolicyLoss(LossConfig(entropy_coef=0.01)), needs=None)
    assert entropy_needs_grad(bonus.inner) is True
    _, _, grad_bonus = _run(bonus, logits, inputs, 1.0)
    _, _, grad_plain = _run(PolicyLoss(LossConfig()), logits, inputs, 1.0)
    assert bonus.seen.requires_grad
    assert not torch.allclose(grad_bonus, grad_plain)  # the bonus's term reaches the logits
