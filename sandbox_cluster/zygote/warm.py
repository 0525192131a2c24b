"""The warm interpreter: what cells use, imported and exercised once, frozen, in huge pages.

``prepare_warm_interpreter`` is the one way to warm one: the zygote and both benchmarks'
bare-fork baselines (``bench/bench_sandbox.py``, ``bench/bench_fork.py``) call it.
"""

from __future__ import annotations

import gc

from .. import hugepages


def import_warm_modules() -> None:
    """Import what cells use (numpy, sympy): their shared libraries are then mapped."""
    import collections  # noqa: F401
    import linecache  # noqa: F401
    import traceback  # noqa: F401

    import numpy  # noqa: F401
    import sympy  # noqa: F401


def warm_up() -> None:
    """Import and actually call what cells use, so no child pays a lazy import or a cold cache."""
    import_warm_modules()
    import numpy as np
    import sympy

    x, y = sympy.symbols("x y")
    sympy.solve(x**2 - 4)
    sympy.solve(x**2 - 4, x)
    sympy.solve([x + y - 3, x - y - 1], [x, y])
    sympy.simplify(sympy.sin(x) ** 2 + sympy.cos(x) ** 2)
    sympy.integrate(x**2, x)
    sympy.expand((x + 1) ** 3)
    sympy.factorint(360)
    sympy.Rational(1, 3) + sympy.sqrt(2)
    sympy.latex(x**2 / 2)
    np.arange(100).sum()
    np.linalg.solve(np.eye(3), np.ones(3))
    np.random.default_rng(0).random(10).mean()
    str(np.array([1.5, 2.5]))


def prepare_warm_interpreter(*, huge_pages: bool = True) -> int:
    """Warm up, freeze the GC (forked children then do not copy-on-write the warm heap) and
    collapse the heap into huge pages (fork and exit then copy and tear down far fewer
    page-table entries). Returns the 2 MiB pages collapsed (0 without ``huge_pages``)."""
    warm_up()
    gc.collect()
    gc.freeze()
    return hugepages.collapse() if huge_pages else 0
