"""``module:attribute`` import paths: how a config names code outside the package (a reward, a tool).

    reward.function=my_project.rewards:format_and_answer
    rollout.toolset=python,my_project.tools:Calculator

The module must be importable where the run starts (on ``PYTHONPATH`` or installed); the
attribute may be dotted (``module:Class.factory``). Every failure is one ``ValueError`` line
naming the key that gave the path.
"""

from __future__ import annotations

import importlib
import re

PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_import_path(text: str) -> bool:
    return bool(PATTERN.match(text))


def load_object(path: str, key: str):
    """The object ``path`` names; ValueError naming ``key`` when the path is malformed, the module
    does not import, or the attribute is missing or not callable."""
    if not is_import_path(path):
        raise ValueError(f"{key}: {path!r} is not an import path (module:attribute, e.g. my_pkg.rewards:score)")
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure of user code is that key's bad input
        raise ValueError(f"{key}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}: {path} is not callable")
    return obj
