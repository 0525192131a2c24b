"""Outcome reward: is the final ``\\boxed{}`` answer equivalent to the ground truth?

The check is math-verify (LaTeX/expression parsing into SymPy, then equivalence), run in
a small pool of worker processes so that a pathological expression (``(10^{9})!`` makes
SymPy compute a factorial of a billion) cannot hang a run: each check has a wall-clock
limit, and a worker that passes it is killed and replaced; the answer scores 0. A new
worker imports math-verify before it reports ready, and that wait (``start_timeout_s``)
is not part of any check's limit, so a loaded machine does not score a right answer 0.
math-verify's own timeouts use ``signal.alarm``, which works only in a main thread and
cannot stop a C-level loop, so they are switched off in favour of the kill.

Works from any thread and from asyncio (:meth:`MathVerifier.ascore`).

``reward.function=module:callable`` replaces the math-verify check by your own function, run in
the same workers with the same time limit (no package edit; :mod:`megatron_tir.import_path`)::

    def score(answer: str | None, ground_truth: str) -> float: ...

``answer`` is the trajectory's final answer as the protocol extracted it (the last ``\\boxed{}``
or what ``final_answer()`` printed; None when there is none), ``ground_truth`` the data row's
``reward_model.ground_truth``; the result (a float or a bool) is the trajectory's reward. A
function that raises, returns a non-finite number or passes the limit scores 0 (logged).
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    timeout_s: float = 10.0  # wall-clock limit of one check (parse + verify)
    workers: int = 2  # answer-checking worker processes
    start_timeout_s: float = 300.0  # a new worker's imports (not counted in timeout_s)
    float_rounding: int = 6  # decimals numbers are rounded to before they are compared
    # your reward instead of math-verify: "module:callable", called as fn(answer, ground_truth) -> float
    # (docs/extending.md); None: math-verify equivalence (1 or 0)
    function: str | None = None

    def __post_init__(self) -> None:
        if self.function is not None:
            from megatron_tir.import_path import load_object

            load_object(self.function, "reward.function")  # it imports here, at the edge that received it
        if not self.timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {self.timeout_s}")
        if self.workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {self.workers}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"reward start_timeout_s must be > 0, got {self.start_timeout_s}")


def _boxed(expr: str) -> str:
    return "\\boxed{" + expr + "}"


def verify_answer(answer: str, ground_truth: str, float_rounding: int = 6) -> bool:
    """The math-verify check itself, without a time limit (runs inside a worker)."""
    import logging as _logging

    from math_verify import parse, verify

    _logging.getLogger("math_verify").setLevel(_logging.ERROR)
    gold = parse(_boxed(ground_truth), parsing_timeout=None)
    pred = parse(_boxed(answer), parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, float_rounding=float_rounding, timeout_seconds=None))


def _worker_main(conn, function: str | None = None) -> None:  # pragma: no cover - runs in a child process
    import logging as _logging

    _logging.disable(_logging.WARNING)  # math-verify warns that its timeouts are off
    if function is None:
        import math_verify  # noqa: F401 - imported before "ready", so no check pays for it

        def check(answer, truth, rounding):
            return ("ok", verify_answer(answer, truth, rounding))
    else:
        from megatron_tir.import_path import load_object

        fn = load_object(function, "reward.function")

        def check(answer, truth, rounding):
            return ("value", fn(answer, truth))

    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        answer, truth, rounding = msg
        try:
            conn.send(check(answer, truth, rounding))
        except Exception as exc:  # a parse/verify error is a wrong answer, with a note
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, ctx, function: str | None = None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, function), daemon=True,
                                name="math-verify" if function is None else "reward")
        self.proc.start()
        child.close()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait for the worker's imports; False if it did not report ready in time."""
        try:
            return self.conn.poll(timeout_s) and self.conn.recv()[0] == "ready"
        except (EOFError, OSError):
            return False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(2)
        if self.proc.is_alive():
            self.kill()
        else:
            self.conn.close()


