"""SGLang 0.5.23's own request schema, read from the installed sources (never copied).

  * ``/generate`` bodies: ``sglang/api/v1/api_types.py`` (``GenerateRequest``, the same
    generated decoder the real server's contract gate runs; its ``SamplingParams`` rejects
    unknown keys), loaded alone (it needs only msgspec);
  * control endpoints: the field lists of the request classes in
    ``sglang/srt/managers/io_struct.py`` (read with ``ast``: that module needs a GPU stack);
  * launcher argv: the CLI fields declared in ``sglang/srt/arg_groups/fields``;
  * ``init_custom_process_group`` (``srt/utils/common.py``), compiled from its source;
  * ``FlattenedTensorBucket`` (``srt/weight_sync/tensor_bucket.py``), loaded alone (it needs only torch).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any


@functools.cache
def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")  # a top-level spec: the package is not imported
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    return Path(spec.submodule_search_locations[0])


@functools.cache
def api_types():
    """sglang/api/v1/api_types.py loaded alone (it needs only msgspec)."""
    path = sglang_root() / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def sglang_tensor_bucket():
    """sglang/srt/weight_sync/tensor_bucket.py loaded alone (it needs only torch)."""
    path = sglang_root() / "srt" / "weight_sync" / "tensor_bucket.py"
    spec = importlib.util.spec_from_file_location("sglang_weight_sync_tensor_bucket", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _io_struct_classes() -> dict[str, ast.ClassDef]:
    tree = ast.parse((sglang_root() / "srt" / "managers" / "io_struct.py").read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@functools.cache
def io_struct_fields(class_name: str) -> dict[str, tuple[str, bool]]:
    """Field name -> (annotation source, required) of an io_struct request class, with its bases."""
    classes = _io_struct_classes()
    if class_name not in classes:
        raise KeyError(f"{class_name} not in SGLang's io_struct.py")
    fields: dict[str, tuple[str, bool]] = {}
    node = classes[class_name]
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(io_struct_fields(base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = (ast.unparse(stmt.annotation), stmt.value is None)
    return fields


_JSON_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def check_io_struct(class_name: str, body: Any) -> str | None:
    """What is wrong with ``body`` as JSON for io_struct ``class_name`` (None when it fits)."""
    if not isinstance(body, dict):
        return f"{class_name}: body is not a JSON object"
    fields = io_struct_fields(class_name)
    unknown = sorted(set(body) - set(fields))
    if unknown:
        return f"{class_name}: unknown field(s) {unknown}; SGLang has {sorted(fields)}"
    missing = sorted(name for name, (_, required) in fields.items() if required and name not in body)
    if missing:
        return f"{class_name}: missing required field(s) {missing}"
    for name, value in body.items():
        annotation = fields[name][0]
        optional = annotation.startswith("Optional[")
        base = annotation[len("Optional["):-1] if optional else annotation
        if value is None and optional:
            continue
        if base in _JSON_TYPES:
            ok = isinstance(value, _JSON_TYPES[base]) and not (base != "bool" and isinstance(value, bool))
            if not ok:
                return f"{class_name}.{name}: {value!r} is not {annotation}"
        elif base.startswith(("List[", "Annotated[List[")) and not isinstance(value, list):
            return f"{class_name}.{name}: {value!r} is not a list ({annotation})"
        elif base.startswith("Literal["):
            allowed = tuple(ast.literal_eval(e) for e in ast.parse(base, mode="eval").body.slice.elts)
            if value not in allowed:
                return f"{class_name}.{name}: {value!r} not in {allowed}"
    return None


@functools.cache
def server_cli_flags() -> frozenset[str]:
    """The ``--flags`` SGLang's ServerArgs registers from its declared fields."""
    flags: set[str] = set()
    for path in sorted((sglang_root() / "srt" / "arg_groups" / "fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            ann = node.annotation
            if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "A"):
                continue
            meta = ann.slice.elts[1] if isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) > 1 else None
            names = ["--" + node.target.id.replace("_", "-")]
            if isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg":
                kw = {k.arg: k.value for k in meta.keywords}
                if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                    continue
                if "cli_name" in kw:
                    names[0] = ast.literal_eval(kw["cli_name"])
                if "aliases" in kw:
                    names += list(ast.literal_eval(kw["aliases"]))
            elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                continue
            flags.update(names)
    return frozenset(flags)


@functools.cache
def sglang_init_custom_process_group():
    """SGLang's own ``init_custom_process_group`` (utils/common.py), compiled from its source."""
    import torch

    source = (sglang_root() / "srt" / "utils" / "common.py").read_text()
    func = next(n for n in ast.parse(source).body
                if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group")
    namespace: dict[str, Any] = {"torch": torch, "torch_release": tuple(
        int(p) for p in torch.__version__.split("+")[0].split(".")[:2])}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "sglang/srt/utils/common.py", "exec"), namespace)
    return namespace["init_custom_process_group"]


