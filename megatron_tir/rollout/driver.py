"""The asynchronous multi-turn TIR rollout driver.

Every trajectory is an asyncio task; many are in flight at once (``max_in_flight``).
A trajectory alternates model turns and tool calls:

1. **Turn**: generate from ``prompt + response so far`` (token ids) with the stop strings
   of :func:`megatron_tir.tir.stop_strings`; a pause that is not a turn end (an opening
   fence, a closed non-Python block) continues with a new request extending the same ids
   (see :mod:`megatron_tir.tir.markup` for why and what it costs). The turn is then
   classified by :func:`megatron_tir.tir.classify_turn`.
2. **Void** turn: with ``void_turn="stop"`` the trajectory stops, status ``void``
   (SimpleTIR: excluded from the policy loss, still counted in its group's reward
   statistics); with ``"continue"`` nothing is appended and the next turn follows (the
   void turn stays in ``Trajectory.turns`` for the metrics).
   **Answer** turn: the trajectory is complete.
   **Code** turn: the code (with the protocol's ``final_answer`` prelude) goes to the
   sandbox; while it runs, the engine keeps serving the other trajectories -- there is no
   per-turn barrier. The feedback text is tokenized and appended as ids with loss mask 0.
   A code turn that also gives a final answer ends the trajectory after its feedback.
3. Budgets: ``max_turns`` model turns and ``max_response_tokens`` response tokens (model
   and feedback tokens together) per trajectory. ``tools=False``: one text-only turn (no
   code stop strings, nothing executed), an answer or void.

What a turn *is*, the prompt, the program, the feedback text and the answer the reward
checks come from the protocol preset (``RolloutConfig.protocol``, see
:mod:`megatron_tir.tir.protocol`).

Tool calls go through the tools of ``RolloutConfig.toolset`` (:mod:`megatron_tir.rollout.tools`:
the Python sandbox tool, and any registered one): the turn ends at the first complete
call of any of them, the call runs asynchronously, and its feedback is appended. A
failed call is a recorded outcome: the model's errors, timeouts and memory kills become
feedback; an infrastructure failure (the sandbox's ``sandbox_error``, ``overloaded``
after the client's retries, or an exception from its client) ends the trajectory with
status ``tool_failed``. A prompt the engine refuses as longer than its context
(``ContextTooLong``) is a data error, not an infrastructure failure: status ``prompt_too_long``
(one warning per prompt, naming its row); a later turn's context refused is ``truncated``.
What is trained is exactly what was sampled: response ids are the
engine's ids, in order, with the engine's log-probs and the weight version that sampled
each of them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_tir.data.problems import Problem
from megatron_tir.rollout.batch import Group
from megatron_tir.rollout.engines.base import ContextTooLong, FinishReason, GenerationEngine, SamplingParams
from megatron_tir.rollout.routing_trace import RoutingTrace
from megatron_tir.rollout.sandbox import Sandbox
from megatron_tir.rollout.tools.base import FeedbackContext, Tool, ToolResult
from megatron_tir.rollout.tools.registry import ToolContext, build_tools, check_toolset
from megatron_tir.rollout.trajectory import FinishStatus, ToolCall, Trajectory, Turn
from megatron_tir.tir import FeedbackConfig, PromptConfig, TurnKind
from megatron_tir.tir.calls import PYTHON
from megatron_tir.tir.protocol import ProtocolName, TIRProtocol, make_protocol
from sandbox_cluster.protocol import MAX_MEMORY_MB, MAX_TIMEOUT_S

log = logging.getLogger(__name__)

VOID_TURN_MODES = ("stop", "continue")
MIN_TOOL_MEMORY_MB = 16  # the sandbox's floor (sandbox_cluster.protocol.decode_request)


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    n_samples: int = 1  # trajectories per prompt (the GRPO group size)
    max_turns: int = 5  # model turns per trajectory (tools=False: always one)
    max_response_tokens: int = 16384  # model + feedback tokens, all turns
    max_turn_tokens: int | None = None  # model tokens of one turn (SimpleTIR's release: 8000); None: no cap
    temperature: float = 1.0  # sampling temperature of the rollouts
    top_p: float = 1.0  # nucleus sampling (1: off)
    top_k: int = -1  # top-k sampling (-1: off)
    seed: int = 0  # per-request seeds derive from (seed, group_id, sample_index)
    max_in_flight: int = 64  # trajectories running at once
    tool_timeout_s: float = 10.0  # wall-clock limit of one code execution in the sandbox
    tool_memory_mb: int = 1024  # memory limit of one code execution
    stop_on_tool_answer: bool = True  # a final answer printed by the tool completes the trajectory
    # "default" (this project's protocol) | "simpletir" (the released SimpleTIR code's prompt,
    # feedback, turn rules and answer extraction; see megatron_tir.tir.simpletir).
    protocol: str = "default"
    # "stop": a void turn ends the trajectory (status void, excluded from the policy loss);
    # "continue": the void turn gets no feedback and the trajectory goes on (the naive mode).
    void_turn: str = "stop"
    # the engine's MoE routing of every token, carried with the trajectory (rollout.routing_trace)
    routed_experts: bool = False
    tools: bool = True  # False: text-only, one turn, no code stop strings, nothing executed
    toolset: tuple[str, ...] = (PYTHON,)  # the tools a turn may call (megatron_tir.rollout.tools.registry)
    prompt: PromptConfig = field(default_factory=PromptConfig)  # protocol "default" only
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)  # protocol "default" only

    def __post_init__(self) -> None:
        for name in ("n_samples", "max_turns", "max_response_tokens", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1 (or null), got {self.max_turn_tokens}")
        # The sampling bounds live with SamplingParams; check them there, once.
        SamplingParams(max_new_tokens=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        if not 0 < self.tool_timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"tool_timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {self.tool_timeout_s}")
        if not MIN_TOOL_MEMORY_MB <= self.tool_memory_mb <= MAX_MEMORY_MB:
            raise ValueError(f"tool_memory_mb must be in [{MIN_TOOL_MEMORY_MB}, {MAX_MEMORY_MB}], "
                             f"got {self.tool_memory_mb}")
        try:
            self.protocol = ProtocolName(self.protocol).value
        except ValueError:
            raise ValueError(f"protocol must be one of {[p.value for p in ProtocolName]}, "
                             f"got {self.protocol!r}") from None
        if self.void_turn not in VOID_TURN_MODES:
            raise ValueError(f"void_turn must be one of {VOID_TURN_MODES}, got {self.void_turn!r}")
        if not isinstance(self.tools, bool):
            raise ValueError(f"tools must be true or false, got {self.tools!r}")
        self.toolset = check_toolset(self.toolset)
        if self.protocol == ProtocolName.SIMPLETIR.value:
            changed = [name for name, default in (("prompt", PromptConfig()), ("feedback", FeedbackConfig()))
                       if getattr(self, name) != default]
            if changed:
                raise ValueError(f"rollout.{changed[0]} settings apply to protocol 'default' only; "
                                 "protocol 'simpletir' uses SimpleTIR's own")

    def make_protocol(self) -> TIRProtocol:
        return make_protocol(self.protocol, tools=self.tools, prompt=self.prompt, feedback=self.feedback)


@dataclass(kw_only=True, slots=True)
class _TurnResult:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]  # weight version that sampled each id
    finish: FinishReason
    text: str
    requests: int
    seconds: float
    error: str | None = None  # the engine request raised (finish is ABORT)
    too_long: bool = False  # ... because the context does not fit the engine's (ContextTooLong: a data error)
    discarded: int = 0  # sampled tokens past the closing fence, dropped (0 unless an engine missed a stop)


class TIRRollout:
    """Runs TIR trajectories against a generation engine and a sandbox.

    ``tokenizer`` decodes sampled ids (to read the turn's text) and encodes feedback;
    ``verifier`` (a :class:`~megatron_tir.reward.MathVerifier`) scores finished
    trajectories when given, else ``reward`` stays None. ``config.protocol`` picks the
    preset (:mod:`megatron_tir.tir.protocol`) that reads and answers the text.
    """

    def __init__(self, engine: GenerationEngine, tokenizer, sandbox: Sandbox | None, config: RolloutConfig,
                 verifier=None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.sandbox = sandbox
        self.config = config
        self.protocol = config.make_protocol()
        self.verifier = verifier
        context = ToolContext(sandbox=sandbox, protocol=self.protocol, config=config)
        self.tools: list[Tool] = build_tools(config.toolset, context) if config.tools else []
        self._tools = {t.name: t for t in self.tools}
        self._too_long_reported: set[tuple] = set()  # prompts already named in a data-error warning

    # ------------------------------------------------------------------ batch API

    async def run(self, problems: Sequence[Problem], *, group_id_offset: int = 0,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Group]:
        """``n_samples`` trajectories per problem, all in flight together; one Group per problem."""
        cfg = self.config
        prompts = [self.protocol.prompt_ids(p.messages, self.tokenizer) for p in problems]
        slots = asyncio.Semaphore(cfg.max_in_flight)

        async def one(i: int, s: int) -> Trajectory:
            t0 = time.perf_counter()
            async with slots:
                queued = time.perf_counter() - t0
                traj = await self.run_trajectory(prompts[i], group_id=group_id_offset + i, sample_index=s,
                                                 problem=problems[i])
            traj.timings.queued_s = queued
            if on_done is not None:
                on_done(traj)
            return traj

        tasks = [[asyncio.create_task(one(i, s)) for s in range(cfg.n_samples)] for i in range(len(problems))]
        try:
            groups = []
            for i, row in enumerate(tasks):
                groups.append(Group(group_id=group_id_offset + i, problem=problems[i],
                                    trajectories=list(await asyncio.gather(*row))))
            return groups
        finally:
            for row in tasks:
                for t in row:
                    t.cancel()

    # ------------------------------------------------------------------ one trajectory

    async def run_trajectory(self, prompt_ids: Sequence[int], *, group_id: int, sample_index: int,
                             problem: Problem | None = None) -> Trajectory:
        cfg = self.config
        proto = self.protocol
        traj = Trajectory(group_id=group_id, sample_index=sample_index, prompt_ids=list(prompt_ids),
                          problem_index=problem.index if problem else -1,
                          data_source=problem.data_source if problem else "",
                          ground_truth=problem.ground_truth if problem else "")
        rng = random.Random(f"{cfg.seed}/{group_id}/{sample_index}")
        t_start = time.perf_counter()
        answers: list[tuple[str, str]] = []  # (answer, source) in the order they appeared
        max_turns = cfg.max_turns if cfg.tools else 1
        trace = RoutingTrace() if cfg.routed_experts else None  # the engine's routing of every position

        for turn_index in range(max_turns):
            budget = cfg.max_response_tokens - len(traj.response_ids)
            if budget <= 0:
                traj.status = FinishStatus.TRUNCATED
                break
            if cfg.max_turn_tokens is not None:  # a turn cut by its own cap is classified like any cut turn
                budget = min(budget, cfg.max_turn_tokens)
            context = traj.prompt_ids + traj.response_ids
            # The prompt may end inside the first turn (PromptConfig.response_prefix, e.g. an
            # opened code block): that text is parsed as the start of turn 0.
            prefix = proto.response_prefix if turn_index == 0 else ""
            tr = await self._generate_turn(context, budget, rng, prefix, route_key=f"{group_id}/{sample_index}",
                                           trace=trace)
            traj.engine_requests += tr.requests
            traj.timings.generation_s += tr.seconds
            cls = proto.classify(prefix + tr.text, tr.finish, self.tools)
            reason = cls.reason if tr.error is None else f"engine error: {tr.error}"
            turn = Turn(index=turn_index, kind=cls.kind, reason=reason, finish_reason=tr.finish,
                        start=len(traj.response_ids), model_tokens=len(tr.ids), text=tr.text, code=cls.code,
                        answer=cls.answer, requests=tr.requests, generation_s=tr.seconds,
                        discarded_tokens=tr.discarded)
            traj.append_model_tokens(tr.ids, tr.logprobs, tr.versions)
            traj.turns.append(turn)
            if cls.answer is not None:
                answers.append((cls.answer, "model"))

            if tr.too_long:  # the engine refused the context: a data error, not the infrastructure's
                traj.status = self._context_refused(traj, turn_index, tr.error)
                break
            if tr.finish is FinishReason.ABORT:  # not the model's doing, whatever the text holds
                traj.status = FinishStatus.ABORTED
                break
            if cls.kind is TurnKind.VOID and not cfg.tools:
                # text-only (Table 1's zero-RL baseline): with no tool to call, a turn without an
                # answer is a wrong answer (reward 0) in every mode, not a void turn
                traj.status = FinishStatus.TRUNCATED if tr.finish is FinishReason.LENGTH else FinishStatus.COMPLETED
                break
            if cls.kind is TurnKind.VOID:
                if cfg.void_turn == "stop":
                    traj.status, traj.void_reason = FinishStatus.VOID, cls.reason
                    break
                continue  # the naive mode: no feedback, the next turn follows
            if cls.kind is TurnKind.ANSWER:
                traj.status = FinishStatus.TRUNCATED if tr.finish is FinishReason.LENGTH else FinishStatus.COMPLETED
                break

            # A tool call: run it while the engine serves the other trajectories.
            tool, result = await self._execute(cls.tool, cls.code)
            turn.tool = tool
            traj.timings.tool_s += tool.latency_s
            if tool.infra_failure:
                traj.status = FinishStatus.TOOL_FAILED
                break
            tool.answer = self._tools[cls.tool].answer(result)
            if tool.answer is not None:
                answers.append((tool.answer, "tool"))
            feedback = self._tools[cls.tool].feedback(result, FeedbackContext(turn_index=turn_index,
                                                                              max_turns=max_turns, turn_text=tr.text))
            fb_ids = list(self.tokenizer.encode(feedback, add_special_tokens=False)) if feedback else []
            fits = len(traj.response_ids) + len(fb_ids) <= cfg.max_response_tokens
            if fits:
                traj.append_feedback_tokens(fb_ids)
                turn.feedback_tokens = len(fb_ids)
                tool.feedback = feedback
            if cls.final or (tool.answer is not None and cfg.stop_on_tool_answer):
                traj.status = FinishStatus.COMPLETED
                break
            if not fits:
                traj.status = FinishStatus.TRUNCATED
                break
        else:
            traj.status = FinishStatus.MAX_TURNS

        if trace is not None:
            traj.routed_experts = trace.rows()
        response_text = self.tokenizer.decode(traj.response_ids, skip_special_tokens=True)
        traj.final_answer, traj.answer_source = proto.final_answer(answers, response_text)
        if self.verifier is not None and traj.ground_truth:
            t0 = time.perf_counter()
            verdict = await self.verifier.acheck(traj.final_answer, traj.ground_truth)
            traj.reward, traj.reward_failed = verdict.reward, verdict.failed
            traj.timings.reward_s = time.perf_counter() - t0
        traj.timings.wall_s = time.perf_counter() - t_start
        return traj

    async def _generate_turn(self, context: list[int], budget: int, rng: random.Random, prefix: str = "",
                             route_key: str | None = None, trace: RoutingTrace | None = None) -> _TurnResult:
        """Generate one model turn in phases (see megatron_tir.tir.markup) within ``budget`` tokens.

        ``prefix`` is text at the end of ``context`` that belongs to this turn's markup.
        """
        cfg = self.config
        proto = self.protocol
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        requests = 0
        seconds = 0.0
        text = ""
        error = None
        too_long = False
        discarded = 0
        while True:
            params = SamplingParams(max_new_tokens=budget - len(ids), temperature=cfg.temperature, top_p=cfg.top_p,
                                    top_k=cfg.top_k, stop=proto.stop_strings(prefix + text, self.tools),
                                    seed=rng.getrandbits(63),
                                    route_key=route_key,  # one server per trajectory: its prefix cache
                                    routed_experts_from=None if trace is None else trace.covered)
            t0 = time.perf_counter()
            try:
                gen = await self.engine.generate(context + ids, params)
            except asyncio.CancelledError:
                raise
            except ContextTooLong as exc:  # reported once per prompt by run_trajectory
                seconds += time.perf_counter() - t0
                error, finish, too_long = str(exc), FinishReason.ABORT, True
                break
            except Exception as exc:  # noqa: BLE001 - a failed request is a recorded abort, not a crash
                log.error("engine request failed: %s: %s", type(exc).__name__, exc)
                seconds += time.perf_counter() - t0
                error = f"{type(exc).__name__}: {exc}"
                finish = FinishReason.ABORT
                break
            seconds += time.perf_counter() - t0
            requests += 1
            if trace is not None:
                trace.add(gen.routed_experts, start=params.routed_experts_from)
            ids.extend(gen.token_ids)
            logprobs.extend(gen.logprobs)
            versions.extend(gen.versions)
            text = self._decode(ids)
            finish = gen.finish_reason
            if finish is not FinishReason.ABORT and proto.classify(prefix + text, finish,
                                                                   self.tools).kind is TurnKind.CODE:
                n = len(ids)
                ids, logprobs, text = self._trim_overshoot(ids, logprobs, text, prefix)
                discarded = n - len(ids)
                versions = versions[:len(ids)]
                if trace is not None:
                    trace.truncate(len(context) + len(ids))
                if discarded:
                    finish = FinishReason.STOP  # the turn ends at the fence, before what the engine ended on
                break
            if finish is not FinishReason.STOP:
                break  # EOS, LENGTH or ABORT end the turn
            if not gen.token_ids:  # an engine that stops without sampling would loop forever
                log.error("engine returned STOP with no tokens; ending the turn as aborted")
                finish = FinishReason.ABORT
                break
            if len(ids) >= budget:
                finish = FinishReason.LENGTH
                break
        return _TurnResult(ids=ids, logprobs=logprobs, versions=versions, finish=finish, text=text,
                           requests=requests, seconds=seconds, error=error, discarded=discarded, too_long=too_long)

    def _context_refused(self, traj: Trajectory, turn_index: int, why: str | None) -> FinishStatus:
        """The status of a trajectory whose context the engine refused as too long: at the first turn its
        prompt is a data error (``prompt_too_long``: never an infrastructure failure, ``rollout/status_*``
        counts it; one warning per prompt), later the response filled the context (``truncated``)."""
        if turn_index > 0:
            return FinishStatus.TRUNCATED
        key = (traj.data_source, traj.problem_index, len(traj.prompt_ids))
        if key not in self._too_long_reported:
            self._too_long_reported.add(key)
            log.warning("data error: the prompt of row %d%s (%d tokens) does not fit the engine's context (%s); "
                        "its trajectories are prompt_too_long, not infrastructure failures", traj.problem_index,
                        f" of {traj.data_source}" if traj.data_source else "", len(traj.prompt_ids), why)
        return FinishStatus.PROMPT_TOO_LONG

    def _trim_overshoot(self, ids: list[int], logprobs: list[float], text: str, prefix: str):
        """Keep the turn ending at the token that closes the code block.

        By construction of the stop strings the engine stops on that token; if an engine
        matched stops differently and ran past it, the extra tokens are dropped (and
        logged), so the turn still ends at the block.
        """
        is_code = lambda n: self.protocol.classify(  # noqa: E731
            prefix + self._decode(ids[:n]), None, self.tools).kind is TurnKind.CODE
        if len(ids) < 2 or not is_code(len(ids) - 1):
            return ids, logprobs, text
        lo, hi = 1, len(ids) - 1  # the shortest CODE prefix lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if is_code(mid):
                hi = mid
            else:
                lo = mid + 1
        log.warning("engine ran %d token(s) past a closing code fence; dropped them", len(ids) - lo)
        return ids[:lo], logprobs[:lo], self._decode(ids[:lo])

    async def _execute(self, name: str, payload: str) -> tuple[ToolCall, ToolResult]:
        """Run one call; an exception from the tool is its infrastructure's failure (recorded)."""
        t0 = time.perf_counter()
        try:
            result = await self._tools[name].execute(payload)
        except Exception as exc:  # noqa: BLE001 - a failed call is a recorded outcome
            log.warning("tool %s failed: %s: %s", name, type(exc).__name__, exc)
            result = ToolResult(status="tool_error", infra_error=f"{type(exc).__name__}: {exc}")
        call = ToolCall(result=result.record, name=name, status=result.status, infra_error=result.infra_error,
                        latency_s=time.perf_counter() - t0)
        return call, result

    def _decode(self, ids: list[int]) -> str:
        # As the engines' stop matchers see the text: special tokens kept, no clean-up.
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
