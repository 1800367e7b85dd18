"""Fused decoder modules applied to a loaded model by name: a registry of hooks (``FUSED_MODULES``).

``liger`` (``actor_rollout_ref.model.use_liger``, verl's key): liger-kernel's fused RMSNorm, SwiGLU
MLP and rotary embedding in the decoder, applied by liger's own instance patch
(``_apply_liger_kernel_to_instance``). That patch also rebinds names of the model's transformers module
(the norm and MLP classes, the rotary function) for the whole process: they are undone at once and the
rotary function is put back only while one of THIS model's decoder layers runs (forward hooks), so
every other model in the process keeps transformers' own (the GPU run of 2026-11-27 found a CPU
model built after a liger one running liger's Triton RMSNorm). Its cross-entropy and fused-linear-cross-entropy patches stay off: the
LM head is rlpad's (:mod:`rlpad.core.lm_head`). liger-kernel's kernels are Triton on CUDA: a CPU
model is refused before anything changes; liger-kernel is a dependency of the ``gpu`` extra only.

``rms_norm`` (no config key yet: ``rlpad bench host --device cuda`` measures whether it pays): every
RMSNorm module of the transformers kind (``weight * x / sqrt(mean(x^2) + variance_epsilon)``, checked per
class against its own forward in fp64; Gemma's ``1 + weight`` norms and any other formula are left
alone) runs aten's ``_fused_rms_norm`` (an instance attribute): on CUDA one kernel forward and one
backward for the seven of transformers' forward (12 fewer launches per decoder layer), fp32 inside and
ONE rounding to the input's dtype (transformers rounds the normalised x, then multiplies by the weight:
two); on the CPU torch runs its composite of the same arithmetic (fp32: the same numbers).

``compile`` (``actor_rollout_ref.model.compile_decoder_layers``): each decoder layer's forward under
``torch.compile`` on its own instance (an instance attribute, as liger's MLP patch: module hooks, FSDP's
all-gathers, stay outside the compiled code; ``dynamic=True``: one graph for every packed
length: recompiles stay few and are counted; the class and every other model are left
alone). rlpad's varlen attention reads the sequence bounds on the host: it runs between two compiled
graphs. :func:`compile_counts` counts the graphs compiled (recompiles included). Measured by
``rlpad bench logprob --device cuda`` (column ``packed_compiled``); kept only if the GPU run says it pays.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["COMPILE_BACKEND", "FUSED_MODULES", "apply_fused_modules", "compile_counts", "compile_decoder_layers",
           "liger_missing", "register_fused_modules", "scope_module_rebinds"]

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
    """liger-kernel's RMSNorm, SwiGLU and rotary on ``model`` (a transformers causal LM), on this model alone."""
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    before = {name: type(m) for name, m in model.named_modules()}
    scope_module_rebinds(model, lambda: _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False))
    # RMSNorm is patched in place (its forward and class name change), the MLPs by class or forward
    return [name for name, m in model.named_modules()
            if type(m) is not before.get(name) or "forward" in vars(m) or "Liger" in type(m).__name__]


def scope_module_rebinds(model: nn.Module, patch: Callable[[], None]) -> dict[str, object]:
    """Runs ``patch()``; the names it rebinds in the model's transformers module are undone at once and
    put back only while a decoder layer of ``model`` runs (a forward pre-hook and an always-called
    forward hook per layer, so activation-checkpoint recomputes see them too). Returns the rebinds."""
    module = sys.modules[type(model).__module__]
    before = dict(vars(module))
    patch()
    rebinds = {k: v for k, v in vars(module).items() if before.get(k) is not v}

    def restore(*_) -> None:
        for k in rebinds:
            setattr(module, k, before[k]) if k in before else delattr(module, k)

    def put_back(*_) -> None:
        for k, v in rebinds.items():
            setattr(module, k, v)

    restore()
    if rebinds:
        backbone = getattr(model, model.base_model_prefix, model)
        for layer in getattr(backbone, "layers", None) or [model]:
            layer.register_forward_pre_hook(put_back)
            layer.register_forward_hook(restore, always_call=True)
    return rebinds


