"""The device script on CPU: its step timeouts fit the 8-minute budget, it parses, and the carry's
requirement check catches a wheel whose requirement is neither carried nor on the device.

The full ``tests/gpu/run_on_device.sh --check`` (builds the carry, a venv from local folders only, the
imports and the tiny model) takes 2-4 minutes on the 2-core machine, so it is run by hand, not here.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from carry_requirements import missing_requirements  # noqa: E402

BUDGET_S = 8 * 60


def test_the_device_steps_timeouts_fit_eight_minutes():
    text = (HERE / "run_on_device.sh").read_text()
    device_part = text[text.index('OUT="${OUT:?'):]
    timeouts = [int(t) for t in re.findall(r"\btimeout (\d+) ", device_part)]
    assert len(timeouts) == 5, timeouts  # environment, install, pytest -m gpu, device checks, NCCL sync
    assert sum(timeouts) <= BUDGET_S, f"{timeouts} add up to {sum(timeouts)} s"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(HERE / "run_on_device.sh")], check=True)
    subprocess.run(["bash", "-n", str(HERE / "fetch_wheels.sh")], check=True)


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *(f"Requires-Dist: {r}" for r in requires)])
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", meta)


def test_the_requirement_check_names_what_a_no_deps_install_leaves_out(tmp_path):
    _wheel(tmp_path, "aiohttp", "3.14.5", ["yarl>=1.17", "multidict", 'brotli; extra == "speedups"',
                                           'async-timeout; python_version < "3.11"'])
    _wheel(tmp_path, "yarl", "1.25.1", ["idna>=2.0", "multidict>=4.0"])
    _wheel(tmp_path, "megatron-core", "0.19.2", ["torch>=2.6.0", "numpy", "packaging>=24.2"])
    device = ["torch", "numpy", "packaging"]
    assert missing_requirements(tmp_path, device) == [
        "aiohttp-3.14.5-py3-none-any.whl needs multidict", "yarl-1.25.1-py3-none-any.whl needs idna>=2.0",
        "yarl-1.25.1-py3-none-any.whl needs multidict>=4.0"]
    _wheel(tmp_path, "multidict", "7.2.1", [])
    _wheel(tmp_path, "idna", "3.21", [])
    assert missing_requirements(tmp_path, device) == []  # extras and markers for other Pythons do not count
