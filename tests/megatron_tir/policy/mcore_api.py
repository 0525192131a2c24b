"""The megatron-core API the project uses, against a release's source read with ``ast`` (never imported).

    python tests/megatron_tir/policy/mcore_api.py WHEEL   # writes mcore_signatures_<version>.json here

The clusters run the newest megatron-core (0.19.x, Python 3.12) while this machine runs 0.16.1 on
Python 3.11, where the newer wheel cannot be imported. :func:`project_uses` scans the project's
sources for every megatron-core name it imports and the keyword arguments of its calls to them;
:func:`signatures` reads those names' signatures (functions, class ``__init__`` or dataclass
fields, with the bases' fields) from a wheel or an installed package; the script writes them for
the wheel's version into a small JSON file beside this one, which
``test_mcore_versions.py`` checks the project against (and against the installed version).
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ("megatron_tir", "checkpoints_tools")
HERE = Path(__file__).resolve().parent
# reached through objects, not names: the config dataclass the project fills, the schedules
# get_forward_backward_func returns (the learner calls them with keywords)
EXTRA = ("megatron.core.transformer.transformer_config.TransformerConfig",
         "megatron.core.model_parallel_config.ModelParallelConfig",
         "megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining",
         "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving")


# ----------------------------------------------------------------------------- what the project uses


def _py_files() -> Iterator[Path]:
    for top in SCANNED:
        yield from sorted((ROOT / top).rglob("*.py"))


def project_uses(sources: dict[str, str]) -> dict[str, set[str]]:
    """``{"megatron.core.mod.Name": {keyword names used in calls}}`` over the project's files.

    ``sources`` maps module names of the megatron-core release (``megatron.core.x``) to their text,
    to tell a module import (``from megatron.core import parallel_state``) from a name import."""
    uses: dict[str, set[str]] = {}
    for path in _py_files():
        tree = ast.parse(path.read_text())
        names: dict[str, str] = {}  # local name -> dotted megatron-core target (module or object)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron.core"):
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("megatron.core") and a.asname:
                        names[a.asname] = a.name
        if not names:
            continue
        for node in ast.walk(tree):
            target = None
            func = node.func if isinstance(node, ast.Call) else node
            if isinstance(func, ast.Name) and func.id in names:
                target = names[func.id]
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names \
                    and names[func.value.id] in sources:  # module.attr
                target = f"{names[func.value.id]}.{func.attr}"
            if target is None or target in sources:  # a module itself is not a signature
                continue
            kws = uses.setdefault(target, set())
            if isinstance(node, ast.Call):
                kws.update(k.arg for k in node.keywords if k.arg is not None)
    return uses


# ----------------------------------------------------------------------------- a release's signatures


def wheel_sources(wheel: Path) -> tuple[str, dict[str, str]]:
    """(version, {module name: source}) of ``megatron/core`` in a wheel."""
    version = re.match(r"megatron_core-([^-]+)-", wheel.name).group(1)
    out = {}
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("megatron/core/") and name.endswith(".py"):
                out[_module_name(name)] = z.read(name).decode()
    return version, out


def installed_sources() -> tuple[str, dict[str, str]]:
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("megatron.core")
    base = Path(spec.origin).parent.parent.parent  # site-packages
    out = {_module_name(str(p.relative_to(base))): p.read_text() for p in (base / "megatron" / "core").rglob("*.py")}
    return importlib.metadata.version("megatron-core"), out


def _module_name(relpath: str) -> str:
    mod = relpath[:-3].replace("/", ".")
    return mod.removesuffix(".__init__")


def _function_sig(fn: ast.FunctionDef | ast.AsyncFunctionDef, *, skip_self: bool) -> dict:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    params = [[p.arg, "positional", d] for p, d in zip(positional, defaults)]
    params += [[p.arg, "keyword", d is not None] for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if skip_self and params and params[0][0] in ("self", "cls"):
        params = params[1:]
    return {"kind": "function", "params": params, "varargs": a.vararg is not None, "varkw": a.kwarg is not None}


def _forwarded_to(fn: ast.FunctionDef) -> str | None:
    """The function that ``fn(*args, **kwargs)`` passes both on to, if it calls one by name."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and any(isinstance(a, ast.Starred) for a in node.args) and any(k.arg is None for k in node.keywords):
            return node.func.id
    return None


