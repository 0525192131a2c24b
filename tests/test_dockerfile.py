"""docker/Dockerfile pins exactly what setup.cfg's gpu extra pins (the image is not built here: docker/README.md)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ARG_OF = {"sglang": "SGLANG_VERSION", "megatron-core": "MEGATRON_CORE_VERSION",
          "transformer-engine": "TRANSFORMER_ENGINE_VERSION"}


def gpu_pins() -> dict[str, str]:
    """name -> pinned version of setup.cfg's gpu extra (extras in brackets dropped)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pins = {}
    for line in cfg["options.extras_require"]["gpu"].splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[re.sub(r"\[.*\]", "", name).strip().lower()] = version.strip()
    return pins


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.MULTILINE))


def test_every_gpu_pin_is_an_arg_of_the_dockerfile_with_the_same_version():
    pins, args = gpu_pins(), dockerfile_args()
    assert set(pins) <= set(ARG_OF), f"a gpu pin the Dockerfile does not install: {set(pins) - set(ARG_OF)}"
    assert {name: args.get(ARG_OF[name]) for name in pins} == pins
    assert set(pins) >= {"sglang", "megatron-core", "transformer-engine"}


def test_the_pins_are_used_and_the_project_installed_with_its_gpu_extra():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, flags=re.MULTILINE)
    assert dockerfile_args()["BASE_IMAGE"].startswith("nvcr.io/nvidia/pytorch:")
    for name, arg in ARG_OF.items():
        assert re.search(rf'pip install [^\n]*"{re.escape(name)}(\[\w+\])?==\$\{{{arg}\}}"', text), name
    assert 'pip install ".[gpu,launch]"' in text
    assert "--no-build-isolation" in text  # TE's extension builds against the installed torch
