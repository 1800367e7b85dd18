"""Move a worker's parameters and optimizer state to host memory and back, bit for bit.

For the colocated layout: while the rollout engine generates on a GPU, the actor's state sits in
host memory. For the reference and the critic (verl's ``fsdp_config.param_offload`` /
``optimizer_offload`` of those roles): their state sits in host memory between their calls
(:func:`start_resting`, :func:`resident`). The offloader works on storages, not modules: each unique storage behind a
parameter (FSDP2's sharded buffers included), its gradient and every optimizer-state tensor is
copied into a host buffer, then resized to 0 bytes, so the device memory is given back while
every tensor object (and FSDP2's references to it) stays valid. :meth:`StateOffloader.reload`
resizes the storages and copies the bytes back. The same code runs on CPU, where it exercises the
exact path (the "device" storage is freed and restored) without saving anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["StateOffloader", "resident", "start_resting"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class StateOffloader:
    """Offload / reload the parameters (``params``), gradients and optimizer state (``optimizer``)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.module, self.optimizer = module, optimizer
        self._host: dict[str, list[tuple[torch.UntypedStorage, torch.UntypedStorage]]] = {}

    def _tensors(self, what: str) -> Iterator[torch.Tensor]:
        if what == "params":
            for p in self.module.parameters():
                yield _local(p.data)
                if p.grad is not None:
                    yield _local(p.grad)
        elif self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():  # AdamW: exp_avg, exp_avg_sq (the scalar ``step`` stays)
                    if isinstance(v, torch.Tensor) and v.numel() > 1:
                        yield _local(v)

    def is_offloaded(self, what: str) -> bool:
        return what in self._host

    def offload(self, what: str) -> int:
        """Copy ``"params"`` or ``"optimizer"`` state to host buffers and free the storages; returns bytes."""
        if what not in ("params", "optimizer"):
            raise ValueError(f"offload what must be 'params' or 'optimizer', got {what!r}")
        if what in self._host:
            raise RuntimeError(f"{what} already offloaded")
        saved, seen = [], set()
        for t in self._tensors(what):
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            host = torch.UntypedStorage(storage.nbytes(), device="cpu")
            if storage.device.type == "cuda":
                host = host.pin_memory()
            host.copy_(storage)
            saved.append((storage, host))
        for storage, _ in saved:
            storage.resize_(0)
        self._host[what] = saved
        return sum(h.nbytes() for _, h in saved)

    def reload(self, what: str) -> None:
        """Restore what :meth:`offload` freed, byte for byte."""
        for storage, host in self._host.pop(what):
            storage.resize_(host.nbytes())
            storage.copy_(host, non_blocking=storage.device.type == "cuda")
        if torch.cuda.is_available():
            torch.cuda.synchronize()


# ----------------------------------------------------------------------------- between calls (verl's offload)


def start_resting(worker: Any, params: bool, optimizer: bool) -> None:
    """verl's ``fsdp_config.param_offload`` / ``optimizer_offload`` of a reference or critic worker: from
    now on its parameters (+ gradients) / optimizer state live in host memory between calls, and each
    :func:`resident` method brings them back for its own duration. Call at the end of ``init_model``."""
    worker.resting = ("params",) * params + ("optimizer",) * (optimizer and worker.optimizer is not None)
    if worker.resting:
        worker.rest_offloader = StateOffloader(worker.root, worker.optimizer)
        for part in worker.resting:
            worker.rest_offloader.offload(part)


def resident(method: Callable[..., Any]) -> Callable[..., Any]:
    """A worker method that needs its state on the device: with :func:`start_resting` in effect, the
    state comes back first and goes to host memory again afterwards (also when the method raises)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        parts = getattr(self, "resting", ())
        for part in parts:
            self.rest_offloader.reload(part)
        try:
            return method(self, *args, **kwargs)
        finally:
            for part in parts:
                self.rest_offloader.offload(part)

    return wrapper
