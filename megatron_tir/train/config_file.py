"""Config files: a resolved :class:`~megatron_tir.train.config.TrainConfig` as YAML, and back.

    megatron-tir config --recipe smollm2-cpu --set rollout.max_turns=5 > run.yaml   # edit by hand
    megatron-tir train --config run.yaml --set trainer.steps=20 --out runs/mine
    megatron-tir train --config runs/old/config.json --out runs/again            # a run's config.json

The file is the whole resolved config (every key, the nested sections as mappings), read
by the shared typed reader (:func:`megatron_tir.config_io.build`, via
:func:`~megatron_tir.train.config.from_dict`): unknown keys, missing keys and values of the
wrong type are refused. YAML is a superset of JSON, so a run's ``config.json`` reads the same
way. Every error is one line naming the file, the line and the dotted key
(``run.yaml:12: rollout.max_turnz: unknown key (known: ...)``).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from megatron_tir.train.config import TrainConfig, from_dict, to_dict

class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-8`` (no dot) as a string; here it is the float it is in YAML 1.2 and JSON."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))

HEADER = "# megatron-tir train config ({source}); edit and run: megatron-tir train --config FILE --out RUN_DIR\n"


def dump_yaml(cfg: TrainConfig, *, source: str = "resolved") -> str:
    """The resolved config as YAML text (keys in the dataclasses' order)."""
    return HEADER.format(source=source) + yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def _key_lines(node, prefix: str = "", out: dict[str, int] | None = None) -> dict[str, int]:
    """Dotted key -> 1-based line of that key in the composed YAML node tree."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = f"{prefix}{key_node.value}"
            out.setdefault(dotted, key_node.start_mark.line + 1)
            _key_lines(value_node, dotted + ".", out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.setdefault(f"{prefix[:-1]}[{i}]", item.start_mark.line + 1)
            _key_lines(item, f"{prefix[:-1]}[{i}].", out)
    return out


def _line_of(message: str, lines: dict[str, int]) -> int | None:
    """The line of the dotted key an error message starts with (or of its nearest enclosing key)."""
    match = re.match(r"([A-Za-z_][\w.\[\]]*)", message)
    if not match:
        return None
    key = match.group(1)
    while key:
        if key in lines:
            return lines[key]
        key = re.sub(r"(\.[^.\[]*|\[\d+\])$", "", key) if ("." in key or "[" in key) else ""
    return None


def load_config_file(path: str | Path) -> TrainConfig:
    """A TrainConfig from a YAML or JSON file; ValueError ``FILE:LINE: key: problem`` on bad content."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ValueError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
    try:
        return from_dict(data)
    except (ValueError, TypeError) as exc:
        message = " ".join(str(exc).split())
        line = _line_of(message, _key_lines(node))
        raise ValueError(f"{path}:{line}: {message}" if line else f"{path}: {message}") from None
