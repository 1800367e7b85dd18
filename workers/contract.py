"""What a worker method reads from its batch, declared once, and the one check where a batch enters.

``@batch_method(contract)`` on a worker method ``method(self, batch, ...)`` declares a
:class:`Contract`: the keys the method requires, the keys it reads when present, and the keys that
must be finite (a contract, or a function of the worker's config returning one, e.g. ``ref_log_probs``
is required only with ``use_kl_loss``). Everything else derives from it:

* the worker group (:meth:`workers.group.WorkerGroup.call_batch`) ships each rank the declared
  keys the batch holds, nothing else;
* the worker checks the batch once, on every rank together (:func:`check_batch`: keys,
  ``(B, R)`` shapes, finite values, the model inputs), before the first collective;
* the method body gets a :class:`DeclaredBatch` of the declared keys: reading any other key (also
  through ``batch.tensors.get`` or ``in``) raises ``KeyError`` naming the method and the key, on the
  Ray and the local stack alike. Its micro-batches (``index``, ``to``, ``select``) keep the rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from rlpad.batch import Batch
from rlpad.core.forward import check_model_inputs
from rlpad.core.sequence_parallel import SequenceParallel
from rlpad.core.vision import MM_KEY

__all__ = ["FORWARD", "INPUT_KEYS", "JAGGED_KEYS", "Contract", "DeclaredBatch", "batch_method", "check_batch",
           "contract_of", "finite_check", "forward_plus"]

# (B, S) model inputs; every other batch tensor a worker reads is (B, R).
INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")
# Per-row fields of the scored positions only (the jagged layout of rlpad.core.distill_scoring): row b holds a
# (scored positions of b, ...) tensor; a teacher's top-k ids (int32) and log-probs (on-policy distillation)
JAGGED_KEYS = ("teacher_topk_ids", "teacher_topk_log_probs")

Method = TypeVar("Method", bound=Callable[..., Any])


@dataclass(frozen=True)
class Contract:
    """Batch keys of a worker method: ``required``, ``optional`` (read when present) and ``finite``
    (NaN/inf is an error; an optional key is checked when present)."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    finite: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        both = set(self.required) & set(self.optional)
        if both:
            raise ValueError(f"contract: {sorted(both)} both required and optional")
        unknown = set(self.finite) - set(self.keys)
        if unknown:
            raise ValueError(f"contract: finite key(s) {sorted(unknown)} are not declared")

    @property
    def keys(self) -> tuple[str, ...]:
        return self.required + self.optional

    def present(self, batch: Batch) -> list[str]:
        """The declared keys ``batch`` holds (what a worker group ships)."""
        return [k for k in self.keys if k in batch]


FORWARD = Contract(required=("input_ids", "attention_mask", "responses"),
                   optional=("position_ids", "response_mask", MM_KEY))
"""What the scoring core reads (rlpad.core.forward): every log-prob and value method's batch.
``response_mask`` (when present) says which response tokens are scored: multi-turn tool output is not.
``multi_modal_inputs`` (a VL batch, verl's name): each row's images (rlpad.core.vision), a non-tensor."""


def forward_plus(required: tuple[str, ...], optional: tuple[str, ...] = (), finite: tuple[str, ...] = ()) -> Contract:
    """:data:`FORWARD` and more keys (a key it reads when present may become required)."""
    req = (*FORWARD.required, *required)
    return Contract(required=req, optional=tuple(k for k in (*FORWARD.optional, *optional) if k not in req),
                    finite=finite)


