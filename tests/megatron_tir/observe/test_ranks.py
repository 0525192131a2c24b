"""What a command every torchrun rank runs says (megatron_tir.observe.ranks): INFO from rank 0 at the default level
(every rank at debug), bad input raised at once by rank 0 and only after the wait by another rank. The torchrun runs
themselves: test_train_e2e.py and test_sft_cli.py."""

from __future__ import annotations

import argparse
import logging
import time

import pytest

from megatron_tir.observe import ranks


@pytest.fixture
def root():
    root = logging.getLogger()
    level = root.level
    yield root
    root.setLevel(level)


@pytest.mark.parametrize("rank,level,seen", [("0", logging.INFO, logging.INFO), ("1", logging.INFO, logging.WARNING),
                                             ("1", logging.DEBUG, logging.DEBUG), ("1", logging.ERROR, logging.ERROR)])
def test_info_lines_are_rank_0s_at_the_default_level(root, monkeypatch, rank, level, seen):
    monkeypatch.setenv("RANK", rank)
    root.setLevel(level)
    assert ranks.run_on_every_rank(lambda args: args.code, argparse.Namespace(code=3)) == 3
    assert root.getEffectiveLevel() == seen


@pytest.mark.parametrize("rank,waits", [("0", False), ("1", True)])
def test_bad_input_is_raised_by_rank_0_first(root, monkeypatch, rank, waits):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(ranks, "RANK0_FIRST_S", 0.5)

    def bad(args):
        raise ValueError("rows_per_step=1 is fewer than the 2 data-parallel replicas")

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rows_per_step=1"):
        ranks.run_on_every_rank(bad, argparse.Namespace())
    assert (time.monotonic() - t0 >= 0.5) == waits
