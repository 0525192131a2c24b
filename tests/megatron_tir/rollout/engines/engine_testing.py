"""Helpers shared by the engine tests: run a coroutine, wait for a condition, reference log-probs from a plain
forward pass."""

from __future__ import annotations

import asyncio

import torch


def run(coro, timeout: float = 120.0):
    """Run one coroutine to completion on a fresh event loop (no pytest-asyncio needed)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(condition, what: str, timeout_s: float = 60, poll_s: float = 0.005) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` after ``timeout_s`` (a generous bound: tests
    wait for the state itself, not for a fixed time a loaded machine may overrun)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(poll_s)


async def until_sampling(engine, tokens: int = 1, timeout_s: float = 60) -> None:
    """Until a request a LocalEngine holds has sampled ``tokens`` tokens and is not finished: a pause then
    lands mid-request, however fast or loaded the machine (a fixed sleep raced both)."""
    await until(lambda: any(len(r.token_ids) >= tokens and r.finish is None for r in list(engine._live)),
                f"a request sampling {tokens} token(s)", timeout_s, poll_s=0.001)


def reference_logprobs(model, prompt_ids, token_ids, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``token_ids`` from ONE plain forward pass over prompt + generated ids."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1).gather(1, torch.tensor(token_ids)[:, None]).squeeze(1)


def protocol_mismatches(cls: type, protocol: type) -> list[str]:
    """How ``cls`` departs from ``protocol``'s methods: missing ones, sync vs async, and
    signatures that differ in parameter names, kinds or defaults (annotations are not compared)."""
    import inspect

    problems = []
    for name, member in vars(protocol).items():
        if isinstance(member, property) and not hasattr(cls, name):
            problems.append(f"{cls.__name__}.{name} is missing")
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        impl = getattr(cls, name, None)
        if impl is None:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        if inspect.iscoroutinefunction(impl) != inspect.iscoroutinefunction(member):
            problems.append(f"{cls.__name__}.{name}: async/sync differs from the protocol")

        def shape(fn):
            return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

        if shape(impl) != shape(member):
            problems.append(f"{cls.__name__}.{name}{inspect.signature(impl)} != protocol {inspect.signature(member)}")
    return problems
