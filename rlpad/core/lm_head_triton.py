"""The fused LM head on CUDA (Triton): per-token log-prob and entropy with fp32 logits.

Forward, one kernel (:func:`_stats_kernel`): a program owns ``BLOCK_N`` tokens and a slice of the
vocabulary; over its V tiles it forms ``z = h @ W_tile^T (+ b) / T`` with a tensor-core dot in
fp32 accumulation (its partial sums moved out of the tensor core every ``Tiles.promote`` hidden
elements: the tensor cores' accumulation truncates) and keeps, online, ``m = max z``, ``s = sum exp(z - m)``, ``t = sum exp(z - m)
(z - m)`` (centred: its rounding scales with the entropy, not with |z|) and the label's ``z``.
Nothing (N, V) is written: the slices' (m, s, t, z_label) are (splits, N) and merged in torch into
``lse = m + log s``, ``E_p[z] = m + t / s``, ``log_prob = z_label - lse``, ``entropy = log s - t / s``
(fp32, no cancellation of m), and ``lse`` and ``E_p[z]`` are saved for the backward. The
vocabulary is split over programs so that a few thousand tokens still fill every SM.

Backward: with ``p = exp(z - lse)``, ``dz = (g_lp (onehot(y) - p) - g_H p (z - E_p[z])) / T``.
One kernel (:func:`_dz_kernel`, a GEMM with this epilogue) recomputes z tile by tile and writes
dz in the weight's dtype for a slice of the vocabulary (all tokens x ``v_block`` columns, at most
``chunk_size x V`` elements and :data:`~rlpad.core.lm_head_plan.DZ_BUDGET_BYTES`:
:func:`~rlpad.core.lm_head_plan.dz_columns`); then two cuBLAS GEMMs in that dtype with fp32
accumulation: ``grad_W[slice] = dz^T @ h`` (complete per slice: no fp32 weight-sized buffer, no
accumulation across chunks) and ``grad_h += dz @ W[slice]`` (an fp32 (N, H) accumulator when there
are several slices, the GEMM adding into it: :func:`~rlpad.core.lm_head.addmm_fp32_`). The bias
gradient is ``dz.sum(0)`` in fp32.

Launch plan (:mod:`rlpad.core.lm_head_plan`): tiles from a table per device capability and token
count, the forward's programs in a grouped order (a wave of resident programs shares a few hidden
panels that stay in L2) and every offset of h, W and dz in int64 (N x V, N x H pass 2^31).

Why this design: the three GEMMs (logits, grad_hidden, grad_weight) are the floor, and cuBLAS
does the two backward ones at full tensor-core speed; the only extra work is the recompute of the
logits inside :func:`_dz_kernel` plus one bf16 write and two reads of dz. liger-kernel's fused
linear cross-entropy has no entropy; verl's kernel lives inside verl (no dependency).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlpad.core.lm_head import addmm_fp32_
from rlpad.core.lm_head_plan import (DZ_BUDGET_BYTES, GRID_ORDERS, Tiles, choose_tiles, device_gpu, dz_columns, l2_group,
                                     plan_splits, resident_programs)

__all__ = ["INTERPRETER_TILES", "TritonHead", "head_stats", "launch_dz", "tiles_for",
           "triton_log_probs_and_entropy"]

INTERPRETER_TILES = Tiles(32, 32, 32, 4, 1, promote=64)  # Triton's interpreter (CPU tensors): warps, stages unused
ORDER_IDS = {name: i for i, name in enumerate(GRID_ORDERS)}  # the kernel's ORDER constexpr
DZ_GROUP = 8  # _dz_kernel's grouped order: token blocks that share each W tile in L2


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, temperature,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, PROMOTE: tl.constexpr):
    """z (BLOCK_N, BLOCK_V) fp32 = (h[rows] @ W[cols]^T + b[cols]) / temperature. ``PROMOTE`` (K blocks; 0:
    never): the dot accumulates that many blocks from zero into ``part``, then one fp32 add (to nearest)
    moves ``part`` into ``acc``: the tensor core's truncating accumulation never spans the whole hidden
    size (:data:`rlpad.core.lm_head_plan.PROMOTE`). ``part`` restarts from a loop-carried zero, not a
    constant one: Triton folds ``acc + dot(a, b, 0)`` back into ``dot(a, b, acc)``."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    part = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        kk = k + ks
        k_ok = kk < H
        a = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_w + kk[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if PROMOTE == 0:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        else:
            part = tl.dot(a, b, part, input_precision=PRECISION)
            if (k // BLOCK_K) % PROMOTE == PROMOTE - 1:
                acc += part
                part = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if PROMOTE != 0:
        acc += part
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc / temperature


@triton.jit
def _program(pid, n_blocks, splits, ORDER: tl.constexpr, GROUP: tl.constexpr):
    """``(token block, split)`` of program ``pid`` in grid order ``ORDER`` (:data:`ORDER_IDS`; the
    Python twin, with the reasons: :func:`rlpad.core.lm_head_plan.program_coords`)."""
    if ORDER == 0:  # token_fastest
        pid_n, split = pid % n_blocks, pid // n_blocks
    elif ORDER == 1:  # vocab_fastest
        pid_n, split = pid // splits, pid % splits
    else:  # grouped: GROUP token blocks x every split, token fastest inside the group
        per_group = GROUP * splits
        first = (pid // per_group) * GROUP
        size = tl.minimum(n_blocks - first, GROUP)
        pid_n, split = first + (pid % per_group) % size, (pid % per_group) // size
    return pid_n, split


# Sizes vary per call and carry no alignment the loads need: not specialised (one compile per flag set);
# the row strides are (divisible by 16: aligned, vectorised loads of h and W).
@triton.jit(do_not_specialize=["N", "V", "tiles_per_split", "n_blocks", "splits"])
def _stats_kernel(h_ptr, w_ptr, b_ptr, y_ptr, m_ptr, s_ptr, t_ptr, zl_ptr, N, V, H, stride_h, stride_w,
                  temperature, tiles_per_split, n_blocks, splits, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, ORDER: tl.constexpr, GROUP: tl.constexpr,
                  PRECISION: tl.constexpr, PROMOTE: tl.constexpr):
    """Program (token block, split): online (m, s, t, z_label) over the split's V tiles -> [split, rows]."""
    pid_n, split = _program(tl.program_id(0), n_blocks, splits, ORDER, GROUP)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < N
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zl = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(V, BLOCK_V))
    for tile in range(first, last):
        cols = (tile * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, temperature,
                         HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, PRECISION, PROMOTE)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        scale = tl.exp(m - m_new)
        d = z - m_new[:, None]  # <= 0; -inf past V
        e = tl.exp(d)  # 0 past V
        # t is centred on the running max: t = sum e (z - m); moving m to m_new shifts it by s (m - m_new)
        t = scale * (t + s * tl.where(s > 0, m - m_new, 0.0)) + tl.sum(e * tl.where(col_ok[None, :], d, 0.0), axis=1)
        s = s * scale + tl.sum(e, axis=1)
        zl += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        m = m_new
    out = split.to(tl.int64) * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)
    tl.store(zl_ptr + out, zl, mask=row_ok)


@triton.jit(do_not_specialize=["N", "v_start", "VB"])
def _dz_kernel(h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, dz_ptr, N, v_start, VB, H,
               stride_h, stride_w, stride_dz, temperature, HAS_BIAS: tl.constexpr, HAS_GLP: tl.constexpr,
               HAS_GENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_N: tl.constexpr, PRECISION: tl.constexpr, PROMOTE: tl.constexpr):
    """Program = one (BLOCK_N, BLOCK_V) tile of dz (N, VB) for the columns v_start + [0, VB)."""
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    blocks_v = tl.cdiv(VB, BLOCK_V)
    per_group = GROUP_N * blocks_v  # grouped order (DZ_GROUP)
    first_n = (pid // per_group) * GROUP_N
    size = tl.minimum(blocks_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % size
    pid_v = (pid % per_group) // size
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    local = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    row_ok = rows < N
    col_ok = local < VB
    cols = v_start + local
    z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, temperature,
                     HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, PRECISION, PROMOTE)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    p = tl.exp(z - lse[:, None])
    dz = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if HAS_GLP:
        g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
        y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
        dz += g_lp[:, None] * (tl.where(cols[None, :] == y[:, None], 1.0, 0.0) - p)
    if HAS_GENT:
        g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        ez = tl.load(ez_ptr + rows, mask=row_ok, other=0.0)
        dz -= g_ent[:, None] * p * (z - ez[:, None])
    dz = dz / temperature
    tl.store(dz_ptr + rows[:, None] * stride_dz + local[None, :], dz.to(dz_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact fp32 products for fp32 operands (tests), native for bf16 / fp16."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tiles_for(device: torch.device, tokens: int) -> Tiles:
    """The launch configuration for ``tokens`` on ``device``: the table's (logged once per choice)."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    _, capability, smem = device_gpu(device)
    return choose_tiles(capability, tokens, smem)


def head_stats(hidden, weight, bias, labels, temperature, *, tiles: Tiles, splits: int | None = None):
    """``(log_prob, entropy, lse, E_p[z])``, each (N,) fp32, from one fused pass (no (N, V) tensor).
    ``hidden (N, H)`` and ``weight (V, H)`` need unit stride along H only."""
    n, h = hidden.shape
    v = weight.shape[0]
    gpu = device_gpu(hidden.device)[0]
    n_blocks, v_tiles = triton.cdiv(n, tiles.block_n), triton.cdiv(v, tiles.block_v)
    group = l2_group(tiles, h, gpu.l2_bytes, hidden.element_size())  # not capped by N: a constexpr, one compile
    splits = splits or plan_splits(n_blocks, v_tiles, gpu.sms, resident_programs(tiles, gpu), group, tiles.order)
    per_split = triton.cdiv(v_tiles, splits)
    splits = triton.cdiv(v_tiles, per_split)  # every split gets at least one tile
    m, s, t, zl = torch.empty(4, splits, n, dtype=torch.float32, device=hidden.device)
    _stats_kernel[(n_blocks * splits,)](
        hidden, weight, bias if bias is not None else weight, labels, m, s, t, zl, n, v, h, hidden.stride(0),
        weight.stride(0), float(temperature), per_split, n_blocks, splits, HAS_BIAS=bias is not None,
        BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_K=tiles.block_k, ORDER=ORDER_IDS[tiles.order],
        GROUP=group if tiles.order == "grouped" else 1, PRECISION=_precision(hidden.dtype),
        PROMOTE=tiles.promote // tiles.block_k, num_warps=tiles.warps, num_stages=tiles.stages)  # fmt: skip
    top = m.amax(dim=0)
    shift = m - top  # <= 0
    scale = torch.exp(shift)
    total = (s * scale).sum(dim=0)
    centred = (scale * (t + s * shift)).sum(dim=0) / total  # E_p[z] - top
    log_total = total.log()
    lse = top + log_total
    return zl.sum(dim=0) - lse, log_total - centred, lse, top + centred


def launch_dz(out, start, hidden, weight, bias, labels, lse, mean_z, grad_log_probs, grad_entropy, temperature,
              tiles: Tiles) -> None:
    """dz of the columns ``start + [0, out.shape[1])`` into ``out (N, VB)`` (unit column stride, any row
    stride), in ``out``'s dtype; ``grad_*`` (N,) fp32 or None (that term dropped)."""
    n, vb = out.shape
    grid = (triton.cdiv(n, tiles.block_n) * triton.cdiv(vb, tiles.block_v),)
    _dz_kernel[grid](
        hidden, weight, bias if bias is not None else weight, labels, lse, mean_z,
        grad_log_probs if grad_log_probs is not None else lse, grad_entropy if grad_entropy is not None else lse,
        out, n, start, vb, hidden.shape[1], hidden.stride(0), weight.stride(0), out.stride(0), float(temperature),
        HAS_BIAS=bias is not None, HAS_GLP=grad_log_probs is not None, HAS_GENT=grad_entropy is not None,
        BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_K=tiles.block_k, GROUP_N=DZ_GROUP,
        PRECISION=_precision(hidden.dtype), PROMOTE=tiles.promote // tiles.block_k, num_warps=tiles.warps,
        num_stages=tiles.stages)  # fmt: skip


def _unit_stride(x):
    """``x`` itself when its last dimension is contiguous (any row stride: the kernels take it), else a copy."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


class TritonHead(torch.autograd.Function):
    """Log-prob and entropy through the LM head with the fused kernels (see the module docstring).

    ``hidden (N, H)`` and ``weight (V, H)`` share one dtype (bf16 / fp16 on CUDA; fp16 / fp32 under
    Triton's interpreter); the backward's dz buffer holds at most ``chunk_size x V`` elements and
    ``dz_budget`` bytes (:func:`~rlpad.core.lm_head_plan.dz_columns`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, calculate_entropy, tiles, splits,
                dz_budget):
        hidden, weight, bias, labels = _unit_stride(hidden), _unit_stride(weight), _unit_stride(bias), labels.contiguous()
        tiles = tiles or tiles_for(hidden.device, hidden.shape[0])
        log_probs, entropy, lse, mean_z = head_stats(hidden, weight, bias, labels, temperature, tiles=tiles,
                                                     splits=splits)  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, labels, lse, mean_z)
        ctx.temperature, ctx.chunk_size, ctx.tiles, ctx.dz_budget = temperature, chunk_size, tiles, dz_budget
        ctx.set_materialize_grads(False)  # an unused output's gradient is None: the kernel drops its term
        if not calculate_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, labels, lse, mean_z = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        nothing = (None,) * 10
        if not (need_h or need_w or need_b) or (grad_log_probs is None and grad_entropy is None):
            return nothing
        n, h = hidden.shape
        v = weight.shape[0]
        v_block = dz_columns(n, v, ctx.tiles.block_v, ctx.chunk_size, weight.element_size(), ctx.dz_budget)
        slices = [(s, min(s + v_block, v)) for s in range(0, v, v_block)]
        grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(v, dtype=torch.float32, device=weight.device) if need_b else None
        grad_h = None
        if need_h and len(slices) > 1:
            grad_h = torch.zeros(n, h, dtype=torch.float32, device=hidden.device)
        glp = grad_log_probs.float().contiguous() if grad_log_probs is not None else None
        gent = grad_entropy.float().contiguous() if grad_entropy is not None else None
        buffer = torch.empty(n, v_block, dtype=weight.dtype, device=weight.device)
        for start, end in slices:
            d = buffer[:, : end - start]  # dz of this slice (row stride v_block)
            launch_dz(d, start, hidden, weight, bias, labels, lse, mean_z, glp, gent, ctx.temperature, ctx.tiles)
            if grad_w is not None:
                torch.mm(d.t(), hidden, out=grad_w[start:end])
            if need_h:
                if len(slices) == 1:
                    grad_h = torch.mm(d, weight)
                else:
                    addmm_fp32_(grad_h, d, weight[start:end])
            if grad_b is not None:
                grad_b[start:end] = d.sum(dim=0, dtype=torch.float32)
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, *nothing[3:]


def triton_log_probs_and_entropy(hidden, weight, labels, *, bias=None, temperature=1.0, chunk_size=1024,
                                 calculate_entropy=True, tiles: Tiles | None = None, splits: int | None = None,
                                 dz_budget: int = DZ_BUDGET_BYTES):
    """``(log_probs (N,), entropy (N,))`` fp32 through the fused head; inputs checked by the caller
    (:func:`rlpad.core.logprob.chunked_log_probs_and_entropy`). ``tiles`` (default: the table's for
    this GPU and N), ``splits`` (vocabulary splits of the forward) and ``dz_budget`` (bytes of the
    backward's dz slice): the tests and the sweep set them to cross every boundary and order."""
    return TritonHead.apply(hidden, weight, bias, labels, temperature, chunk_size, calculate_entropy, tiles, splits,
                            dz_budget)
