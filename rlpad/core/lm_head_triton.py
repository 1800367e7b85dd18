"""The fused LM head on CUDA (Triton): per-token log-prob and entropy with fp32 logits.

Forward, one kernel (:func:`_stats_kernel`): a program owns ``BLOCK_N`` tokens and a slice of the
vocabulary; over its V tiles it forms ``z = h @ W_tile^T (+ b) / T`` with a tensor-core dot in
fp32 accumulation and keeps, online, ``m = max z``, ``s = sum exp(z - m)``, ``t = sum exp(z - m)
(z - m)`` (centred: its rounding scales with the entropy, not with |z|) and the label's ``z``.
Nothing (N, V) is written: the slices' (m, s, t, z_label) are (splits, N) and merged in torch into
``lse = m + log s``, ``E_p[z] = m + t / s``, ``log_prob = z_label - lse``, ``entropy = log s - t / s``
(fp32, no cancellation of m), and ``lse`` and ``E_p[z]`` are saved for the backward. The
vocabulary is split over programs so that a few thousand tokens still fill every SM.

Backward: with ``p = exp(z - lse)``, ``dz = (g_lp (onehot(y) - p) - g_H p (z - E_p[z])) / T``.
One kernel (:func:`_dz_kernel`, a GEMM with this epilogue) recomputes z tile by tile and writes
dz in the weight's dtype for a slice of the vocabulary (all tokens x ``v_block`` columns, at most
``chunk_size x V`` elements, the memory ``logits_chunk_size`` allows); then two cuBLAS GEMMs in
that dtype with fp32 accumulation: ``grad_W[slice] = dz^T @ h`` (complete per slice: no fp32
weight-sized buffer, no accumulation across chunks) and ``grad_h += dz @ W[slice]`` (fp32
accumulator of (N, H) when there are several slices). The bias gradient is ``dz.sum(0)`` in fp32.

Why this design: the three GEMMs (logits, grad_hidden, grad_weight) are the floor, and cuBLAS
does the two backward ones at full tensor-core speed; the only extra work is the recompute of the
logits inside :func:`_dz_kernel` plus one bf16 write and two reads of dz. liger-kernel's fused
linear cross-entropy has no entropy; verl's kernel lives inside verl (no dependency).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rlpad.core.lm_head import mm_fp32

__all__ = ["TritonHead", "triton_log_probs_and_entropy"]

# Tile shapes: (tokens, vocabulary, hidden) per program, and launch settings (H100-sized).
BLOCK_N, BLOCK_V, BLOCK_K, NUM_WARPS, NUM_STAGES, GROUP_N = 128, 128, 64, 8, 3, 8
WAVES = 4  # programs per SM the forward aims for (vocabulary splits x token blocks)


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, temperature,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    """z (BLOCK_N, BLOCK_V) fp32 = (h[rows] @ W[cols]^T + b[cols]) / temperature."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        kk = k + ks
        k_ok = kk < H
        a = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_w + kk[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc / temperature


# Sizes vary per call and carry no alignment the loads need: not specialised (one compile per flag set).
@triton.jit(do_not_specialize=["N", "V", "tiles_per_split"])
def _stats_kernel(h_ptr, w_ptr, b_ptr, y_ptr, m_ptr, s_ptr, t_ptr, zl_ptr, N, V, H, stride_h, stride_w,
                  temperature, tiles_per_split, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (token block, split): online (m, s, t, z_label) over the split's V tiles -> [split, rows]."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
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
                         HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, PRECISION)
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
    out = split * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)
    tl.store(zl_ptr + out, zl, mask=row_ok)


