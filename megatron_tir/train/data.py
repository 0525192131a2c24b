"""Where a run's prompts come from: a resumable training stream and a fixed held-out set.

The training stream is a pure function of its position (prompts drawn so far): the
generated tasks (``arithmetic``, the ``tir_mix`` family of :mod:`megatron_tir.data.tasks`)
are indexed directly; a dataset is read in a fresh seeded
permutation each epoch. Saving the position in a run checkpoint is enough to resume it; with
``trainer.async=full`` groups are consumed out of order, and the checkpoint also lists the
positions past it already consumed (``skip``: never drawn again).
"""

from __future__ import annotations

import random

from megatron_tir.data.arithmetic import HELD_OUT, TRAIN, arithmetic_problem, arithmetic_problems
from megatron_tir.data.problems import Problem
from megatron_tir.data.tasks import MIX, mix_problem, mix_problems
from megatron_tir.train.config import DataConfig

ARITHMETIC = "arithmetic"


class PromptStream:
    def __init__(self, config: DataConfig, *, position: int = 0, skip=()) -> None:
        self.config = config
        self.position = position
        self.skip = {int(p) for p in skip if int(p) >= position}  # positions past ``position`` already consumed
        self._problems: list[Problem] | None = None
        if config.train not in (ARITHMETIC, MIX):
            from megatron_tir.data import load_problems

            self._problems = load_problems(config.train)

    def _at(self, pos: int) -> Problem:
        c = self.config
        if c.train == MIX:
            return mix_problem(pos, seed=c.shuffle_seed, split=TRAIN)
        if self._problems is None:
            return arithmetic_problem(pos, seed=c.shuffle_seed, split=TRAIN, digits=c.arithmetic_digits,
                                      terms=c.arithmetic_terms)
        epoch, offset = divmod(pos, len(self._problems))
        order = list(range(len(self._problems)))
        random.Random(f"{c.shuffle_seed}/{epoch}").shuffle(order)
        return self._problems[order[offset]]

    def take(self, n: int) -> list[Problem]:
        return [self.draw()[1] for _ in range(n)]

    def draw(self) -> tuple[int, Problem]:
        """The next prompt and its position (positions in ``skip`` are passed over)."""
        while self.position in self.skip:
            self.skip.discard(self.position)
            self.position += 1
        pos = self.position
        self.position += 1
        return pos, self._at(pos)


def held_out_problems(config: DataConfig) -> list[Problem]:
    if config.eval_size == 0:
        return []
    if config.eval == MIX:
        return mix_problems(config.eval_size, seed=config.shuffle_seed, split=HELD_OUT)
    if config.eval == ARITHMETIC:
        return arithmetic_problems(config.eval_size, seed=config.shuffle_seed, split=HELD_OUT,
                                   digits=config.arithmetic_digits, terms=config.arithmetic_terms)
    from megatron_tir.data import load_problems

    return load_problems(config.eval, limit=config.eval_size)
