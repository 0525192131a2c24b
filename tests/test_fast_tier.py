"""The fast tier's rule (``fast_tier.py``): what it calls heavy, and its guard."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from fast_tier import HEAVY_CALLABLES, _heavy, forbid_heavy


def _runs_a_process():
    return subprocess.run([sys.executable, "-c", "pass"], check=True)


def _calls_a_helper_that_runs_one():
    return _runs_a_process()


def _imports_run_ranks_inside():
    from megatron_tir.policy.parallel import run_ranks

    return run_ranks


def _names_smollm2():
    return {"model": "smollm2"}


def _pure(x):
    return sorted(x)[:2]


def test_every_heavy_callable_exists():
    """A renamed entry point would leave the rule blind to it without a word."""
    for name in HEAVY_CALLABLES:
        module, _, attr = name.rpartition(".")
        obj = getattr(importlib.import_module(module), attr)
        assert f"{obj.__module__}.{obj.__qualname__}" == name


def test_what_the_rule_calls_heavy():
    assert _heavy(_runs_a_process)
    assert _heavy(_calls_a_helper_that_runs_one)  # through a helper under tests/
    assert _heavy(_imports_run_ranks_inside)  # a production entry point imported in the function
    assert _heavy(_names_smollm2)
    assert not _heavy(_pure)


def test_the_guard_refuses_a_process_and_records_one_in_a_thread():
    import threading

    with forbid_heavy() as refused:
        with pytest.raises(pytest.fail.Exception, match="started a process"):
            _runs_a_process()
        t = threading.Thread(target=lambda: pytest.raises(pytest.fail.Exception, _runs_a_process))
        t.start()
        t.join()
    assert refused == ["started a process (subprocess.Popen)"]
    assert _runs_a_process().returncode == 0  # and nothing is left patched
