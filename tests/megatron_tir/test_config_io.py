"""The shared typed-config reader: mappings in and out, key=value text, decided keys."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import pytest

from megatron_tir.config_io import apply_overrides, build, to_dict


class Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(kw_only=True, slots=True)
class Inner:
    size: int
    scale: float = 1.0
    colour: Colour = Colour.RED
    names: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")


@dataclass(kw_only=True, slots=True)
class Outer:
    inner: Inner = field(default_factory=lambda: Inner(size=1))
    mode: str = "a"
    derived: str = "a"

    def __post_init__(self) -> None:
        self.derived = self.mode


def test_mapping_round_trip_with_enums_tuples_dicts_and_none():
    cfg = Outer(inner=Inner(size=3, scale=2, colour=Colour.BLUE, names=("x", "y"), env={"K": "v"}), mode="b")
    data = to_dict(cfg)
    assert data["inner"] == {"size": 3, "scale": 2, "colour": "blue", "names": ["x", "y"], "env": {"K": "v"},
                             "limit": None}
    assert build(Outer, data) == cfg


@pytest.mark.parametrize("data,message", [
    ({"inner": {"size": 1, "sise": 2}}, "inner.sise: unknown key (known: size, scale"),
    ({"inner": {"scale": 2.0}}, "inner.size: missing"),
    ({"inner": {"size": "3"}}, "inner.size: expected int, got '3'"),
    ({"inner": {"size": True}}, "inner.size: expected int, got True"),
    ({"inner": {"size": 1, "colour": "green"}}, "inner.colour: 'green' is not one of red, blue"),
    ({"inner": {"size": 0}}, "inner: size must be >= 1, got 0"),
    ({"inner": [1]}, "inner: expected a mapping, got list"),
])
def test_bad_mappings_are_one_line_errors_naming_the_key(data, message):
    with pytest.raises(ValueError) as info:
        build(Outer, data)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_overrides_parse_by_field_type_and_validate_each_section():
    cfg = apply_overrides(Outer(), ["inner.size=4", "inner.names=a,b", "inner.colour=blue", "inner.limit=null",
                                    "inner.scale=0.5", "mode=z"])
    assert cfg.inner == Inner(size=4, names=("a", "b"), colour=Colour.BLUE, scale=0.5)
    assert cfg.derived == "z"
    with pytest.raises(ValueError, match=r"inner.size=0: size must be >= 1"):
        apply_overrides(Outer(), ["inner.size=0"])


def test_a_decided_key_is_refused_naming_the_key_that_decides_it():
    with pytest.raises(ValueError, match="derived is decided by mode; set mode instead"):
        apply_overrides(Outer(), ["derived=b"], decided_by={"derived": "mode"})
    # without the rule the value would be silently overwritten by __post_init__
    assert apply_overrides(Outer(), ["derived=b"]).derived == "a"
