"""Remove-padding ops: gather the valid tokens of a padded batch into one packed row and back.

The contract follows flash-attn 2.8's ``bert_padding``:

* ``unpad_input(x (B,S,...), mask (B,S)) -> (x_unpad (nnz,...), indices (nnz,),
  cu_seqlens (B+1,) int32, max_seqlen int, seqused (B,) int32)``
* ``pad_input(x_unpad (nnz,...), indices, B, S) -> (B,S,...)``, zeros on padded slots
* ``index_first_axis(x, indices)``: gather rows, scatter the gradient back.

Masks are validated before any compute: 0/1 only, one contiguous run of ones per row
(left-padded prompt + right-padded response), no empty row.
"""

from __future__ import annotations

import torch

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "validate_attention_mask",
]


class _IndexFirstAxis(torch.autograd.Function):
    """Gather ``x[indices]`` along the first axis; backward scatters into zeros."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = x.shape[0]
        return x.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (indices,) = ctx.saved_tensors
        grad_x = grad_out.new_zeros((ctx.first_axis_dim, *grad_out.shape[1:]))
        grad_x.index_copy_(0, indices, grad_out)  # indices are unique: copy == add
        return grad_x, None


class _IndexPutFirstAxis(torch.autograd.Function):
    """Scatter ``values`` into a zero tensor of ``first_axis_dim`` rows; backward gathers."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        out = values.new_zeros((first_axis_dim, *values.shape[1:]))
        out.index_copy_(0, indices, values)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad_out.index_select(0, indices), None, None


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``x[indices]`` of a tensor, differentiable (gather forward, scatter backward)."""
    return _IndexFirstAxis.apply(x, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A ``(first_axis_dim, ...)`` zero tensor with ``values`` at ``indices``, differentiable."""
    return _IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def validate_attention_mask(attention_mask: torch.Tensor, name: str = "attention_mask") -> None:
    """Raise ValueError unless the mask is (B,S) of 0/1 with one contiguous run of ones per row."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise ValueError(f"{name} must be 2-D (batch, seq), got shape {tuple(attention_mask.shape)}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        bad = attention_mask != attention_mask.round()
        if bool(bad.any()):
            raise ValueError(f"{name} must hold only 0 and 1, found non-integer values")
    m = attention_mask.long()
    if bool(((m != 0) & (m != 1)).any()):
        values = sorted({int(v) for v in m.unique().tolist()} - {0, 1})
        raise ValueError(f"{name} must hold only 0 and 1, found values {values[:5]}")
    empty = (m.sum(dim=1) == 0).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"{name}: row(s) {empty.tolist()[:8]} have no valid token")
    # Number of 0->1 rises (a leading 1 counts as a rise): exactly one per row.
    rises = (m[:, 1:] > m[:, :-1]).sum(dim=1) + m[:, 0]
    holes = (rises != 1).nonzero().flatten()
    if holes.numel():
        row = int(holes[0])
        raise ValueError(
            f"{name}: row(s) {holes.tolist()[:8]} have holes (valid tokens must be one contiguous "
            f"run, e.g. left-padded prompt + right-padded response); row {row} = "
            f"{m[row].tolist()[:64]}"
        )


def _check_batch_shape(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if tuple(hidden_states.shape[:2]) != tuple(attention_mask.shape):
        raise ValueError(
            f"shapes disagree: hidden_states {tuple(hidden_states.shape)} vs attention_mask "
            f"{tuple(attention_mask.shape)} (the first two dimensions must match)"
        )


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the valid tokens of ``hidden_states (B,S,...)`` into ``(nnz,...)``.

    ``unused_mask`` marks tokens that are kept in the packed row but not counted in
    ``seqused`` (flash-attn's contract). Returns ``(x_unpad, indices, cu_seqlens,
    max_seqlen, seqused)``. ``validate=False`` skips the mask checks (already done by the caller).
    """
    if validate:
        validate_attention_mask(attention_mask)
        _check_batch_shape(hidden_states, attention_mask)
    used = attention_mask.bool()
    all_masks = used | unused_mask.bool() if unused_mask is not None else used
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max())
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, _cu_seqlens(seqlens), max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Scatter packed ``(nnz,...)`` back to ``(batch, seqlen, ...)`` with zeros on padded slots."""
    if hidden_states.shape[0] != indices.numel():
        raise ValueError(
            f"shapes disagree: {hidden_states.shape[0]} packed rows vs {indices.numel()} indices"
        )
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
