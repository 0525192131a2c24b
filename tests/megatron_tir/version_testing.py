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


def check_partial_rollout(out, reference, prompt: list[int], model_dir, old_weights, new_weights, *,
                          old: str | int, new: str | int) -> int:
    """The contract of a request interrupted by a weight sync (retract pause): its tokens are the
    tokens sampled before the pause -- exactly what the old weights sample uninterrupted
    (``reference``, same seed) -- followed by the tokens sampled after it, none lost, duplicated or
    re-tokenised; every log-prob is, column by column, the one of its version's weights over the
    same ids; it ends as the uninterrupted one would (not ABORT). Returns the pause's token index."""
    from megatron_tir.rollout.engines.base import FinishReason

    spans = out.meta["weight_versions"]
    assert [s["version"] for s in spans] == [old, new], spans
    k = spans[0]["end"]
    assert spans[0]["start"] == 0 and spans[1]["start"] == k and spans[1]["end"] == len(out.token_ids)
    assert 0 < k < len(out.token_ids), "the sync did not land inside the request"
    assert out.finish_reason is not FinishReason.ABORT and out.finish_reason is reference.finish_reason
    assert out.token_ids[:k] == reference.token_ids[:k]  # before the pause: what the old weights sample
    torch.testing.assert_close(torch.tensor(out.logprobs[:k]), torch.tensor(reference.logprobs[:k]), atol=1e-4, rtol=0)
    ids = torch.tensor([list(prompt) + list(out.token_ids)])
    mask = torch.ones_like(ids)
    p = len(prompt)
    before = logprobs_under(model_dir, old_weights, ids, mask)[0, p:]
    after = logprobs_under(model_dir, new_weights, ids, mask)[0, p:]
    got = torch.tensor(out.logprobs)
    torch.testing.assert_close(got[:k], before[:k], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[k:], after[k:], atol=1e-4, rtol=0)  # the continuation: new weights, same columns
    assert (got[k:] - before[k:]).abs().max() > 1e-2  # and the weights really differ there
    return k