@triton.jit(do_not_specialize=["N", "v_start", "VB"])
def _dz_kernel(h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, dz_ptr, N, v_start, VB, H,
               stride_h, stride_w, temperature, HAS_BIAS: tl.constexpr, HAS_GLP: tl.constexpr,
               HAS_GENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_N: tl.constexpr, PRECISION: tl.constexpr):
    """Program = one (BLOCK_N, BLOCK_V) tile of dz (N, VB) for the columns v_start + [0, VB)."""
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    blocks_v = tl.cdiv(VB, BLOCK_V)
    per_group = GROUP_N * blocks_v  # grouped order: GROUP_N token blocks share each W tile in L2
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
                     HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, PRECISION)
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
    tl.store(dz_ptr + rows[:, None] * VB + local[None, :], dz.to(dz_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact fp32 products for fp32 operands (tests), native for bf16 / fp16."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int]:
    """``(SMs, pipeline stages)`` for ``device``: 3 stages of 128 x 64 + 64 x 128 bf16 tiles need
    96 KiB of shared memory, which GPUs with ~100 KiB per block (sm_86, sm_89) cannot spare."""
    if device.type != "cuda":
        return 4, NUM_STAGES  # Triton's interpreter: any
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    return props.multi_processor_count, NUM_STAGES if smem >= 160 * 1024 else 2


def _splits(n_blocks: int, v_tiles: int, device: torch.device) -> int:
    """Vocabulary splits so that token blocks x splits is about WAVES programs per SM."""
    return max(1, min(v_tiles, -(-WAVES * _device_limits(device)[0] // n_blocks)))


def head_stats(hidden, weight, bias, labels, temperature, *, splits=None, blocks=(BLOCK_N, BLOCK_V, BLOCK_K)):
    """``(log_prob, entropy, lse, E_p[z])``, each (N,) fp32, from one fused pass (no (N, V) tensor)."""
    n, h = hidden.shape
    v = weight.shape[0]
    bn, bv, bk = blocks
    n_blocks, v_tiles = triton.cdiv(n, bn), triton.cdiv(v, bv)
    splits = splits or _splits(n_blocks, v_tiles, hidden.device)
    per_split = triton.cdiv(v_tiles, splits)
    splits = triton.cdiv(v_tiles, per_split)  # every split gets at least one tile
    m, s, t, zl = torch.empty(4, splits, n, dtype=torch.float32, device=hidden.device)
    _stats_kernel[(n_blocks, splits)](
        hidden, weight, bias if bias is not None else weight, labels, m, s, t, zl, n, v, h,
        hidden.stride(0), weight.stride(0), float(temperature), per_split, HAS_BIAS=bias is not None,
        BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, PRECISION=_precision(hidden.dtype), num_warps=NUM_WARPS,
        num_stages=_device_limits(hidden.device)[1])  # fmt: skip
    top = m.amax(dim=0)
    shift = m - top  # <= 0
    scale = torch.exp(shift)
    total = (s * scale).sum(dim=0)
    centred = (scale * (t + s * shift)).sum(dim=0) / total  # E_p[z] - top
    log_total = total.log()
    lse = top + log_total
    return zl.sum(dim=0) - lse, log_total - centred, lse, top + centred


class TritonHead(torch.autograd.Function):
    """Log-prob and entropy through the LM head with the fused kernels (see the module docstring).

    ``hidden (N, H)`` and ``weight (V, H)`` share one dtype (bf16 / fp16 on CUDA; fp16 / fp32 under
    Triton's interpreter); ``chunk_size`` bounds the backward's dz buffer to ``chunk_size x V``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, calculate_entropy, blocks, splits):
        hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
        bias = bias.contiguous() if bias is not None else None
        log_probs, entropy, lse, mean_z = head_stats(hidden, weight, bias, labels, temperature, splits=splits,
                                                     blocks=blocks)  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, labels, lse, mean_z)
        ctx.temperature, ctx.chunk_size, ctx.blocks = temperature, chunk_size, blocks
        ctx.set_materialize_grads(False)  # an unused output's gradient is None: the kernel drops its term
        if not calculate_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, labels, lse, mean_z = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        if not (need_h or need_w or need_b) or (grad_log_probs is None and grad_entropy is None):
            return None, None, None, None, None, None, None, None, None
        n, h = hidden.shape
        v = weight.shape[0]
        bn, bv, bk = ctx.blocks
        # A vocabulary slice of dz holds at most chunk_size x V elements (whole tiles, at least one).
        v_block = min(v, max(bv, (ctx.chunk_size * v // n) // bv * bv))
        slices = [(s, min(s + v_block, v)) for s in range(0, v, v_block)]
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.zeros(v, dtype=torch.float32, device=weight.device) if need_b else None
        grad_h = None
        if need_h:
            grad_h = torch.zeros(n, h, dtype=torch.float32, device=hidden.device) if len(slices) > 1 else None
        glp = grad_log_probs.float().contiguous() if grad_log_probs is not None else None
        gent = grad_entropy.float().contiguous() if grad_entropy is not None else None
        buffer = torch.empty(n * v_block, dtype=weight.dtype, device=weight.device)
        for start, end in slices:
            vb = end - start
            d = buffer[: n * vb].view(n, vb)  # dz of this slice, contiguous
            grid = (triton.cdiv(n, bn) * triton.cdiv(vb, bv),)
            _dz_kernel[grid](
                hidden, weight, bias if bias is not None else weight, labels, lse, mean_z,
                glp if glp is not None else lse, gent if gent is not None else lse, d, n, start, vb, h,
                hidden.stride(0), weight.stride(0), float(ctx.temperature), HAS_BIAS=bias is not None,
                HAS_GLP=glp is not None, HAS_GENT=gent is not None, BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk,
                GROUP_N=GROUP_N, PRECISION=_precision(hidden.dtype), num_warps=NUM_WARPS,
                num_stages=_device_limits(hidden.device)[1])  # fmt: skip
            if grad_w is not None:
                torch.mm(d.t(), hidden, out=grad_w[start:end])
            if need_h:
                if len(slices) == 1:
                    grad_h = torch.mm(d, weight)
                else:
                    grad_h.add_(mm_fp32(d, weight[start:end]))
            if grad_b is not None:
                grad_b[start:end] = d.sum(dim=0, dtype=torch.float32)
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def triton_log_probs_and_entropy(hidden, weight, labels, *, bias=None, temperature=1.0, chunk_size=1024,
                                 calculate_entropy=True, blocks=(BLOCK_N, BLOCK_V, BLOCK_K), splits=None):
    """``(log_probs (N,), entropy (N,))`` fp32 through the fused head; inputs checked by the caller
    (:func:`rlpad.core.logprob.chunked_log_probs_and_entropy`). ``blocks`` / ``splits``: tile shape
    and vocabulary splits of the forward (small ones let the tests cross every boundary)."""
    return TritonHead.apply(hidden, weight, bias, labels, temperature, chunk_size, calculate_entropy, blocks, splits)