def _class_sig(cls: ast.ClassDef, lookup) -> dict:
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    is_dataclass = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
    fields = [[n.target.id, "keyword", n.value is not None] for n in cls.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    bases = []
    for b in cls.bases:
        found = lookup(ast.unparse(b))
        if found is not None and found.get("kind") == "class":
            bases.append(found)
    if init is not None:
        sig = _function_sig(init, skip_self=True)
        return {"kind": "class", **{k: v for k, v in sig.items() if k != "kind"}}
    inherited = [p for b in bases for p in b["params"]]
    if is_dataclass or fields:
        names = {p[0] for p in fields}
        return {"kind": "class", "params": [p for p in inherited if p[0] not in names] + fields,
                "varargs": False, "varkw": any(b["varkw"] for b in bases)}
    if bases:
        return {"kind": "class", "params": inherited, "varargs": any(b["varargs"] for b in bases),
                "varkw": any(b["varkw"] for b in bases)}
    return {"kind": "class", "params": [], "varargs": True, "varkw": True}  # no __init__ seen: unknown


def signatures(sources: dict[str, str], targets) -> dict[str, dict]:
    """The signature of each dotted ``target`` (following re-exports); missing ones are absent."""
    trees: dict[str, ast.Module] = {}

    def tree(mod: str) -> ast.Module | None:
        if mod not in sources:
            return None
        if mod not in trees:
            trees[mod] = ast.parse(sources[mod])
        return trees[mod]

    def resolve(mod: str, name: str, depth: int = 0) -> dict | None:
        t = tree(mod)
        if t is None or depth > 8:
            return None
        for node in t.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                sig = _function_sig(node, skip_self=False)
                callee = _forwarded_to(node) if sig["varargs"] and sig["varkw"] and not sig["params"] else None
                if callee is not None:  # def f(*args, **kwargs): ... g(*args, **kwargs): g's parameters
                    target = resolve(mod, callee, depth + 1)
                    if target is not None and target.get("kind") == "function":
                        sig["forwards_to"] = {"name": callee, **target}
                return sig
            if isinstance(node, ast.ClassDef) and node.name == name:
                return _class_sig(node, lambda base: resolve_in(mod, base, depth + 1))
        return resolve_import(mod, name, depth)

    def resolve_in(mod: str, dotted: str, depth: int) -> dict | None:
        return resolve(mod, dotted.split(".")[-1], depth) if "." not in dotted else None

    def resolve_import(mod: str, name: str, depth: int) -> dict | None:
        for node in ast.walk(tree(mod)):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        src = node.module or ""
                        if node.level:
                            pkg = mod if _is_package(mod) else mod.rsplit(".", 1)[0]
                            for _ in range(node.level - 1):
                                pkg = pkg.rsplit(".", 1)[0]
                            src = f"{pkg}.{src}" if src else pkg
                        if f"{src}.{a.name}" in sources:
                            return {"kind": "module"}
                        return resolve(src, a.name, depth + 1)
        return None

    def _is_package(mod: str) -> bool:
        return any(m.startswith(mod + ".") for m in sources)

    out = {}
    for target in sorted(targets):
        mod, _, name = target.rpartition(".")
        if target in sources:
            out[target] = {"kind": "module"}
            continue
        sig = resolve(mod, name)
        if sig is not None:
            out[target] = sig
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    version, sources = wheel_sources(Path(argv[0]))
    uses = project_uses(sources)
    extra = set(EXTRA)
    sigs = signatures(sources, set(uses) | extra)
    path = HERE / f"mcore_signatures_{version}.json"
    path.write_text(json.dumps({"version": version, "source": Path(argv[0]).name, "signatures": sigs},
                               indent=0, sort_keys=True) + "\n")
    print(f"wrote {path} ({len(sigs)} signatures of {len(uses)} used names)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
