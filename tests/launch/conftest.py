"""Shared helpers of the launcher tests: the example cluster file and variants of it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

pytest.importorskip("nemo_run", reason="tir-launch needs the launch extra (pip install '.[launch]')")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "launch" / "examples" / "h100.yaml"


@pytest.fixture
def example_cluster() -> Path:
    return EXAMPLE


def example_data() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


@pytest.fixture
def cluster_file(tmp_path):
    """Factory: the example cluster file with ``changes`` (dotted key -> value; None deletes the
    key) and the keys in ``nulls`` set to null."""

    def make(changes: dict | None = None, name: str = "cluster.yaml", nulls: tuple[str, ...] = ()) -> Path:
        data = copy.deepcopy(example_data())
        for key, value in [*(changes or {}).items(), *((k, "__null__") for k in nulls)]:
            *parents, leaf = key.split(".")
            node = data
            for p in parents:
                node = node.setdefault(p, {})
            if value is None:
                node.pop(leaf, None)
            elif value == "__null__":
                node[leaf] = None
            else:
                node[leaf] = value
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data))
        return path

    return make
