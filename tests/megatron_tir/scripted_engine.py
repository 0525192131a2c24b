"""ScriptedEngine: a *test* engine at the engine edge, for driver-logic tests only.

It implements the GenerationEngine contract the way a real engine does -- token ids in,
ids out, stop strings matched in the generated text only (with the local engine's own
StopStringMatcher), the completing token kept, EOS appended and kept, max_new_tokens
honoured -- but its "model" is a script: ``script(context_text) -> turn_text``, the
whole text the model writes in the current turn. Tokens are the real tokenizer's
encoding of that text; a request continues from how much of it the context already
holds. Each emitted token costs ``seconds_per_token`` of asyncio sleep, so concurrency
is observable. The key rollout tests use the real LocalEngine; this one makes the rare
paths (timeouts, budgets, infra failures) deterministic.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from megatron_tir.rollout.engines.base import FinishReason, Generation, SamplingParams
from megatron_tir.rollout.engines.stop import StopStringMatcher

SCRIPTED_LOGPROB = -0.25


class ScriptedEngine:
    def __init__(self, tokenizer, script: Callable[[str], str], *, seconds_per_token: float = 0.0,
                 honor_stops: bool = True, fail_on_call: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.seconds_per_token = seconds_per_token
        self.honor_stops = honor_stops  # False: an engine whose stop matching misses (driver must cope)
        self.fail_on_call = fail_on_call  # raise on this call index (a server error)
        self.eos_token_ids = (tokenizer.eos_token_id,)
        self.calls: list[dict] = []  # every request: prompt length, params, output, timing
        self.weight_version = 0  # a script has no weights; a test may set it

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            self.calls.append({"failed": True})
            raise RuntimeError("scripted server error")
        context = list(prompt_ids)
        text = self.script(self.tokenizer.decode(context, skip_special_tokens=False))
        turn_ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos_token_ids[0]]
        done = 0  # how many of turn_ids the context already ends with
        for k in range(min(len(turn_ids), len(context)), 0, -1):
            if context[-k:] == turn_ids[:k]:
                done = k
                break
        matcher = StopStringMatcher(self.tokenizer, params.stop if self.honor_stops else ())
        out: list[int] = []
        finish, matched = FinishReason.LENGTH, None
        for tok in turn_ids[done:]:
            out.append(tok)
            if tok in self.eos_token_ids:
                finish = FinishReason.EOS
                break
            if matcher and (matched := matcher.check(out)) is not None:
                finish = FinishReason.STOP
                break
            if len(out) >= params.max_new_tokens:
                finish = FinishReason.LENGTH
                break
        await asyncio.sleep(self.seconds_per_token * len(out))
        self.calls.append({"prompt_len": len(context), "stop": params.stop, "max_new_tokens": params.max_new_tokens,
                           "token_ids": list(out), "finish": finish, "t_start": t0, "t_end": time.perf_counter()})
        return Generation(token_ids=out, logprobs=[SCRIPTED_LOGPROB] * len(out), finish_reason=finish,
                          matched_stop=matched, prompt_tokens=len(context), versions=[self.weight_version] * len(out))

    async def close(self) -> None:
        pass
