"""Weight versions checked against the weights themselves (LocalEngine and fake SGLang tests).

A token's recorded version is right when its engine log-prob equals a plain transformers
forward pass under that version's weights, and not under any other version's.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def weight_sets(model_dir, n: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's own weights, then ``n - 1`` perturbed copies."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = [(k, v.clone()) for k, v in model.state_dict().items()]
    out = [base]
    for seed in range(1, n):
        g = torch.Generator().manual_seed(seed)
        out.append([(k, v * (1 + 0.3 * torch.randn(v.shape, generator=g))) for k, v in base])
    return out


def logprobs_under(model_dir, weights, tokens_BT, attention_mask_BT) -> torch.Tensor:
    """Column t = log p(token t | tokens < t) from one forward pass per row under ``weights``."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(dict(weights))
    out = torch.zeros(tokens_BT.shape)
    with torch.no_grad():
        for b in range(tokens_BT.shape[0]):
            n = int(attention_mask_BT[b].sum())
            logp = torch.log_softmax(model(tokens_BT[b:b + 1, :n]).logits[0].float(), dim=-1)
            out[b, 1:n] = logp[:-1].gather(1, tokens_BT[b, 1:n, None])[:, 0]
    return out


def check_versions_against_weights(batch, model_dir, sets) -> None:
    """Every trained token's version is the one whose weights give its engine log-prob."""
    mask = batch.loss_mask_BT > 0
    versions = batch.versions_BT
    assert (versions[mask] >= 0).all() and (versions[~mask] == -1).all()
    refs = [logprobs_under(model_dir, w, batch.tokens_BT, batch.attention_mask_BT) for w in sets]
    # how many syncs land while tokens are still being sampled depends on the machine's speed:
    # every version that sampled tokens is checked, and at least two must have
    present = [v for v in range(len(refs)) if (mask & (versions == v)).any()]
    assert len(present) >= 2, f"trained tokens sampled at versions {present} only"
    for v, ref in enumerate(refs):
        at_v = mask & (versions == v)
        if not at_v.any():
            continue
        torch.testing.assert_close(batch.engine_logprobs_BT[at_v], ref[at_v], atol=1e-4, rtol=0)
        for w, other in enumerate(refs):
            if w != v:  # the versions' weights really differ on these tokens
                assert (batch.engine_logprobs_BT[at_v] - other[at_v]).abs().max() > 1e-2
