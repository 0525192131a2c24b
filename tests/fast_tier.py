"""The fast tier (``pytest -m unit``, ``make test-fast``): which tests get the ``unit`` marker.

A test is *unit* unless it is marked ``slow``, ``gpu`` or ``slurm``, or it reaches something heavy:
a process (``subprocess``, ``multiprocessing``), a process group (``torch.distributed``, gloo ranks
through ``run_ranks``), the sandbox cluster, a full training run, or a model beyond the tiny random
ones (SmolLM2). "Reaches" is read from the source, not guessed from file names: the test function's
body, every helper it calls that is defined under ``tests/`` (followed transitively, also across
helper modules), and every fixture in its closure (with their helpers). Production code is not
followed: its heavy entry points are named in ``HEAVY_CALLABLES``. The rule is checked twice: by
timing (``make test-fast``, ``--durations``), and in the fast tier by :func:`forbid_heavy`, under which a
unit test that starts a process or a process group fails, naming what it started.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import multiprocessing.process
import os
import subprocess
import textwrap
import threading
import types
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
HEAVY_MARKERS = ("slow", "gpu", "slurm")
# modules whose use means a process or a process group
HEAVY_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "torch.distributed", "concurrent.futures")
# production entry points that start processes, process groups or a whole run, load SmolLM2, or cost
# seconds for another reason
HEAVY_CALLABLES = {
    "megatron_tir.policy.parallel.run_ranks",
    "megatron_tir.policy.parallel.init_parallel",  # a gloo process group, even with one rank
    "megatron_tir.launch.local.run_local",
    "megatron_tir.reward.math_verify_reward.MathVerifier",  # a spawned worker process
    "sandbox_cluster.hugepages.collapse",  # madvises the whole test process (seconds with torch loaded)
    "megatron_tir.cli.main",  # the CLI: `train` runs a trainer (a process group) in the test process
    "megatron_tir.launch.slurm.render",  # nemo-run's Slurm packaging runs commands
    "checkpoints_tools.convert.hf_to_megatron",  # these four open a (one-rank) process group
    "checkpoints_tools.convert.megatron_to_hf",
    "checkpoints_tools.reshard.reshard",
    "checkpoints_tools.verify.verify",
    "posix.fork",  # os.fork
    "megatron_tir.train.run.run_training",
    "megatron_tir.named_models.materialize_smollm2",
    "megatron_tir.rollout.factory.open_sandbox",
    "sandbox_cluster.cluster.LocalCluster",
    "sandbox_cluster.cli.main",
    "megatron_tir.launch.cli.main",
}
HEAVY_STRINGS = ("smollm2", "smollm2-cpu")  # the embedded 135M model, named in configs


def is_unit(item: pytest.Item) -> bool:
    if any(item.get_closest_marker(m) for m in HEAVY_MARKERS):
        return False
    func = getattr(item, "function", None)
    if func is None:
        return False
    if _heavy(func):
        return False
    infos = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fd in (infos.name2fixturedefs.get(name, ()) if infos else ()):
            if _heavy(fd.func):
                return False
    return True


def _under_tests(obj) -> bool:
    try:
        return Path(inspect.getsourcefile(obj) or "").resolve().is_relative_to(TESTS)
    except TypeError:
        return False


def _qualified(obj) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


_seen: dict[object, bool] = {}


def _heavy(obj) -> bool:
    """Whether ``obj`` (a function or class defined under tests/) reaches something heavy."""
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    key = getattr(obj, "__code__", obj)
    if key in _seen:
        return _seen[key]
    _seen[key] = False  # recursion guard: a cycle of helpers adds nothing
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return False
    scope = dict(getattr(obj, "__globals__", None) or vars(inspect.getmodule(obj) or types.ModuleType("_")))
    result = _heavy_tree(tree, scope)
    _seen[key] = result
    return result


def _heavy_tree(tree: ast.AST, scope: dict) -> bool:
    local = {}
    for node in ast.walk(tree):  # imports inside the function bind names too
        if isinstance(node, ast.Import):
            for a in node.names:
                if _module_heavy(a.name):
                    return True
                local[(a.asname or a.name).split(".")[0]] = _import(a.name.split(".")[0] if not a.asname else a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if _module_heavy(node.module):
                return True
            for a in node.names:
                local[a.asname or a.name] = _attr(node.module, a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in HEAVY_STRINGS:
            return True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = local.get(node.value.id, scope.get(node.value.id))
            if isinstance(base, types.ModuleType) and _object_heavy(getattr(base, node.attr, None)):
                return True
        if isinstance(node, ast.Name) and _object_heavy(local.get(node.id, scope.get(node.id))):
            return True
    return False


def _module_heavy(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in HEAVY_MODULES)


def _object_heavy(obj) -> bool:
    if obj is None:
        return False
    if isinstance(obj, types.ModuleType):
        return _module_heavy(obj.__name__)
    if not callable(obj):
        return False
    if _qualified(obj) in HEAVY_CALLABLES:
        return True
    return (inspect.isfunction(obj) or inspect.isclass(obj)) and _under_tests(obj) and _heavy(obj)


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _attr(module: str, name: str):
    mod = _import(module)
    if mod is None:
        return None
    return getattr(mod, name, None) or _import(f"{module}.{name}")


@contextlib.contextmanager
def forbid_heavy():
    """Starting a process (``subprocess``, ``multiprocessing``, ``os.fork``) or a ``torch.distributed``
    process group fails the running test; yields the list of what was refused in other threads (a
    thread may swallow the failure: the caller fails the test on it afterwards)."""
    import torch.distributed

    refused: list[str] = []

    def refuse(what: str):
        def call(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                refused.append(what)
            pytest.fail(f"a unit test {what}: the fast-tier rule (tests/fast_tier.py) should not mark it unit",
                        pytrace=False)
        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", refuse("started a process (subprocess.Popen)"))
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse("started a process (multiprocessing)"))
        mp.setattr(os, "fork", refuse("forked (os.fork)"))
        mp.setattr(torch.distributed, "init_process_group", refuse("opened a process group"))
        yield refused
