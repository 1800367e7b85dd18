"""Fused decoder modules applied to a loaded model by name: a registry of hooks (``FUSED_MODULES``).

``liger`` (``actor_rollout_ref.model.use_liger``, verl's key): liger-kernel's fused RMSNorm, SwiGLU
MLP and rotary embedding in the decoder, applied by liger's own instance patch
(``_apply_liger_kernel_to_instance``, which also rebinds the classes and the rotary function of the
model's transformers module). Its cross-entropy and fused-linear-cross-entropy patches stay off: the
LM head is rlpad's (:mod:`rlpad.core.lm_head`). liger-kernel's kernels are Triton on CUDA: a CPU
model is refused before anything changes; liger-kernel is a dependency of the ``gpu`` extra only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

__all__ = ["FUSED_MODULES", "apply_fused_modules", "liger_missing", "register_fused_modules"]

FUSED_MODULES: dict[str, Callable[[nn.Module], list[str]]] = {}


def register_fused_modules(name: str):
    """Decorator: ``fn(model) -> [names of the modules it replaced]`` becomes hook ``name``."""
    def add(fn: Callable[[nn.Module], list[str]]) -> Callable[[nn.Module], list[str]]:
        if name in FUSED_MODULES:
            raise ValueError(f"fused modules {name!r} are already registered")
        FUSED_MODULES[name] = fn
        return fn
    return add


@functools.cache
def liger_missing() -> str | None:
    """None when liger-kernel's transformers patches import, else why not."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means: no liger
        return f"liger-kernel does not import: {e!r}"
    return None


@register_fused_modules("liger")
def apply_liger(model: nn.Module) -> list[str]:
    """liger-kernel's RMSNorm, SwiGLU and rotary on ``model`` (a transformers causal LM)."""
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    before = {name: type(m) for name, m in model.named_modules()}
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    # RMSNorm is patched in place (its forward and class name change), the MLPs by class or forward
    return [name for name, m in model.named_modules()
            if type(m) is not before.get(name) or "forward" in vars(m) or "Liger" in type(m).__name__]


def apply_fused_modules(model: nn.Module, name: str, *, key: str, device_type: str) -> list[str]:
    """Hook ``name`` of :data:`FUSED_MODULES` on ``model``; ValueError naming the config ``key`` when it
    is unknown, when liger-kernel is missing or the model is not meant for CUDA, before any change."""
    if name not in FUSED_MODULES:
        raise ValueError(f"{key}: unknown fused modules {name!r}; choose one of {sorted(FUSED_MODULES)}")
    if name == "liger":
        if device_type != "cuda":
            raise ValueError(f"{key}=true needs a CUDA device (liger-kernel's kernels are Triton on CUDA), "
                             f"the model runs on {device_type!r}")
        if liger_missing():
            raise ValueError(f"{key}=true needs liger-kernel (pip install 'rlpad[gpu]'): {liger_missing()}")
    replaced = FUSED_MODULES[name](model)
    if not replaced:
        raise ValueError(f"{key}=true: liger-kernel has no fused modules for model type "
                         f"{getattr(model.config, 'model_type', None)!r}")
    return replaced
