"""Prefix-cache hit rate of the SGLang client's routing, with 1 vs several servers.

Multi-turn TIR rollouts send each trajectory's context again on every turn (prompt + the
model's turns + tool feedback). A server reuses the KV of a prefix it has seen (its radix
cache; ``meta_info.cached_tokens`` says how many prompt tokens it reused), so a
continuation hits only on the server that served the trajectory's earlier turns.

Workload: ``--groups`` prompts x ``--samples`` trajectories each (the n samples of GRPO
share their prompt), ``--turns`` turns; each turn generates a random number of tokens
(time proportional to it) and gets tool feedback after a random latency. Servers: the
test suite's fake SGLang server (tests/megatron_tir/rollout/engines/fake_sglang.py),
whose radix-cache model matches prefixes the way SGLang's does (at most all but one
prompt token, no eviction). Policies:

* ``least-in-flight``: no route key (each request to the least busy server);
* ``trajectory``: ``SamplingParams.route_key`` = one key per trajectory;
* ``group``: one key per prompt group.

Reported per policy and server count: hit rate = sum(cached_tokens) / sum(prompt
tokens), and the busiest server's share of requests (balance). With one server every
policy reaches the ceiling (only first-turn prompts of new groups miss).

Run: ``python bench/bench_sglang_routing.py`` (about half a minute; ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "megatron_tir" / "rollout" / "engines"))

from fake_sglang import FakeSGLangServer  # noqa: E402
from sglang_testing import canned_response, client  # noqa: E402

from megatron_tir.rollout.engines.base import SamplingParams  # noqa: E402

POLICIES = ("least-in-flight", "trajectory", "group")


async def measure(n_servers: int, policy: str, args: argparse.Namespace) -> tuple[float, float]:
    async def answer(req, body):
        rng = random.Random(hash(tuple(req.input_ids)))
        n = rng.randint(args.min_out, args.max_out)
        await asyncio.sleep(n * args.token_s)
        return canned_response(req, ids=tuple(rng.randrange(100, 50_000) for _ in range(n)))

    servers = [FakeSGLangServer(answer) for _ in range(n_servers)]
    urls = [await s.start() for s in servers]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 50_000) for _ in range(args.prompt_tokens)] for _ in range(args.groups)]

    async with client(urls) as engine:
        async def trajectory(g: int, s: int) -> None:
            key = {"least-in-flight": None, "trajectory": f"{g}/{s}", "group": f"{g}"}[policy]
            local = random.Random(f"{args.seed}/{g}/{s}")
            context = list(prompts[g])
            await asyncio.sleep(local.random() * args.tool_s)  # trajectories start at different times
            for _ in range(args.turns):
                out = await engine.generate(context, SamplingParams(max_new_tokens=args.max_out, route_key=key,
                                                                    seed=local.getrandbits(32)))
                await asyncio.sleep(local.random() * args.tool_s)  # the sandbox runs the code
                feedback = [local.randrange(100, 50_000) for _ in range(local.randint(5, 40))]
                context = context + out.token_ids + feedback

        await asyncio.gather(*(trajectory(g, s) for g in range(args.groups) for s in range(args.samples)))
    for s in servers:
        await s.stop()
    cached = sum(c for s in servers for c, _ in s.cached_tokens)
    prompt = sum(p for s in servers for _, p in s.cached_tokens)
    counts = [len(s.cached_tokens) for s in servers]
    return cached / prompt, max(counts) / sum(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4, help="trajectories per prompt")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--min-out", type=int, default=20)
    parser.add_argument("--max-out", type=int, default=200)
    parser.add_argument("--token-s", type=float, default=2e-5, help="simulated seconds per generated token")
    parser.add_argument("--tool-s", type=float, default=0.02, help="max simulated tool latency")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    print(f"{args.groups} prompts x {args.samples} samples x {args.turns} turns; hit rate = cached / prompt tokens")
    print("| servers | policy | prefix-cache hit rate | busiest server's share of requests |")
    print("| --- | --- | --- | --- |")
    for n in args.servers:
        for policy in POLICIES:
            hit, busiest = asyncio.run(measure(n, policy, args))
            print(f"| {n} | {policy} | {hit:.3f} | {busiest:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
