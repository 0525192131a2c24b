"""Dependencies point one way: between the top-level packages, and between the rooms of ``megatron_tir``.

``checkpoints_tools -> megatron_tir -> sandbox_cluster``: nothing in ``megatron_tir``
imports ``checkpoints_tools`` and nothing in ``sandbox_cluster`` imports ``megatron_tir``.
Inside ``megatron_tir`` the rooms (a subpackage or a top-level module) import each other
without a circle, and the floors of ``FLOORS`` hold (``observe/`` reads run files and the step's
records and never imports ``train/``; ``policy/`` never imports ``model_sources``, which imports
``policy.checkpoint``). The graph is read from the source of the packages (every ``import``
statement, also those inside functions), not by importing them; a broken rule names the file and
line of each import that breaks it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_tir", "sandbox_cluster", "checkpoints_tools")
# (importing room, imported module or room, why): no module under the first imports anything under the second
FLOORS = (
    ("megatron_tir.observe", "megatron_tir.train",
     "observe/ reads run files and the records the trainer hands it; the trainer calls observe, never the reverse"),
    ("megatron_tir.policy", "megatron_tir.model_sources",
     "model_sources imports policy.checkpoint: the policy resolves named models through megatron_tir.named_models, "
     "which sits below it"),
)

# Imports known to run up a floor, each with what removes it: the test fails on any other import that
# breaks a floor and on an entry here that breaks nothing any more (delete it then).
KNOWN: dict[tuple[str, str], str] = {}


def _modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    base = root / package
    assert (base / "__init__.py").is_file(), base
    out = {}
    for path in base.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _import_sites(module: str, path: Path, known: dict[str, Path] | None = None) -> list[tuple[str, int]]:
    """``(absolute module name, line)`` of every import in ``module`` (relative imports resolved;
    ``from pkg import sub`` names ``pkg.sub`` when ``sub`` is one of the ``known`` modules)."""
    is_package = path.name == "__init__.py"
    sites = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            sites += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            sites.append((target, node.lineno))
            subs = (f"{target}.{a.name}" for a in node.names)
            sites += [(sub, node.lineno) for sub in subs if known and sub in known]
    return sites


def _imports(module: str, path: Path) -> set[str]:
    """Absolute names of every module ``module`` imports (relative imports resolved)."""
    return {name for name, _ in _import_sites(module, path)}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


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


def _floor_violations(modules: dict[str, Path], floors=FLOORS, root: Path = ROOT,
                      known=None) -> list[str]:
    """``file:line: module imports room (why)`` of each import that runs up a floor and is not ``known``
    (a set of ``(file, imported room)``)."""
    out = []
    for module, path in sorted(modules.items()):
        for importer, imported, why in floors:
            if not _under(module, importer) or (str(path.relative_to(root)), imported) in (known or ()):
                continue
            lines = sorted({line for name, line in _import_sites(module, path, modules) if _under(name, imported)})
            out += [f"{path.relative_to(root)}:{line}: {module} imports {imported} ({why})" for line in lines]
    return out


def _room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _room_cycles(modules: dict[str, Path], root: Path = ROOT, known=None) -> list[str]:
    """Each import between two rooms that lie on one circle, as ``file:line: room -> room`` (the
    ``known`` imports, ``(file, imported room)``, left out of the graph)."""
    edges: dict[tuple[str, str], list[str]] = {}
    rooms = {_room(m) for m in modules}
    for module, path in sorted(modules.items()):
        for name, line in _import_sites(module, path, modules):
            a, b, file = _room(module), _room(name), str(path.relative_to(root))
            if a == b or b not in rooms or any(file == f and _under(name, r) for f, r in (known or ())):
                continue
            if f"{file}:{line}" not in edges.setdefault((a, b), []):
                edges[(a, b)].append(f"{file}:{line}")
    reach = {a: {b for x, b in edges if x == a} for a, _ in edges}
    changed = True
    while changed:  # transitive closure (a few dozen rooms)
        changed = False
        for targets in reach.values():
            more = set().union(*(reach.get(b, set()) for b in targets)) - targets
            if more:
                targets |= more
                changed = True
    return [f"{site}: {a} -> {b}" for (a, b), sites in sorted(edges.items()) if a in reach.get(b, set())
            for site in sites]


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


def test_the_floors_hold():
    modules = _modules("megatron_tir")
    for importer, imported, _ in FLOORS:  # a renamed room would make its rule hold by saying nothing
        assert any(_under(m, importer) for m in modules), importer
        assert any(_under(m, imported) for m in modules), imported
    violations = _floor_violations(modules, known=KNOWN)
    assert not violations, "imports that run up a floor:\n" + "\n".join(violations)
    every = _floor_violations(modules)
    fixed = [f"{file} -> {room}" for file, room in KNOWN if not any(v.startswith(file + ":") and f"imports {room} " in v
                                                                  for v in every)]
    assert not fixed, "no longer break a floor (delete them from KNOWN): " + ", ".join(fixed)


def test_the_rooms_import_each_other_without_a_circle():
    cycles = _room_cycles(_modules("megatron_tir"), known=KNOWN)
    assert not cycles, "imports on a circle between rooms:\n" + "\n".join(cycles)


def test_the_checks_report_what_breaks_them(tmp_path):
    """The two checks above, on a made-up package: a floor broken inside a function, and a circle."""
    pkg = tmp_path / "pkg"
    for d in ("low", "high"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("import os\n\n\ndef f():\n    from ..high import b\n    return b\n")
    (pkg / "high" / "b.py").write_text("from pkg.low.a import f\n")
    modules = _modules("pkg", tmp_path)
    assert _floor_violations(modules, (("pkg.low", "pkg.high", "low is below"),), tmp_path) == [
        "pkg/low/a.py:5: pkg.low.a imports pkg.high (low is below)"]
    assert _room_cycles(modules, tmp_path) == ["pkg/high/b.py:1: pkg.high -> pkg.low",
                                               "pkg/low/a.py:5: pkg.low -> pkg.high"]
    (pkg / "high" / "b.py").write_text("import os\n")
    assert _room_cycles(modules, tmp_path) == []


def test_light_policy_modules_do_not_import_megatron_core():
    import subprocess
    import sys

    code = ("import sys, megatron_tir.policy.keymap, megatron_tir.policy.spec, megatron_tir.launch.cli\n"
            "print('megatron.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
