"""The engine-kind registry (``megatron_tir.rollout.factory.ENGINE_KINDS``): a kind registered from
outside the package trains a ``tiny-cpu`` step through the one weight-sync contract, and no code
outside the registry and the kinds' own files compares engine-kind names."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from megatron_tir.rollout.engines import local_kind
from megatron_tir.rollout.engines.base import EngineKind, ServerPlan
from megatron_tir.rollout.factory import ENGINE_KINDS, EngineConfig, build_weight_sync, engine_kind
from megatron_tir.rollout.sync.base import Rank0WeightSync, through_rank0
from megatron_tir.rollout.sync.local import LocalWeightSync

ROOT = Path(__file__).resolve().parents[3]


class CountingSync(LocalWeightSync):
    """The toy kind's engine sync: the LocalEngine's, counting the updates and the tensors they carried."""

    made: list[CountingSync] = []

    def __init__(self, engine, *, pause_mode) -> None:
        super().__init__(engine, pause_mode=pause_mode)
        self.updates, self.names, self.starts = 0, set(), 0
        CountingSync.made.append(self)

    async def start(self) -> None:
        self.starts += 1

    async def update(self, buckets) -> int:
        buckets = list(buckets)
        self.names |= {name for _, tensors in buckets for name, _ in tensors}
        version = await super().update(buckets)
        self.updates += 1
        return version


def toy_check(cfg: EngineConfig) -> None:
    if cfg.urls or cfg.colocated:
        raise ValueError("engine kind 'toy' runs in process: no urls, not colocated")


TOY = EngineKind(check=toy_check, where=lambda cfg: f"toy engine ({cfg.model})", settings=local_kind.settings,
                 build=local_kind.build, engine_sync=lambda cfg, engine, mode: CountingSync(engine, pause_mode=mode),
                 weight_sync=through_rank0)


@pytest.fixture
def toy_kind(monkeypatch):
    monkeypatch.setitem(ENGINE_KINDS, "toy", TOY)  # the one registry line a new kind adds
    CountingSync.made.clear()
    yield TOY


def test_an_unknown_kind_is_a_one_line_error_naming_the_registered_ones(toy_kind):
    with pytest.raises(ValueError, match=r"engine kind must be one of local, sglang, toy, got 'vllm'"):
        EngineConfig(kind="vllm")
    with pytest.raises(ValueError, match="engine kind 'toy' runs in process"):
        EngineConfig(kind="toy", urls=("http://x:1",))
    assert engine_kind("toy") is TOY and EngineConfig(kind="toy").kind == "toy"


def test_the_rank0_sync_drains_off_rank0_and_loads_on_rank0():
    class Source:
        drained = 0

        def named_hf_buckets(self, bucket_bytes: int = 1):
            for i in range(3):
                Source.drained += 1
                yield 0, [(f"w{i}", None)]

    loads = []
    assert Rank0WeightSync(None).update(Source()) is None and Source.drained == 3  # not rank 0: its part drained
    assert Rank0WeightSync(lambda source: loads.append(source) or 7).update(src := Source()) == 7 and loads == [src]
    assert Source.drained == 3  # rank 0's load reads the buckets itself (here: not at all)
    assert build_weight_sync(EngineConfig(kind="local"), None).wait_for_rank0 is False


def test_the_sglang_kind_renders_one_server_command_per_server():
    plan = ServerPlan(model_path="/m", host="127.0.0.1", first_port=30000, count=2, tp=2, mem_fraction_static=0.85,
                      colocated=False, python="py")
    got = engine_kind("sglang").servers(plan)
    assert [name for name, _ in got] == ["sglang-30000", "sglang-30001"]
    argv = got[1][1]
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert argv[argv.index("--port") + 1] == "30001" and argv[argv.index("--base-gpu-id") + 1] == "2"
    assert engine_kind("local").servers is None


@pytest.mark.slow
def test_a_toy_kind_registered_here_trains_a_tiny_cpu_step(toy_kind, tmp_path):
    from megatron_tir.cli import main

    run = tmp_path / "run"
    code = main(["train", "--recipe", "tiny-cpu", "--out", str(run), "--set", "engine.kind=toy",
                 "--set", "trainer.steps=1", "--set", "data.eval_size=0", "--set", "trainer.progress=false"])
    assert code == 0
    (sync,) = CountingSync.made
    assert sync.starts == 1 and sync.updates == 1  # one step, one sync through the toy kind's own engine sync
    assert sync.engine.weight_version == 1 and any(n.endswith("embed_tokens.weight") for n in sync.names)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r["step"] == 1)
    assert step["train/tokens"] > 0
    assert json.loads((run / "config.json").read_text())["engine"]["kind"] == "toy"


# ----------------------------------------------------------------------------- no kind compares elsewhere

KIND_FILES = {"megatron_tir/rollout/factory.py", "megatron_tir/rollout/engines/local_kind.py",
              "megatron_tir/rollout/engines/sglang/kind.py"}


def kind_compares(tree: ast.AST) -> list[int]:
    """Lines comparing something named ``kind`` (``x.kind``, ``kind``, ``x.get("kind")``) with ``==``,
    ``!=``, ``in`` or ``not in`` against an engine kind's name."""
    names = set(ENGINE_KINDS) | {"local", "sglang"}

    def is_kind(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "kind"
        if isinstance(node, ast.Name):
            return node.id == "kind"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind"
        return False

    def names_a_kind(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Constant) and n.value in names for n in ast.walk(node))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
            sides = [node.left, *node.comparators]
            if any(is_kind(s) for s in sides) and any(names_a_kind(s) for s in sides):
                found.append(node.lineno)
    return found


def test_the_check_finds_a_kind_compare():
    assert kind_compares(ast.parse('if cfg.engine.kind == "sglang": pass\nif "local" != engine.kind: pass')) == [1, 2]
    assert kind_compares(ast.parse('if given["engine"].get("kind") == "local": pass')) == [1]
    assert kind_compares(ast.parse('if msg.kind == "stop": pass\nif kind in ("auto",): pass')) == []  # not engines


def test_no_engine_kind_compare_outside_the_registry_and_the_kinds_files():
    found = []
    for path in sorted((ROOT / "megatron_tir").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in KIND_FILES:
            found += [f"{rel}:{line}" for line in kind_compares(ast.parse(path.read_text()))]
    assert found == []


def test_eval_drops_a_recipes_server_urls_for_an_in_process_kind(toy_kind):
    """``eval --recipe R --engine K``: the recipe's SGLang URLs are dropped for a kind with no servers."""
    from megatron_tir.eval import cli as eval_cli
    from megatron_tir.eval.recipes import EVAL_RECIPES

    from megatron_tir.cli import build_parser

    recipe = next(iter(EVAL_RECIPES))
    for kind in ("local", "toy"):
        cfg = eval_cli.config_from_args(build_parser().parse_args(["eval", "--recipe", recipe, "--engine", kind]))
        assert cfg.engine.kind == kind and cfg.engine.urls == ()
    cfg = eval_cli.config_from_args(build_parser().parse_args(["eval", "--recipe", recipe, "--engine", "sglang"]))
    assert cfg.engine.urls  # a kind with servers keeps the recipe's