def _is_plain_rms_norm(module: nn.Module, cache: dict[type, bool]) -> bool:
    """True when ``module``'s class computes ``weight * x * rsqrt(mean(x^2) + variance_epsilon)``: checked
    once per class on a random fp32 input against aten's op (equal to fp32 rounding; another formula,
    Gemma's ``1 + weight``, is off by O(1))."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    named = type(module).__name__.endswith("RMSNorm")
    if not named or not isinstance(eps, float) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return False
    kind = type(module)
    if kind not in cache:
        import copy

        probe = copy.deepcopy(module).to(device="cpu", dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            probe.weight.copy_(torch.rand(probe.weight.shape, generator=gen) + 0.5)
            x = torch.randn(3, weight.shape[0], generator=gen)
            theirs = kind.forward(probe, x)
            ours = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], probe.weight, probe.variance_epsilon)[0]
        cache[kind] = theirs.shape == ours.shape and bool(torch.allclose(theirs, ours, rtol=1e-5, atol=1e-6))
    return cache[kind]


def _fused_rms_norm_of(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward as aten's ``_fused_rms_norm`` (its own forward where the dtypes differ)."""
    own = module.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != module.weight.dtype:
            return own(hidden_states)
        return torch.ops.aten._fused_rms_norm(hidden_states, [hidden_states.shape[-1]], module.weight,
                                              module.variance_epsilon)[0]
    return forward


@register_fused_modules("rms_norm")
def fuse_rms_norms(model: nn.Module) -> list[str]:
    """Every plain RMSNorm of ``model`` (:func:`_is_plain_rms_norm`) on aten's ``_fused_rms_norm``; on this
    model alone. ValueError when this torch has no such op."""
    if not hasattr(torch.ops.aten, "_fused_rms_norm"):
        raise ValueError(f"torch {torch.__version__} has no aten._fused_rms_norm (it came with torch 2.8)")
    cache: dict[type, bool] = {}
    replaced = []
    for name, module in model.named_modules():
        if "forward" not in vars(module) and _is_plain_rms_norm(module, cache):  # not already patched (liger)
            module.forward = _fused_rms_norm_of(module)
            replaced.append(name)
    return replaced


COMPILE_BACKEND = "inductor"
_COMPILED: dict[str, int] = {"graphs": 0}


def compile_counts() -> dict[str, int]:
    """``{"graphs": n}``: graphs the compiled decoder layers have compiled in this process so far."""
    return dict(_COMPILED)


def _counting(backend: str) -> Callable:
    """A torch.compile backend: ``backend`` (by name), each graph it is handed counted."""
    from torch._dynamo import lookup_backend

    inner = lookup_backend(backend)

    def compile_graph(gm, example_inputs):
        _COMPILED["graphs"] += 1
        return inner(gm, example_inputs)
    return compile_graph


def compile_decoder_layers(model: nn.Module, backend: str | None = None) -> list[str]:
    """Each decoder layer of ``model`` (a causal LM or its backbone, as the critic holds it) under
    ``torch.compile(dynamic=True)`` (per instance), with ``backend`` (default :data:`COMPILE_BACKEND`;
    the CPU tests may name ``aot_eager``)."""
    prefix = model.base_model_prefix
    owner = getattr(model, prefix, None)
    if getattr(owner, "layers", None) is None:  # the backbone itself
        owner, prefix = model, ""
    layers = getattr(owner, "layers", None)
    if layers is None:
        return []
    compiler = _counting(backend or COMPILE_BACKEND)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, backend=compiler)
    return [f"{prefix}.layers.{i}".lstrip(".") for i in range(len(layers))]


register_fused_modules("compile")(compile_decoder_layers)


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
        raise ValueError(f"{key}=true: {name!r} has no modules to replace in model type "
                         f"{getattr(model.config, 'model_type', None)!r}")
    return replaced
