"""Dependencies between the top-level packages point one way.

``checkpoints_tools -> megatron_tir -> sandbox_cluster``: nothing in ``megatron_tir``
imports ``checkpoints_tools`` and nothing in ``sandbox_cluster`` imports ``megatron_tir``.
The graph is read from the source of the imported packages (every ``import`` statement,
also those inside functions), not by importing them.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PACKAGES = ("megatron_tir", "sandbox_cluster", "checkpoints_tools")


def _modules(package: str) -> dict[str, Path]:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    root = Path(list(spec.submodule_search_locations)[0])
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Absolute names of every module ``module`` imports (relative imports resolved)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
    return names


def _edges() -> set[tuple[str, str]]:
    """(importing top-level package, imported top-level package) for the three packages."""
    edges = set()
    for package in PACKAGES:
        for module, path in _modules(package).items():
            for name in _imports(module, path):
                top = name.split(".")[0]
                if top in PACKAGES and top != package:
                    edges.add((package, top))
    return edges


def test_dependencies_point_one_way():
    edges = _edges()
    assert ("checkpoints_tools", "megatron_tir") in edges  # the walker sees the edges that exist
    assert ("megatron_tir", "sandbox_cluster") in edges
    assert ("megatron_tir", "checkpoints_tools") not in edges
    assert ("sandbox_cluster", "megatron_tir") not in edges
    assert ("sandbox_cluster", "checkpoints_tools") not in edges


def test_the_tir_protocol_does_not_import_the_sandbox():
    """Tools are a seam: the TIR protocol reads tool calls and program outcomes through its own
    types; the sandbox's (``ExecResult``, ``Status``) stay with the Python tool in ``rollout.tools``."""
    tir = {m: p for m, p in _modules("megatron_tir").items() if m == "megatron_tir.tir" or
           m.startswith("megatron_tir.tir.")}
    assert "megatron_tir.tir.protocol" in tir
    imported = {name for module, path in tir.items() for name in _imports(module, path)}
    assert not {n for n in imported if n.split(".")[0] == "sandbox_cluster"}
    assert not {n for n in imported if n.startswith("megatron_tir.rollout")}  # and not the rollout side


def test_relative_imports_are_resolved(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\nfrom .b import c\n")
    (pkg / "a.py").write_text("from .b import d\nimport os.path\n")
    assert _imports("pkg", pkg / "__init__.py") == {"pkg", "pkg.b"}
    assert _imports("pkg.a", pkg / "a.py") == {"pkg.b", "os.path"}


def test_light_policy_modules_do_not_import_megatron_core():
    import subprocess
    import sys

    code = ("import sys, megatron_tir.policy.keymap, megatron_tir.policy.spec, megatron_tir.launch.cli\n"
            "print('megatron.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
