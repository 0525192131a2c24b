"""The device-check mode: collectives and host synchronisations as a GPU run would see them, on CPU.

On a GPU node every group the project uses (the world, megatron-core's TP/PP/DP groups, the
weight-sync group) is an NCCL group: its operands must be CUDA tensors ("No backend type
associated with device type cpu" otherwise). On CPU everything is gloo and every tensor is a
CPU tensor, so that mistake cannot show by itself. This mode tracks where each tensor would
live on a GPU run:

* *host-born*: made by a factory without a ``device=`` (``torch.tensor(x)``,
  ``torch.zeros(shape)``, ...), or by ``.cpu()``; an op whose tensor inputs are all host-born
  gives a host-born result (on a GPU all of them would be CPU tensors);
* everything else is on the device: model parameters and activations, tensors made with an
  explicit ``device=`` (the project passes the model's device), results of ``.to(device)``
  / ``.cuda()``, any op with a device input. (A literal ``device="cpu"`` counts as the device:
  on CPU it cannot be told apart from the model's device; known limit.)

With the mode on (the ``device_check`` fixture), a ``torch.distributed`` collective whose
tensor operand is host-born fails when its group would be an NCCL group, i.e. any group but
megatron-core's own ``*_GLOO`` groups; and a read of a device tensor to the host
(``.item()``, ``.cpu()``, ``.tolist()``, ``bool()``, ``float()``, ``int()``) from project code
while megatron-core's forward/backward schedule runs (the micro-batch loop) fails too.
Calls made from megatron-core's own code are not checked (its GPU path is upstream's).

It is a test fixture: nothing in the package knows about it. Apply it with
``@pytest.mark.usefixtures("device_check")`` or take the fixture to read ``.violations``.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "all_to_all", "all_to_all_single", "send", "recv", "isend",
               "irecv", "gather", "scatter")
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.scalar_tensor}
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
              torch.Tensor.__int__, torch.Tensor.numpy}


class DeviceCheckError(AssertionError):
    pass


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _caller_package() -> str:
    """Top-level package of the first frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == __name__ or name == "torch" or name.startswith("torch.") or name == "contextlib"):
            return name.split(".")[0]
        frame = frame.f_back
    return ""


@dataclass
class DeviceCheck:
    """The mode's state: host-born tensors, whether the schedule runs, what was refused."""

    violations: list[str] = field(default_factory=list)
    in_schedule: int = 0
    _host: dict[int, weakref.ref] = field(default_factory=dict)

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def mark(self, out, host: bool) -> None:
        for t in _tensors(out):
            key = id(t)
            if host:
                self._host[key] = weakref.ref(t, lambda _, k=key: self._host.pop(k, None))
            else:
                self._host.pop(key, None)

    def refuse(self, message: str) -> None:
        self.violations.append(message)
        raise DeviceCheckError(message)


class _Provenance(TorchFunctionMode):
    def __init__(self, check: DeviceCheck) -> None:
        super().__init__()
        self.check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = self.check
        if func in HOST_READS and check.in_schedule and args and not check.is_host(args[0]) \
                and _caller_package() != "megatron":
            check.refuse(f"host synchronisation in the micro-batch loop: Tensor.{func.__name__} of a device tensor")
        if func is torch.Tensor.cpu and check.in_schedule and args and not check.is_host(args[0]) \
                and _caller_package() != "megatron":
            check.refuse("host synchronisation in the micro-batch loop: Tensor.cpu of a device tensor")
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func in FACTORIES:
            check.mark(out, host=kwargs.get("device") is None)
        elif func is torch.Tensor.cpu:
            check.mark(out, host=True)
        elif func in (torch.Tensor.to, torch.Tensor.cuda):
            moved = func is torch.Tensor.cuda or "device" in kwargs or any(
                isinstance(a, (torch.device, str)) for a in args[1:])
            if moved:
                check.mark(out, host=False)
            else:
                check.mark(out, host=check.is_host(args[0]))
        elif name.endswith("_") and not name.startswith("__"):
            pass  # in place: the target keeps its place
        elif isinstance(out, torch.Tensor) or isinstance(out, (tuple, list)):
            inputs = list(_tensors(args)) + list(_tensors(kwargs))
            if inputs:
                check.mark(out, host=all(check.is_host(t) for t in inputs))
        return out


def _gloo_groups() -> list:
    """megatron-core's own gloo groups (the only groups that are gloo on a GPU run too)."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return []
    groups = []
    for key, value in vars(parallel_state).items():
        if "GLOO" in key and value is not None:
            groups.extend(value if isinstance(value, (list, tuple)) else [value])
    return groups


def _wrap_collective(check: DeviceCheck, name: str, real):
    def wrapped(*args, **kwargs):
        if _caller_package() != "megatron":
            group = kwargs.get("group")
            if not any(group is g for g in _gloo_groups()):
                for t in list(_tensors(args)) + list(_tensors(kwargs)):
                    if check.is_host(t):
                        check.refuse(f"torch.distributed.{name} of a host tensor (shape {tuple(t.shape)}) on a "
                                     f"group that is NCCL on a GPU run: it needs the device")
        return real(*args, **kwargs)

    wrapped.__wrapped__ = real
    return wrapped


@contextlib.contextmanager
def device_check_mode():
    """The mode as a context manager (the fixture uses it); yields the ``DeviceCheck``."""
    check = DeviceCheck()
    saved = {name: getattr(torch.distributed, name) for name in COLLECTIVES if hasattr(torch.distributed, name)}
    import megatron.core.pipeline_parallel as pp_mod

    real_get = pp_mod.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        schedule = real_get(*args, **kwargs)

        def scheduled(*a, **k):
            check.in_schedule += 1
            try:
                return schedule(*a, **k)
            finally:
                check.in_schedule -= 1
        return scheduled

    try:
        for name, real in saved.items():
            setattr(torch.distributed, name, _wrap_collective(check, name, real))
        pp_mod.get_forward_backward_func = get_forward_backward_func
        with _Provenance(check):
            yield check
    finally:
        for name, real in saved.items():
            setattr(torch.distributed, name, real)
        pp_mod.get_forward_backward_func = real_get
