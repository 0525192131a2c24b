"""Helpers shared by the engine tests: run a coroutine, reference log-probs from a plain forward pass."""

from __future__ import annotations

import asyncio

import torch


def run(coro, timeout: float = 120.0):
    """Run one coroutine to completion on a fresh event loop (no pytest-asyncio needed)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def reference_logprobs(model, prompt_ids, token_ids, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``token_ids`` from ONE plain forward pass over prompt + generated ids."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1).gather(1, torch.tensor(token_ids)[:, None]).squeeze(1)