@dataclass(kw_only=True, slots=True)
class Verdict:
    correct: bool
    timed_out: bool = False
    error: str | None = None
    seconds: float = 0.0
    value: float | None = None  # reward.function's result (None: math-verify's 1 or 0)

    @property
    def failed(self) -> bool:
        """The check itself failed (a time-out, a crashed worker, an error of math-verify or of
        ``reward.function``), not the answer: ZeroTIR's ``rule_eval_fails`` (``--use_eval_filter``)."""
        return self.timed_out or (self.error is not None and self.error != "no final answer")

    @property
    def reward(self) -> float:
        if self.value is not None:
            return self.value
        return 1.0 if self.correct else 0.0


def _function_verdict(function: str, value, seconds: float) -> Verdict:
    """``reward.function``'s result as a verdict: a finite number (a bool is 1 or 0), else 0 with an error."""
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        log.warning("reward.function %s returned %.80r (not a finite number); scored 0", function, value)
        return Verdict(correct=False, error=f"reward.function returned {value!r}", seconds=seconds, value=0.0)
    return Verdict(correct=value > 0, seconds=seconds, value=float(value))


class MathVerifier:
    """A pool of math-verify worker processes with a per-check time limit (or of ``reward.function``'s).

    Use as a context manager (or call :meth:`close`). Workers start lazily.
    """

    def __init__(self, config: RewardConfig | None = None) -> None:
        self.config = config or RewardConfig()
        self._ctx = mp.get_context("spawn")  # no fork of a threaded parent
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._slots = threading.Semaphore(self.config.workers)
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._closed = False

    def _acquire(self) -> _Worker:
        self._slots.acquire()
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            w = _Worker(self._ctx, self.config.function)
            with self._lock:
                self._all.add(w)
            if not w.wait_ready(self.config.start_timeout_s):
                self._discard(w)
                self._slots.release()
                raise RuntimeError(f"a math-verify worker did not start within {self.config.start_timeout_s:g} s") from None
            return w

    def _release(self, w: _Worker | None) -> None:
        if w is not None:
            self._idle.put(w)
        self._slots.release()

    def _discard(self, w: _Worker) -> None:
        with self._lock:
            self._all.discard(w)
        w.kill()

    def check(self, answer: str | None, ground_truth: str) -> Verdict:
        """Blocking check; ``answer=None`` (no final answer) is wrong without a check."""
        if self._closed:
            raise RuntimeError("MathVerifier is closed")
        if self.config.function is None and (answer is None or not answer.strip()):
            return Verdict(correct=False, error="no final answer")
        t0 = time.perf_counter()
        w = self._acquire()
        try:
            w.conn.send((answer, ground_truth, self.config.float_rounding))
            if not w.conn.poll(self.config.timeout_s):
                log.warning("math-verify check timed out after %.1f s (answer %.80r); worker killed",
                            self.config.timeout_s, answer)
                self._discard(w)
                w = None
                return Verdict(correct=False, timed_out=True, seconds=time.perf_counter() - t0)
            kind, value = w.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            log.warning("math-verify worker died (%s); answer scored 0", exc)
            self._discard(w)
            w = None
            return Verdict(correct=False, error=f"worker died: {exc}", seconds=time.perf_counter() - t0)
        finally:
            self._release(w)
        dt = time.perf_counter() - t0
        if kind == "ok":
            return Verdict(correct=bool(value), seconds=dt)
        if kind == "value":
            return _function_verdict(self.config.function, value, dt)
        if self.config.function is not None:
            log.warning("reward.function %s raised %s; scored 0", self.config.function, value)
        return Verdict(correct=False, error=value, seconds=dt)

    async def acheck(self, answer: str | None, ground_truth: str) -> Verdict:
        return await asyncio.to_thread(self.check, answer, ground_truth)

    def score(self, answer: str | None, ground_truth: str) -> float:
        return self.check(answer, ground_truth).reward

    async def ascore(self, answer: str | None, ground_truth: str) -> float:
        return (await self.acheck(answer, ground_truth)).reward

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers = list(self._all)
            self._all.clear()
        for w in workers:
            w.stop()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
