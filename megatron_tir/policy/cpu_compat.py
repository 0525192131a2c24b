"""The one place where megatron-core is redirected to run without a GPU.

megatron-core assumes CUDA in a few spots that a CPU forward/backward on gloo reaches.
``apply()`` redirects exactly those, and only when ``torch.cuda.is_available()`` is
False (on a GPU it does nothing). Each redirection is listed in ``PATCHES``; the test
``tests/megatron_tir/policy/test_policy_cpu_compat.py`` asserts every target still exists in
the installed megatron-core (and still contains the CUDA call it works around), so an
upgrade that moves one fails loudly instead of silently running the CUDA path.

What is redirected (and why):

* ``torch.cuda.current_device()`` / ``torch.cuda.synchronize()`` / tensor factories
  called with ``device="cuda"`` inside the modules in ``_CUDA_DEVICE_MODULES``: buffers
  for TP gathers (``tensor_parallel.mappings``, ``tensor_parallel.layers``), the global
  memory buffer of attention (``utils``), rotary ``inv_freq`` placement, and pipeline p2p
  shape exchange allocate on "the current CUDA device"; dist_checkpointing's writer
  synchronizes CUDA after staging tensors to host memory and reduces its
  failure flags on the current CUDA device; the pipeline schedules count tokens in
  ``torch.zeros(..., device="cuda")``. Those modules see a ``torch`` proxy whose
  ``cuda.current_device()`` is ``"cpu"``, whose ``cuda.synchronize()`` is a no-op and whose
  ``zeros/ones/empty/full/tensor`` map ``device="cuda"`` to the CPU; every other
  attribute is the real ``torch``.
* MoE (megatron-core's ``MoELayer`` with the local spec's ``SequentialMLP`` experts): the
  router's gating moves its weight to the current CUDA device on every forward
  (``transformer.moe.router``: through the ``torch`` proxy) and multiplies through
  ``te_general_gemm``, a name left undefined when Transformer Engine is absent
  (``router_gating_linear``: the same product in torch, as megatron-core's non-TE branch
  computes it); the all-to-all token dispatcher (which the learner uses at PP > 1, where the
  all-gather one refuses variable sequence lengths) creates and waits on a CUDA stream for its
  device-to-host copies (the proxy's ``cuda.Stream`` / ``current_stream`` / ``stream`` are one
  CPU stand-in whose waits and events do nothing: on CPU the copies are already done), and
  its ``maybe_move_tensor_to_cpu`` turns only CUDA tensors into the numpy split sizes the
  all-to-all takes (on CPU they stayed tensors: the same values as numpy arrays here).
* ``get_default_causal_mask`` (``device="cuda"`` hard-coded): CPU version, cached per
  length like the original.
* The CUDA RNG tracker (dropout / weight init under ``fork()``): a tracker with the same
  interface over the CPU generator; activation recomputation's save/restore of all RNG
  states (``_get_all_rng_states`` / ``_set_all_rng_states``) saves the CPU one instead.
* ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied embedding to CUDA
  (``weight.data.cuda()``) before its all-reduce when PP > 1: wrapped so that, during
  that call only, ``Tensor.cuda()`` leaves CPU tensors where they are.

What works with these (tested on 2 CPU cores, gloo; tests/megatron_tir/policy and
tests/checkpoints_tools): building GPTModel with the local layer spec; forward at TP=1,
2, 3 and PP=2 (stages exchanging activations with send/recv, see
``megatron_tir.policy.forward``); forward+backward at TP=2 with gradients equal to
transformers'; megatron's pipeline schedules (``get_forward_backward_func()``: no
pipelining, and 1F1B at PP=2) forward+backward with gradients equal to transformers';
``dist_checkpointing`` save/load at any TP/PP (TP=3 x PP=2 on 6 ranks), tied embeddings
across PP stages. Note for loss functions: the schedule divides the returned loss in
place by the number of micro-batches, so report ``loss.detach().clone()``.
* Megatron DDP's grad buffers (``param_and_grad_buffer``), the optimizers' found-inf and
  scale tensors and ``clip_grads``' norm buffers (``device='cuda'``), the distributed
  optimizer's shard buffers: through the same ``torch`` proxy.
* ``Tensor.type()`` names: grad clipping asserts ``'torch.cuda.FloatTensor'`` grads and the
  distributed optimizer sorts parameters by CUDA type names; during those calls only,
  ``Tensor.type()`` names a CPU tensor as its CUDA twin.

Not covered: 16-bit parameters on CPU (the learner refuses bfloat16 without a GPU),
overlapped grad reduce / param gather (CUDA streams), the rerun state machine, and
``sequence_parallel`` (needs Transformer Engine). dist_checkpointing's writer spawns a result-queue manager process
on its first save in a process (~1-3 s here) and forks one writer per bucket.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_applied = False
_originals: dict[tuple[str, str], object] = {}

# Modules whose module-level ``torch`` is replaced by the CPU proxy.
_CUDA_DEVICE_MODULES = (
    ("megatron.core.tensor_parallel.mappings", "torch.cuda.current_device()"),
    ("megatron.core.utils", "torch.cuda.current_device()"),
    ("megatron.core.tensor_parallel.layers", "torch.cuda.current_device()"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "torch.cuda.current_device()"),
    ("megatron.core.pipeline_parallel.p2p_communication", "torch.cuda.current_device()"),
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "torch.cuda.synchronize()"),
    ("megatron.core.dist_checkpointing.strategies.state_dict_saver", "torch.cuda.current_device()"),
    ("megatron.core.pipeline_parallel.schedules", 'device="cuda"'),
    ("megatron.core.distributed.param_and_grad_buffer", "torch.cuda.current_device()"),
    ("megatron.core.optimizer.optimizer", "device='cuda'"),
    ("megatron.core.optimizer.clip_grads", "device='cuda'"),
    ("megatron.core.optimizer.distrib_optimizer", "torch.cuda.current_device()"),
    ("megatron.core.transformer.moe.router", "torch.cuda.current_device()"),
    ("megatron.core.transformer.moe.token_dispatcher", "torch.cuda.Stream()"),
)


@dataclass(kw_only=True, slots=True, frozen=True)
class Patch:
    """One redirection: ``module.attribute`` is replaced; ``marker`` is the CUDA call it avoids."""

    module: str
    attribute: str
    marker: str
    why: str


PATCHES: tuple[Patch, ...] = (
    *(Patch(module=m, attribute="torch", marker=marker,
            why="current CUDA device / synchronize -> CPU / no-op") for m, marker in _CUDA_DEVICE_MODULES),
    Patch(module="megatron.core.fusions.fused_softmax", attribute="get_default_causal_mask",
          marker='device="cuda"', why="causal mask built on CUDA"),
    Patch(module="megatron.core.transformer.utils", attribute="get_default_causal_mask",
          marker='device="cuda"', why="causal mask built on CUDA"),
    Patch(module="megatron.core.tensor_parallel.random", attribute="CudaRNGStatesTracker",
          marker="torch.cuda.get_rng_state()", why="CUDA RNG tracker -> CPU generator"),
    Patch(module="megatron.core.tensor_parallel.random", attribute="_get_all_rng_states",
          marker="_get_cuda_rng_state(", why="activation recomputation saves the CUDA RNG state"),
    Patch(module="megatron.core.tensor_parallel.random", attribute="_set_all_rng_states",
          marker="_set_cuda_rng_state(", why="activation recomputation restores the CUDA RNG state"),
    Patch(module="megatron.core.models.common.language_module.language_module",
          attribute="LanguageModule.setup_embeddings_and_output_layer",
          marker="weight.data.cuda()", why="tied embedding moved to CUDA before its PP all-reduce"),
    Patch(module="megatron.core.optimizer.optimizer", attribute="clip_grad_by_total_norm_fp32",
          marker="param.grad.type() == 'torch.cuda.FloatTensor'",
          why="grad clipping asserts CUDA float grads by type name"),
    Patch(module="megatron.core.optimizer.distrib_optimizer",
          attribute="DistributedOptimizer._build_model_and_main_param_groups",
          marker="model_param.type() == 'torch.cuda.FloatTensor'",
          why="distributed optimizer sorts params by CUDA type names"),
    Patch(module="megatron.core.transformer.moe.token_dispatcher", attribute="maybe_move_tensor_to_cpu",
          marker="tensor.is_cuda", why="the all-to-all's split sizes become numpy only from CUDA tensors"),
    Patch(module="megatron.core.transformer.moe.router", attribute="router_gating_linear",
          marker="RouterGatingLinearFunction.apply",
          why="the MoE router's GEMM names te_general_gemm, undefined without Transformer Engine"),
)


class _CpuStream:
    """The one "stream" of the CPU: work is done when issued, so waits and events are no-ops."""

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by patched modules: the current device is the CPU, and its stream
    the one CPU stand-in."""

    def __init__(self) -> None:
        super().__init__("torch.cuda[cpu-compat]")

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def Stream(*args, **kwargs) -> _CpuStream:  # noqa: N802 (torch's name)
        return _CPU_STREAM

    @staticmethod
    def current_stream(device=None) -> _CpuStream:
        return _CPU_STREAM

    @staticmethod
    def stream(stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


def _on_cpu(factory):
    """A tensor factory whose ``device="cuda"`` means the CPU."""

    @functools.wraps(factory)
    def make(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor")


class _CpuTorch(types.ModuleType):
    """``torch`` with ``cuda`` replaced by ``_CpuCuda`` and tensor factories that map
    ``device="cuda"`` to the CPU; everything else is the real module."""

    def __init__(self) -> None:
        super().__init__("torch[cpu-compat]")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


@functools.lru_cache(maxsize=8)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _make_cpu_rng_tracker(base: type) -> type:
    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's RNG tracker interface over the CPU default generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def _keep_on_cpu(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # only for the duration of this call
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    return wrapper


def _cpu_get_all_rng_states():
    """``(cpu state, no CUDA state, tracker states)``: the recomputed forward replays the CPU generator."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    return torch.get_rng_state(), None, random.get_cuda_rng_tracker().get_states()


def _cpu_set_all_rng_states(cpu_rng_state, cuda_rng_state, cuda_rng_state_tracker):
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    torch.set_rng_state(cpu_rng_state)
    random.get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)


def _torch_router_gating_linear(inp, weight, bias, router_dtype):
    """megatron-core's ``RouterGatingLinearFunction`` without TE: ``inp @ weight.T (+ bias)`` in
    ``router_dtype`` (autograd gives the same gradients its hand-written backward computes)."""
    return torch.nn.functional.linear(inp.to(router_dtype), weight.to(router_dtype),
                                      None if bias is None else bias.to(router_dtype))


def _host_tensor(tensor, as_numpy=False, record_stream=False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` for tensors already on the host: as numpy where asked."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _cuda_type_names(fn):
    """``fn`` during which ``Tensor.type()`` names CPU tensors as their CUDA twins
    (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``); conversions (``type(dtype)``) unchanged."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        original_type = torch.Tensor.type

        def type_(t, dtype=None, non_blocking=False, **kw):
            if dtype is None and not kw and t.device.type == "cpu":
                name = original_type(t)  # a torch function mode may already have renamed it
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            return original_type(t, dtype, non_blocking, **kw)

        torch.Tensor.type = type_  # only for the duration of this call
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = original_type

    return wrapper


def resolve(patch: Patch):
    """(owner object, attribute name, current value) of a patch target; AttributeError if it moved."""
    owner = importlib.import_module(patch.module)
    *path, name = patch.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


def original(patch: Patch):
    """megatron-core's own object at a patch target (also after ``apply()``); AttributeError if it moved."""
    return _originals.get((patch.module, patch.attribute)) or resolve(patch)[2]


def _replacement(patch: Patch, current):
    if patch.attribute == "torch":
        return _CpuTorch()
    if patch.attribute == "get_default_causal_mask":
        return _cpu_causal_mask
    if patch.attribute == "CudaRNGStatesTracker":
        return _make_cpu_rng_tracker(current)
    if patch.attribute == "_get_all_rng_states":
        return _cpu_get_all_rng_states
    if patch.attribute == "_set_all_rng_states":
        return _cpu_set_all_rng_states
    if patch.attribute.endswith("setup_embeddings_and_output_layer"):
        return _keep_on_cpu(current)
    if patch.attribute == "clip_grad_by_total_norm_fp32":
        return _cuda_type_names(current)
    if patch.attribute.endswith("_build_model_and_main_param_groups"):  # a classmethod
        return classmethod(_cuda_type_names(current.__func__))
    if patch.attribute == "router_gating_linear":
        return _torch_router_gating_linear
    if patch.attribute == "maybe_move_tensor_to_cpu":
        return _host_tensor
    raise AssertionError(patch)


def apply(force: bool = False) -> bool:
    """Redirect megatron-core's CUDA-only spots to the CPU; no-op when a GPU is present.

    Returns True when the patches are (now) applied. Idempotent.
    """
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available() and not force:
        return False
    for patch in PATCHES:
        owner, name, current = resolve(patch)  # AttributeError = the target moved
        _originals[(patch.module, patch.attribute)] = current
        setattr(owner, name, _replacement(patch, current))
    # A tracker created before apply() would still be the CUDA one.
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._CUDA_RNG_STATE_TRACKER = None
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    _applied = True
    log.debug("megatron-core CPU redirections applied: %d patches", len(PATCHES))
    return True

