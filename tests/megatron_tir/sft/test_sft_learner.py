"""The sft step through the real learner: feedback tokens weigh exactly zero, the loss is the mean NLL of
the model's tokens (a transformers forward as the reference), and it falls over a few steps."""

from __future__ import annotations

import pytest
import torch

from megatron_tir.policy.learner_config import LearnerConfig
from megatron_tir.policy.losses import NLLLoss
from megatron_tir.sft.examples import Example
from megatron_tir.sft.loop import sft_batch


@pytest.fixture(scope="module")
def parallel():
    from megatron_tir.policy.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


def _learner():
    from megatron_tir.policy.learner import Learner

    return Learner(LearnerConfig(model="tiny-qwen2", lr=1e-3, max_tokens_per_microbatch=64))


def _weights(learner) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in learner.hf_weights(1 << 30) for n, t in bucket}


def _examples(seed: int = 0, trailing_feedback: tuple[int, ...] = (11, 12, 13)) -> list[Example]:
    """Three trajectories: model turn, feedback, model turn; the last ends on feedback (its ids reach no later token)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return tuple(int(x) for x in torch.randint(3, 40000, (n,), generator=g))
    rows = []
    for p, m1, f, m2 in ((5, 6, 4, 3), (3, 4, 6, 5), (4, 5, 3, 0)):
        response = ids(m1) + ids(f) + ids(m2)
        mask = (1,) * m1 + (0,) * f + (1,) * m2
        rows.append(Example(prompt_ids=ids(p), response_ids=response, loss_mask=mask, where=f"row{len(rows)}"))
    last = rows[-1]
    rows[-1] = Example(prompt_ids=last.prompt_ids, response_ids=last.response_ids + trailing_feedback,
                       loss_mask=last.loss_mask + (0,) * len(trailing_feedback), where=last.where)
    return rows


def _hf_mean_nll(learner, batch) -> float:
    """-mean log p(token | before) over the loss mask, from transformers on the learner's exported weights."""
    from transformers import AutoModelForCausalLM

    from megatron_tir.model_sources import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float32).eval()
    model.load_state_dict(_weights(learner), strict=False)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for b in range(batch.tokens_BT.shape[0]):
            n = int(batch.attention_mask_BT[b].sum())
            logp = torch.log_softmax(model(batch.tokens_BT[b:b + 1, :n]).logits[0].float(), dim=-1)
            lp = logp[:-1].gather(1, batch.tokens_BT[b, 1:n, None])[:, 0]
            mask = batch.loss_mask_BT[b, 1:n]
            total += float(-(lp * mask).sum())
            count += float(mask.sum())
    return total / count


def test_feedback_tokens_get_exactly_zero_weight(parallel):
    batch = sft_batch(_examples())
    # the batch's loss mask is the trajectories' mask after each prompt: zero on every feedback token
    for b, e in enumerate(_examples()):
        p = len(e.prompt_ids)
        assert batch.loss_mask_BT[b, p:e.length].tolist() == list(e.loss_mask)
        assert batch.loss_mask_BT[b, :p].sum() == 0
    a, b_, c = _learner(), _learner(), _learner()
    reference = _hf_mean_nll(a, batch)  # before the step: the weights the loss was computed with
    got = a.train_step(batch, NLLLoss())
    assert got.loss == pytest.approx(reference, rel=1e-5)  # the mean over the model's tokens, nothing else
    # other ids in the trailing feedback (they condition nothing later): the same loss, gradient and update
    other = b_.train_step(sft_batch(_examples(trailing_feedback=(30001, 30002, 30003))), NLLLoss())
    assert (other.loss, other.grad_norm) == (got.loss, got.grad_norm)
    wa, wb = _weights(a), _weights(b_)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    # control: the same rows with the feedback in the loss give another update
    full = sft_batch(_examples())
    full.loss_mask_BT = full.attention_mask_BT.float()
    full.loss_mask_BT[:, 0] = 0
    changed = c.train_step(full, NLLLoss())
    assert changed.grad_norm != got.grad_norm
    wc = _weights(c)
    assert any(not torch.equal(wa[n], wc[n]) for n in wa)


def test_the_loss_falls_over_a_few_steps(parallel):
    learner = _learner()
    batch = sft_batch(_examples(seed=1))
    losses = [learner.train_step(batch, NLLLoss()).loss for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05, losses