class _Declared(dict):
    """The tensors (or non-tensors) of a :class:`DeclaredBatch`: a read of an undeclared key raises."""

    def __init__(self, data: dict[str, Any], declared: frozenset[str], who: str):
        super().__init__(data)
        self.declared, self.who = declared, who

    def _allow(self, key: str) -> None:
        if key not in self.declared:
            raise KeyError(f"{self.who} reads batch key {key!r}, which its @batch_method contract does not declare "
                           f"(declared: {sorted(self.declared)})")

    def __getitem__(self, key: str) -> Any:
        self._allow(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._allow(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._allow(key)
        return super().get(key, default)


@dataclass
class DeclaredBatch(Batch):
    """A :class:`Batch` that only lets ``who`` read the ``declared`` keys (see the module docstring)."""

    declared: frozenset[str] = frozenset()
    who: str = "worker method"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tensors = _Declared(self.tensors, self.declared, self.who)
        self.non_tensors = _Declared(self.non_tensors, self.declared, self.who)


def finite_check(batch: Batch, keys: list[str], who: str) -> None:
    """ValueError naming the first of ``keys`` holding NaN/inf (rows listed); a jagged key's log-probs may
    be -inf (a probability of 0: an empty tail bucket), never NaN or +inf. Integer tensors are finite."""
    for key in keys:
        x = batch[key]
        if key in JAGGED_KEYS:
            rows = [i for i, r in enumerate(x) if r.is_floating_point() and bool((r.isnan() | r.isposinf()).any())]
            if rows:
                raise ValueError(f"{who}: {key} contains NaN or +inf (rows {rows[:8]})")
            continue
        if not x.is_floating_point():
            continue
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            rows = bad.reshape(x.shape[0], -1).any(-1).nonzero().flatten().tolist()
            raise ValueError(f"{who}: {key} contains NaN or inf (rows {rows[:8]})")


def _check_jagged(batch: Batch, key: str, response_length: int, who: str, ids_below: int) -> None:
    """A :data:`JAGGED_KEYS` field: one tensor per row, as many entries as the row's scored positions
    (``response_mask``, else the valid response tokens); ids in [0, ``ids_below``)."""
    rows = batch[key]
    mask = batch.tensors.get("response_mask") if "response_mask" in batch else None
    scored = (mask if mask is not None else batch["attention_mask"][:, -response_length:]).bool().sum(-1).tolist()
    for i, (r, n) in enumerate(zip(rows, scored)):
        if not isinstance(r, torch.Tensor) or r.dim() != 2 or r.shape[0] != n:
            shape = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(f"{who}: {key} row {i} is {shape}, expected ({n}, k): one entry per scored position "
                             "of the row (the jagged layout of rlpad.core.distill_scoring)")
        if not r.is_floating_point() and r.numel() and (int(r.min()) < 0 or int(r.max()) >= ids_below):
            raise ValueError(f"{who}: {key} row {i} holds ids outside [0, {ids_below}) (the model's vocabulary)")


def check_batch(batch: Batch, contract: Contract, who: str, model: nn.Module, use_remove_padding: bool,
                share_prompts: bool = False, sp: SequenceParallel | None = None) -> int:
    """The one check of a batch entering a worker method: ``contract``'s keys, (B, R) response
    tensors, finite values and the model inputs (:func:`rlpad.core.forward.check_model_inputs`); returns R.

    Micro-batches of a checked batch are scored with ``check=False``.
    """
    if not isinstance(batch, Batch):
        raise ValueError(f"{who}: expected an rlpad.batch.Batch, got {type(batch).__name__}")
    batch.require(*contract.required, who=who)
    if len(batch) == 0:
        raise ValueError(f"{who}: empty batch")
    response_length = int(batch["responses"].shape[1])
    keys = contract.present(batch)
    for k in keys:
        if k in JAGGED_KEYS:
            _check_jagged(batch, k, response_length, who, model.get_input_embeddings().num_embeddings)
            continue
        x = batch[k]
        if not isinstance(x, torch.Tensor):  # a per-row non-tensor (multi_modal_inputs: checked with the inputs)
            continue
        if k not in INPUT_KEYS and tuple(x.shape) != (len(batch), response_length):
            raise ValueError(f"{who}: {k} has shape {tuple(x.shape)}, expected (rows, response_length) = "
                             f"{(len(batch), response_length)}")
    finite_check(batch, [k for k in contract.finite if k in keys], who)
    try:
        check_model_inputs(model, batch["input_ids"], batch["attention_mask"], batch.tensors.get("position_ids"),
                           response_length, use_remove_padding=use_remove_padding,
                           share_prompts=share_prompts, sp=sp,
                           response_mask=batch.tensors.get("response_mask") if "response_mask" in keys else None,
                           multi_modal_inputs=batch.non_tensors.get(MM_KEY) if MM_KEY in keys else None)  # fmt: skip
    except TypeError as e:
        raise ValueError(f"{who}: {e}") from e
    return response_length


ContractSpec = Contract | Callable[[Any], Contract]


def batch_method(contract: ContractSpec, *, roles: tuple[str, ...] | None = None) -> Callable[[Method], Method]:
    """Declare what worker method ``method(self, batch, ...)`` reads: ``contract``, or a function of
    the worker's ``config`` returning it. ``roles``: the worker roles that may call it.

    The wrapped method raises RuntimeError on another role, checks the batch on every rank
    together (a ValueError on any rank stops all of them before the first collective, see
    ``FSDPWorker._agree``) and runs the body on a :class:`DeclaredBatch`. The contract function
    is the method's ``contract`` attribute (:func:`contract_of`).
    """
    spec = contract if callable(contract) and not isinstance(contract, Contract) else (lambda _config: contract)

    def wrap(method: Method) -> Method:
        who = method.__name__

        @functools.wraps(method)
        def run(self: Any, batch: Batch, *args: Any, **kwargs: Any) -> Any:
            if roles is not None and self.role not in roles:
                raise RuntimeError(f"{who} called on a {self.role!r} worker")
            self._require_model()
            c, mcfg = spec(self.config), self.config.model
            self._agree(lambda: check_batch(batch, c, who, self.model, mcfg.use_remove_padding, mcfg.share_prompts,
                                            self.sp))  # fmt: skip
            declared = frozenset(c.keys)
            view = DeclaredBatch({k: v for k, v in batch.tensors.items() if k in declared},
                                 {k: v for k, v in batch.non_tensors.items() if k in declared},
                                 dict(batch.meta), declared=declared, who=who)  # fmt: skip
            return method(self, view, *args, **kwargs)

        run.contract = spec  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return wrap


def contract_of(worker_cls: type, method: str, config: Any) -> Contract:
    """The :class:`Contract` of ``worker_cls.method`` under ``config``; ValueError if it declares none."""
    spec = getattr(getattr(worker_cls, method, None), "contract", None)
    if spec is None:
        raise ValueError(f"{worker_cls.__name__}.{method} is not a @batch_method: it declares no batch contract")
    return spec(config)
