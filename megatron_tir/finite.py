"""Every float setting of a typed config is finite: one generic check, naming the dotted key.

A NaN or an infinity in a float setting turns into a silent no-op or garbage downstream
(``grad_clip=nan`` disables clipping, ``clip_high=inf`` removes the clip, ``temperature=nan``
samples garbage), and comparisons in a section's ``__post_init__`` let NaN through
(``nan > 0`` and ``nan <= 1`` are both False). So the top-level configs walk every field of
every section, tuples included, and refuse the first non-finite float by its key.
"""

from __future__ import annotations

import dataclasses
import math


def check_finite(obj, prefix: str = "") -> None:
    """ValueError naming the first float of ``obj`` (a dataclass, recursively) that is NaN or ±inf."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_finite(value, f"{key}.")
            continue
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"{key} must be a finite number, got {item}")


class NonFiniteTraining(RuntimeError):
    """The run stopped: ``trainer.stop_after_nonfinite`` consecutive steps had non-finite gradients or
    weights (one line; the CLI exits 1)."""
