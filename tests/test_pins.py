"""megatron-core and Transformer Engine pins agree wherever they are written.

Two megatron-core versions are in use on purpose: the CPU venv (Makefile, Python 3.11; the contract
tests run it) and the GPU containers (setup.cfg's ``gpu`` extra, Python >= 3.12; the device script
carries that wheel and the contract tests read its signatures). The table says which version goes
where; each test reads the place as written there and compares.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
MCORE_GPU = "0.19.2"  # GPU containers: setup.cfg gpu extra, the device script's wheel, the signatures read
MCORE_CPU = "0.16.1"  # this machine: the Makefile's venv, the CPU contract tests
TE_GPU = "2.14.1"  # the newest TE megatron-core 0.19.2 gates on (is_te_min_version("2.14.0"))

PLACES = [  # (what, version, where)
    ("megatron-core", MCORE_GPU, "setup.cfg [options.extras_require] gpu"),
    ("transformer-engine", TE_GPU, "setup.cfg [options.extras_require] gpu"),
    ("megatron-core", MCORE_CPU, "Makefile"),
    ("megatron-core", MCORE_GPU, "tests/gpu/fetch_wheels.sh MCORE_DEVICE"),
    ("megatron-core", MCORE_CPU, "tests/gpu/fetch_wheels.sh MCORE_CPU"),
    ("megatron-core", MCORE_GPU, "tests/megatron_tir/policy/mcore_signatures_<version>.json"),
]


def gpu_extra() -> dict[str, str]:
    """Package -> the exact version the gpu extra pins (``==``); ValueError on an unpinned entry we pin."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pins = {}
    for line in cfg["options.extras_require"]["gpu"].splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            exact = [s.version for s in req.specifier if s.operator == "=="]
            pins[req.name] = exact[0] if exact else ""
    return pins


def shell_var(path: Path, name: str) -> str:
    found = re.findall(rf"^{name}=([^\s#]+)", path.read_text(), flags=re.M)
    assert len(found) == 1, f"{path.name}: {name} set {len(found)} times"
    return found[0]


@pytest.mark.parametrize("what, version, where", PLACES)
def test_each_place_pins_its_version(what, version, where):
    if where.startswith("setup.cfg"):
        assert gpu_extra().get(what) == version, f"setup.cfg gpu extra pins {what}=={gpu_extra().get(what)!r}"
    elif where == "Makefile":
        pins = re.findall(r'"megatron-core==([^"]+)"', (ROOT / "Makefile").read_text())
        assert pins == [version], f"Makefile pins megatron-core {pins}"
    elif where.startswith("tests/gpu/fetch_wheels.sh"):
        assert shell_var(ROOT / "tests/gpu/fetch_wheels.sh", where.split()[-1]) == version
    else:
        found = sorted(p.name for p in (ROOT / "tests/megatron_tir/policy").glob("mcore_signatures_*.json"))
        assert found == [f"mcore_signatures_{version}.json"], found


def test_the_cpu_venv_runs_the_makefile_pin():
    assert importlib.metadata.version("megatron-core") == MCORE_CPU


def test_a_built_carry_holds_the_gpu_pin():
    wheels = ROOT / "tests/gpu/carry/wheels"
    if not wheels.is_dir():
        pytest.skip("tests/gpu/carry/ not built (tests/gpu/run_on_device.sh --check builds it)")
    found = sorted(p.name.split("-")[1] for p in wheels.glob("megatron_core-*.whl"))
    assert found == [MCORE_GPU], f"the carry holds megatron-core {found}"
