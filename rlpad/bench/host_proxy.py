"""The host side of a GPU forward, measured on the CPU (issue #54): what it dispatches and what it reads.

A GPU waits on its host when the host dispatches kernels slower than the GPU runs them, and stops
dead at every read of a device value (a synchronising call). Both are properties of the code path,
not of the GPU, so they are counted here without one:

* :func:`gpu_code_path` — the attention dispatch (:mod:`rlpad.core.attn_dispatch`) sees on ``meta``
  (and on the CPU with ``cpu=True``) what an sm90 GPU with torch's varlen kernel offers, so
  ``rlpad_varlen`` takes its CUDA branch. ``cpu=True`` also gives the heavy ops (FlashAttention's
  forward and the GEMMs ``mm`` / ``addmm``) CPU stand-ins that return uninitialised outputs of the
  right shapes: their device work is free, their host work (the wrappers, the custom op, the
  dispatch, a Python kernel call about as dear as a GPU launch) is real. For host timing only.
* :class:`DeviceOps` — counts the ops whose output is on the device (``meta``), views aside: each is
  one kernel launch or more on a GPU; per name, with output bytes, integer outputs (an index being
  built) and host-to-device copies.
* :class:`DeviceReads` — counts the reads of device values by the host (``.item()``, ``.tolist()``,
  ``nonzero``, boolean-mask indexing, ``unique``, a copy to the host, ...): each a synchronising call
  on a GPU. ``meta`` has no data, so each device tensor made from host data (the batch moved to the
  device) keeps a CPU twin that follows it through the ops; a read is answered from the twin and
  counted, with the line of rlpad that made it. A read of a value with no twin (an activation)
  raises :class:`UntrackedRead`.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

import rlpad.core.attn_dispatch as attn_dispatch
from rlpad.core.attn_dispatch import DeviceKernels

__all__ = ["READ_OPS", "SM90", "STAND_INS", "VIEW_OPS", "DeviceOps", "DeviceReads", "UntrackedRead",
           "gpu_code_path"]

SM90 = DeviceKernels(cuda=True, capability=(9, 0), torch_varlen=True)  # an H100 / H200 with torch's varlen kernel
# Ops that only make a view (no kernel on a GPU).
VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.slice", "aten.select", "aten.unsqueeze",
    "aten.squeeze", "aten.expand", "aten.detach", "aten.split_with_sizes", "aten.split", "aten.unbind", "aten.alias",
    "aten.lift_fresh", "aten.permute", "aten.as_strided", "aten._reshape_alias", "aten.unflatten", "aten.view_as"})
# The varlen attention ops: their integer output is the kernel's RNG state, not an index.
ATTENTION_OPS = frozenset({"torch_attn._varlen_attn", "aten._flash_attention_forward"})
# Ops that read device values on the host (a synchronising call on a GPU), besides copies to the host.
READ_OPS = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2",
                      "aten.unique_dim", "aten.unique_consecutive", "aten.equal", "aten.is_nonzero"})


def _mm_stand_in(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


def _addmm_stand_in(bias, a, b, *, beta=1, alpha=1):
    return a.new_empty((a.shape[0], b.shape[1]))


def _flash_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                    window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                    block_table=None, num_splits=None):
    """``aten::_flash_attention_forward`` on the CPU, for host timing only: outputs of the right shapes, no work."""
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return q.new_empty(q.shape), lse, q.new_empty((2,), dtype=torch.uint64), q.new_empty(0), q.new_empty(0)


STAND_INS = {"_flash_attention_forward": _flash_stand_in, "mm": _mm_stand_in, "addmm": _addmm_stand_in}


@contextlib.contextmanager
def gpu_code_path(*, cpu: bool = False) -> Iterator[None]:
    """Inside: the attention dispatch sees :data:`SM90` on ``meta`` (and on the CPU when ``cpu``, with
    the ops of :data:`STAND_INS` no-work stand-ins there: host timing only, the numbers are garbage)."""
    real = attn_dispatch.device_kernels
    types = {"meta", "cpu"} if cpu else {"meta"}
    attn_dispatch.device_kernels = lambda device: SM90 if torch.device(device).type in types else real(device)
    lib = None
    if cpu:
        lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - scoped: destroyed on exit
        with warnings.catch_warnings():  # mm / addmm have CPU kernels: overriding them is the point
            warnings.simplefilter("ignore")
            for op, fn in STAND_INS.items():
                lib.impl(op, fn, "CPU")
    try:
        yield
    finally:
        attn_dispatch.device_kernels = real
        if lib is not None:
            lib._destroy()


def _tensors(out) -> list[torch.Tensor]:
    return [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]


class DeviceOps(TorchDispatchMode):
    """Counts the ops whose output is on ``device`` (default ``meta``), views aside: ``ops`` by name,
    ``bytes`` of their outputs by name, ``ints`` (ops whose output is an integer tensor: an index
    being built; the varlen attention's own RNG state aside) and ``h2d`` (copies of a host tensor
    to the device)."""

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = device
        self.ops: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.ints: Counter[str] = Counter()
        self.h2d = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = _tensors(out)
        name = str(func.overloadpacket)
        on_device = [o for o in outs if o.device.type == self.device]
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "aten._to_copy" and source is not None and source.device.type == "cpu" and on_device:
            self.h2d += 1
        if on_device and name not in VIEW_OPS:
            self.ops[name] += 1
            self.bytes[name] += sum(o.numel() * o.element_size() for o in on_device)
            if name not in ATTENTION_OPS and any(not (o.is_floating_point() or o.is_complex()) for o in on_device):
                self.ints[name] += 1
        return out

    def total(self) -> int:
        return sum(self.ops.values())


class UntrackedRead(RuntimeError):
    """The host read a device value that is not a copy of host data (an activation): no twin to answer it."""


def _caller() -> str:
    """``path:line`` of the innermost rlpad frame on the stack (where a read was made)."""
    for frame in reversed(traceback.extract_stack()):
        if "/rlpad/" in frame.filename and "/rlpad/bench/host_proxy.py" not in frame.filename:
            return f"{frame.filename[frame.filename.rindex('/rlpad/') + 1:]}:{frame.lineno}"
    return "?"


class DeviceReads(TorchDispatchMode):
    """Counts the host's reads of device (``meta``) values; see the module docstring. ``reads``: by op
    name; ``where``: by the rlpad line that made them."""

    def __init__(self):
        super().__init__()
        self.twins = WeakTensorKeyDictionary()
        self.reads: Counter[str] = Counter()
        self.where: Counter[str] = Counter()

    def total(self) -> int:
        return sum(self.reads.values())

    def _is_read(self, name: str, args, kwargs) -> bool:
        if name in READ_OPS:
            return True
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "aten._to_copy":  # a device tensor copied to the host
            return first is not None and first.device.type == "meta" and str(kwargs.get("device", "meta")) == "cpu"
        if name == "aten.copy_":
            return args[0].device.type == "cpu" and args[1].device.type == "meta"
        if name == "aten.repeat_interleave":  # the output size is data-dependent unless given
            return kwargs.get("output_size") is None and any(
                isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args)
        if name in ("aten.index", "aten.index_put", "aten.index_put_"):  # boolean masks: a nonzero inside
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        flat, spec = tree_flatten((args, kwargs))
        on_device = [a for a in flat if isinstance(a, torch.Tensor) and a.device.type == "meta"]
        twinned = bool(on_device) and all(a in self.twins for a in on_device)
        twin_call = (lambda: func(*tree_unflatten([self.twins.get(a, a) if isinstance(a, torch.Tensor) else a
                                                   for a in flat], spec)[0],
                                  **tree_unflatten([self.twins.get(a, a) if isinstance(a, torch.Tensor) else a
                                                    for a in flat], spec)[1]))
        if on_device and self._is_read(name, args, kwargs):
            if not twinned:
                raise UntrackedRead(f"{name} reads a device value that is no copy of host data, at {_caller()}")
            self.reads[name] += 1
            self.where[_caller()] += 1
            got = twin_call()
            if name in ("aten._local_scalar_dense", "aten._to_copy", "aten.equal", "aten.is_nonzero"):
                return got
            if name == "aten.copy_":
                return args[0]
            out = tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                           if isinstance(t, torch.Tensor) else t, got)  # data-dependent shapes, from the twin
            for o, g in zip(_tensors(out), _tensors(got)):
                self.twins[o] = g
            return out
        out = func(*args, **kwargs)
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "aten._to_copy" and source is not None and source.device.type == "cpu":
            for o in _tensors(out):  # host data moved to the device: its copy is its twin
                self.twins[o] = source.clone().to(dtype=o.dtype)
        elif twinned:
            for o, g in zip(_tensors(out), _tensors(twin_call())):
                if o.device.type == "meta":
                    self.twins[o] = g
        return out
